"""The server behind :func:`tests.cli.run_cli`: runs ``editrain`` commands for the test suite,
each in a process forked from this one, which has imported torch and editrain once.

An ``editrain train`` started as a new interpreter spends seconds of CPU importing torch in
the launcher and again in the process its workers come from, more than the tiny runs of the
suite spend training. Here each command is a fork of this process: a fresh process (its own
signal handlers, logging, environment, working directory and process group, its own stdout
and stderr files) that starts with everything imported. Its launcher starts its workers as
``editrain train`` does, from a fork server of its own that writes where it writes.

Protocol, one JSON object per line: the client writes ``{"args", "env", "cwd", "stdout",
"stderr"}`` to this process's stdin; this process answers ``{"pid"}`` once the command's
process exists (the client kills its process group on a timeout) and ``{"returncode",
"cpu_s"}`` when it has ended (``stderr`` may name the ``stdout`` file: both go there) (``cpu_s``: CPU seconds of the command and every process it
waited for). This process never runs a torch operation or starts a thread, so that a fork of
it is as clean as a new interpreter.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import signal
import socket
import sys
import traceback

import editrain.cli

PRELOAD = ("editrain.train", "editrain.launch", "editrain.plan.cli", "editrain.metrics",
           "torch._dynamo", "torch.distributed.launcher.api", "matplotlib.pyplot")
"""What a command imports as it runs (the launcher, its workers, the plots; torch imports
``torch._dynamo`` at the first optimizer a process builds, 2.5 s of CPU): imported once."""


def _run_command(request: dict, channels: tuple[int, int]) -> int:
    """In the forked process: become the command and return its exit code."""
    os.setpgid(0, 0)
    for fd in channels:
        os.close(fd)
    out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    if request["stderr"] == request["stdout"]:  # both to one file, as 2>&1
        os.dup2(out, 2)
    else:
        err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(err, 2)
        os.close(err)
    os.close(out)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["editrain", *request["args"]]
    if request["args"][:1] == ["train"]:
        _fork_worker_server()
    try:
        return editrain.cli.main(request["args"])
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001  (as the interpreter would: traceback, exit 1)
        traceback.print_exc()
        return 1


def _fork_worker_server() -> None:
    """In a command that starts workers, before it runs: start :mod:`multiprocessing`'s fork
    server as a fork of this process, instead of the new interpreter that the launcher's
    ``forkserver.ensure_running()`` would start (one that imports torch and editrain again:
    3 s of CPU per command, most of a tiny run's cost).

    The server is what ``ensure_running`` starts, made the same way: a listening socket, the
    "alive" pipe whose end of file tells it to exit, SIGINT blocked as the launcher starts
    it (:func:`editrain.spawn.children_start_with_sigint_blocked`), then
    ``multiprocessing.forkserver.main``. This process has not run a torch operation or
    started a thread, the command's environment, working directory and output files are in
    place, so the server is the one the launcher would start with everything already
    imported. ``ensure_running`` finds it alive (a child of this process) and keeps it. It
    fills in the three attributes of the module's server object that ``ensure_running``
    sets: where a Python lacks them, or the command sets another start method, the launcher
    starts its own server as before."""
    from multiprocessing import connection, forkserver, util

    from editrain.spawn import START_METHOD_ENV

    if os.environ.get(START_METHOD_ENV, "forkserver") != "forkserver":
        return
    server = forkserver._forkserver
    fields = ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid")
    if not all(getattr(server, f, "missing") is None for f in fields):
        return
    listener = socket.socket(socket.AF_UNIX)
    address = connection.arbitrary_address("AF_UNIX")
    listener.bind(address)
    if not util.is_abstract_socket_namespace(address):
        os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(alive_w)
        try:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            # as the real server's preload (editrain.worker_server) does: its children
            # die with it
            from editrain.spawn import children_die_with_this_process

            children_die_with_this_process()
            forkserver.main(listener.fileno(), alive_r, [])
        finally:
            os._exit(0)
    os.close(alive_r)
    listener.close()
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid


def serve() -> None:
    """Answer requests from stdin until it closes."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    for name in PRELOAD:
        importlib.import_module(name)
    # The protocol gets its own descriptors; 0 and 1 become the commands' to replace.
    requests = os.fdopen(os.dup(0), "r")
    answers = os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)

    def answer(message: dict) -> None:
        os.write(answers, (json.dumps(message) + "\n").encode())

    for line in requests:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _run_command(request, (requests.fileno(), answers))
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code if isinstance(code, int) and 0 <= code < 256 else 1)
        try:
            os.setpgid(pid, pid)  # also here, so that the client can kill it at once
        except OSError:  # it already did (or ended)
            pass
        answer({"pid": pid})
        _, status = os.waitpid(pid, 0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        answer({"returncode": os.waitstatus_to_exitcode(status), "cpu_s": cpu})


if __name__ == "__main__":
    serve()
