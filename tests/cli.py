"""Run the ``editrain`` command from tests: :func:`run_cli`.

A command runs as a fork of one server process (:mod:`tests.cli_server`) that has imported
torch and editrain once for the whole session, instead of as a new interpreter: the same
``editrain.cli.main`` in a fresh process with the environment, working directory, stdout and
stderr the test gives it. Its launcher starts its workers as ``editrain train`` does, from
:mod:`multiprocessing`'s fork server, which writes to the command's stdout and stderr; for
``train`` that server is itself a fork of the command made before the command runs
(:func:`tests.cli_server._fork_worker_server`), so it does not import torch and editrain
again. A tiny ``editrain train`` took about 15 s as a new interpreter and about 7 s as a
fork on the first 2-core machine; on the second, about 3.2 s as a fork whose fork server
is a new interpreter and about 1.2 s with the forked fork server. (Workers forked from the
launcher itself, which has threads by then, hung 2 runs out of about 450.)

What a new interpreter would read before ``main`` runs cannot change in a fork (thread and
allocator settings, ``PYTHON*``): a command whose environment differs from the server's in
those runs as a new interpreter, and so does every command when ``EDITRAIN_TEST_CLI`` is
``subprocess``. Tests of the launcher's own process handling (signals, start methods, a
launcher killed with its workers) start the console script themselves.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODE_ENV = "EDITRAIN_TEST_CLI"
"""``subprocess``: every command is a new interpreter (``server``, the default: forked)."""

SERVER_ENV = {"OMP_NUM_THREADS": "1"}
"""Set in the server's environment: the suite's runs use one thread per process."""

STARTUP_PREFIXES = ("OMP_", "MKL_", "OPENBLAS_", "GOMP_", "KMP_", "MALLOC_", "LD_", "PYTHON",
                    "CUDA_", "TORCH_")
"""Variables read when a process starts (by libgomp, glibc, the interpreter, torch's
import): a command whose values differ from the server's cannot be a fork of it."""


def sigint_as_in_a_terminal() -> None:
    """``preexec_fn`` of a test's child that is to be stopped by Ctrl-C: SIGINT's default
    disposition, as a terminal gives it. A suite started in the background of a
    non-interactive shell (``cmd &``, ``nohup``) inherits SIGINT ignored, every process it
    starts inherits that through ``exec``, and editrain then rightly leaves it ignored
    (``editrain.entry``): Ctrl-C could not be tested there."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class _Server:
    """The running server and the one command it runs at a time."""

    def __init__(self) -> None:
        self.env = {**os.environ, **SERVER_ENV}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.cli_server"], cwd=ROOT,
                                     env=self.env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def can_run(self, env: Mapping[str, str]) -> bool:
        """Whether a fork of the server has what a new interpreter with ``env`` would."""
        keys = {k for k in (*env, *self.env) if k.startswith(STARTUP_PREFIXES)}
        return all(env.get(k) == self.env.get(k) for k in keys)

    def _receive(self, timeout: float | None) -> dict | None:
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                return None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the test CLI server died (exit code {self.proc.wait()})")
        return json.loads(line)

    def run(self, args: list[str], env: dict[str, str], cwd: Path, timeout: float,
            merged: bool) -> subprocess.CompletedProcess:
        out_dir = Path(tempfile.mkdtemp(prefix="editrain-cli-"))
        out_path, err_path = out_dir / "stdout", out_dir / ("stdout" if merged else "stderr")
        try:
            request = {"args": args, "env": env, "cwd": str(cwd), "stdout": str(out_path),
                       "stderr": str(err_path)}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            pid = self._receive(None)["pid"]
            done = self._receive(timeout)
            if done is None:  # as subprocess.run: kill it (and its workers), then raise
                _kill_group(pid)
                self._receive(None)
                raise subprocess.TimeoutExpired(["editrain", *args], timeout)
            out = out_path.read_text(errors="replace")
            err = None if merged else err_path.read_text(errors="replace")
        finally:
            shutil.rmtree(out_dir, ignore_errors=True)
        proc = subprocess.CompletedProcess(["editrain", *args], done["returncode"], out, err)
        proc.cpu_s = done["cpu_s"]  # type: ignore[attr-defined]
        proc.forked = True  # type: ignore[attr-defined]
        return proc

    def close(self) -> None:
        if self.alive():
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


_idle: list[_Server] = []
"""Servers not running a command. Commands run at the same time (from threads) each get
their own server; one is started when none is idle."""
_idle_lock = threading.Lock()


@contextlib.contextmanager
def _server() -> Iterator[_Server]:
    with _idle_lock:
        while _idle and not _idle[-1].alive():
            _idle.pop()
        server = _idle.pop() if _idle else None
    if server is None:
        server = _Server()
        atexit.register(server.close)
    try:
        yield server
    except BaseException:  # its protocol may be mid-message: not reused
        server.close()
        raise
    with _idle_lock:
        _idle.append(server)


def _kill_group(pid: int) -> None:
    """Kill the command's process group (it and its workers) after its timeout; one that
    ended between the timeout and the kill is gone already (a busy machine once turned a
    timeout into a ProcessLookupError that hid it)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _run_subprocess(args: list[str], env: dict[str, str], cwd: Path, timeout: float,
                    merged: bool) -> subprocess.CompletedProcess:
    """The command as a new interpreter, in its own session (killed whole on a timeout)."""
    import resource

    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime

    cpu0 = cpu()
    with subprocess.Popen([sys.executable, "-m", "editrain", *args], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT if merged else subprocess.PIPE, text=True,
                          env=env, cwd=cwd,
                          start_new_session=True) as popen:
        try:
            out, err = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(popen.pid)
            popen.communicate()
            raise
    proc = subprocess.CompletedProcess(popen.args, popen.returncode, out, err)
    proc.cpu_s = cpu() - cpu0  # type: ignore[attr-defined]
    proc.forked = False  # type: ignore[attr-defined]
    return proc


def run_cli(args: Sequence[str], *, env: Mapping[str, str] | None = None,
            cwd: Path | str = ROOT, timeout: float = 280, merged: bool = False
            ) -> subprocess.CompletedProcess:
    """Run ``editrain ARGS`` to its end, like ``subprocess.run(..., capture_output=True,
    text=True)``: the result has ``returncode``, ``stdout``, ``stderr``, ``cpu_s`` (CPU
    seconds of the command and every process it started and waited for) and ``forked``
    (whether it ran as a fork of the server).

    Args:
        args: the command's arguments (``["train", ...]``).
        env: its whole environment (default: this process's).
        cwd: its working directory.
        timeout: seconds before it is killed with everything it started
            (``subprocess.TimeoutExpired``).
        merged: stderr goes where stdout goes (``stderr`` is None), as ``2>&1``.
    """
    args = [str(a) for a in args]
    env = dict(os.environ if env is None else env)
    mode = os.environ.get(MODE_ENV, "server")
    if mode not in ("server", "subprocess"):
        raise ValueError(f"{MODE_ENV}={mode!r}: allowed are server and subprocess")
    if mode == "subprocess":
        return _run_subprocess(args, env, Path(cwd), timeout, merged)
    with _server() as server:
        if not server.can_run(env):
            return _run_subprocess(args, env, Path(cwd), timeout, merged)
        return server.run(args, env, Path(cwd), timeout, merged)
