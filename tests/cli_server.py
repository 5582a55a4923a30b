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
