"""Launcher hygiene, through the console script: a worker's error comes back as one line
(tracebacks kept in ``RUN_DIR/logs/``), Ctrl-C / SIGTERM stop every worker, a launcher killed
with SIGKILL takes its workers with it, and a rendezvous port taken in the meantime is
replaced."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from editrain import cli
from editrain.launch import elastic
from editrain.paths import shown
from editrain.spawn import (
    LOOPBACK,
    START_METHOD_ENV,
    USER_ERRORS,
    LaunchError,
    one_line,
    read_error_file,
    run_ranks,
    watch_process,
    worker_start_method,
)
from tests.cli import sigint_as_in_a_terminal
from tests.test_cli import COMMAND, editrain, explain, tiny

ROOT = Path(__file__).resolve().parents[1]
SMALL = ("--nproc", "2", "--shard-size", "1", "--quiet")
GONE_WITHIN_S = 5.0

serial = pytest.mark.serial
"""On the tests that time how fast processes stop or start: they run alone, after the
others (README's test command), as a machine under the load of parallel tests would fail
them. The rest of this module runs in parallel."""


@pytest.fixture(scope="module")
def cache_dir(data_cache) -> Path:
    return data_cache


# ---------------------------------------------------------------------------- helpers
def one_error_line(stderr: str) -> str:
    """The one ``editrain: error: ...`` line of a failed run, with nothing of torch elastic's
    report or a traceback around it."""
    lines = [line for line in stderr.splitlines() if line.startswith("editrain: error: ")]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr and "torch.distributed.elastic" not in stderr, stderr
    assert "ChildFailedError" not in stderr, stderr
    return lines[0]


def stat_of(pid: int) -> tuple[int, str] | None:
    """``(parent pid, state)`` of a process from ``/proc``; None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # the name, in parentheses, may hold spaces
    return int(fields[1]), fields[0]


def descendants(pid: int) -> list[int]:
    """Every living process below ``pid`` (children, grandchildren, ...)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := stat_of(int(entry.name))) is not None:
            children.setdefault(st[0], []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def started_by_multiprocessing(pid: int) -> bool:
    """Whether ``pid`` is a process started by ``multiprocessing``: a spawned one, or one
    forked from a fork server (a child of the server; the server itself is not one)."""
    line = cmdline(pid)
    if "spawn_main" in line:
        return True
    server = "multiprocessing.forkserver"
    return server in line and (st := stat_of(pid)) is not None and server in cmdline(st[0])


def alive(pids: list[int]) -> list[int]:
    """The processes of ``pids`` still running (a zombie has ended)."""
    return [p for p in pids if (st := stat_of(p)) is not None and st[1] != "Z"]


def wait_until_gone(pids: list[int], timeout: float = GONE_WITHIN_S) -> list[int]:
    deadline = time.monotonic() + timeout
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive(pids)


def start_run(cache_dir: Path, run_dir: Path, *args: str,
              start_method: str | None = None) -> subprocess.Popen:
    """A long run of the console script in its own session (a terminal's process group:
    ``killpg`` reaches the launcher and every process it started, as Ctrl-C does); its
    workers started by ``start_method`` (default: the suite's)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID",
                        "MASTER_ADDR", "MASTER_PORT")}
    if start_method is not None:
        env[START_METHOD_ENV] = start_method
    return subprocess.Popen([*COMMAND, "train", *tiny(cache_dir), *SMALL, "--steps", "100000",
                             "--run-dir", str(run_dir), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True, preexec_fn=sigint_as_in_a_terminal)


def wait_for(proc: subprocess.Popen, ready, what: str, timeout: float = 100) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"never saw {what} (exit {proc.returncode})\n{err[-3000:]}")
        time.sleep(0.02)


def finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"the launcher did not end within {timeout} s after the signal\n{err}")
    return proc.returncode, err


def training(run_dir: Path, ranks: int = 2):
    """Whether every worker has logged a step."""
    return lambda: all((run_dir / "ranks" / f"rank{r}.jsonl").exists() for r in range(ranks))


def booting(proc: subprocess.Popen, n: int = 2):
    """Whether ``n`` worker processes exist (started, perhaps still importing torch)."""
    return lambda: sum(map(started_by_multiprocessing, descendants(proc.pid))) >= n


# ---------------------------------------------------------------------------- worker errors
@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory, cache_dir) -> Path:
    run_dir = tmp_path_factory.mktemp("runs") / "ckpt"
    proc, _ = editrain("train", *tiny(cache_dir), *SMALL, "--steps", "4",
                       "--checkpoint.every", "2", "--run-dir", str(run_dir), timeout=120)
    assert proc.returncode == 0, explain(proc)
    return run_dir


@pytest.mark.slow
def test_a_worker_error_is_one_line_exit_2_with_the_traceback_in_logs(checkpointed, cache_dir):
    """A checkpoint whose tensor data was overwritten in the middle (same size: the checks
    before launch cannot see it) fails inside the workers while loading."""
    ckpt = sorted((checkpointed / "checkpoints").glob("step_*"))[-1]
    data = ckpt / "__1_0.distcp"
    raw = bytearray(data.read_bytes())
    mid = len(raw) // 2
    raw[mid - len(raw) // 4: mid + len(raw) // 4] = bytes(2 * (len(raw) // 4))
    data.write_bytes(bytes(raw))

    proc, _ = editrain("train", *tiny(cache_dir), *SMALL, "--steps", "6",
                       "--resume", str(checkpointed), timeout=120)
    assert proc.returncode == 2, explain(proc)
    line = one_error_line(proc.stderr)
    assert "cannot read checkpoint data" in line and shown(ckpt) in line, line
    assert len(proc.stderr.strip().splitlines()) <= 2, proc.stderr
    rank = int(line.split("rank ", 1)[1].split(":", 1)[0])
    log = Path(line.rsplit("(traceback: ", 1)[1].rstrip(")").strip('"'))
    assert line.endswith(f"(traceback: {shown(log)})"), line
    assert log == checkpointed / "logs" / f"rank{rank}.log", line
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "CheckpointError" in text
    assert (checkpointed / "logs" / f"rank{rank}.error.json").is_file()


def test_a_worker_errors_log_names_the_restart_count_as_such(tmp_path, monkeypatch):
    """The section header of ``rank{R}.log`` names TORCHELASTIC_RESTART_COUNT as what it
    is, not as the attempt's number: torch elastic does not count a restart caused by a
    change of the nodes taking part, and after one node's failure the counts differ
    between nodes. Before, the header said 'attempt 0' for such a restart."""
    from editrain.spawn import errors_logged

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    with pytest.raises(KeyError), errors_logged(tmp_path / "logs", 3, 1):
        raise KeyError("boom")
    header = (tmp_path / "logs" / "rank3.log").read_text().splitlines()[0]
    assert header.endswith(", TORCHELASTIC_RESTART_COUNT 0): KeyError"), header
    assert "attempt" not in header


@pytest.mark.slow
def test_a_worker_that_dies_is_named_with_its_exit_code(tmp_path, cache_dir):
    """``sim.fail`` ends rank 1 abruptly (``os._exit(17)``, like a crash): rank 0 then
    loses its peer; the line names rank 1, not rank 0's consequential error."""
    run_dir = tmp_path / "run"
    proc, _ = editrain("train", *tiny(cache_dir), *SMALL, "--steps", "4", "--sim.fail", "1@2",
                       "--run-dir", str(run_dir), timeout=120)
    assert proc.returncode == 1, explain(proc)
    line = one_error_line(proc.stderr)
    assert "rank 1 exited with code 17" in line, line
    assert str(run_dir / "logs" / "launcher.log") in line
    assert "exitcode: 17" in (run_dir / "logs" / "launcher.log").read_text()


# ---------------------------------------------------------------------------- signals
def assert_stopped(proc: subprocess.Popen, workers: list[int], code: int, line: str) -> str:
    """The launcher ended with ``code`` and ``line`` last on stderr, no traceback, and every
    one of ``workers`` is gone; returns stderr."""
    got, err = finish(proc)
    assert got == code, err
    assert err.strip().splitlines()[-1] == line, err
    assert "Traceback" not in err, err
    assert not wait_until_gone(workers), [cmdline(p) for p in alive(workers)]
    return err


@serial
@pytest.mark.slow
@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_ctrl_c_while_the_workers_start_stops_everything_quietly(tmp_path, cache_dir,
                                                                 start_method):
    """SIGINT to the whole process group, as a terminal sends it, while the workers are
    still starting (spawned: importing Python's site module, then torch): no
    KeyboardInterrupt traceback and no 'Fatal Python error: init_import_site' from any of
    them. Before the launcher started multiprocessing's resource tracker ahead of blocking
    SIGINT (``spawn.children_start_with_sigint_blocked``), starting the tracker unblocked it
    again and spawned workers printed that error in about 1 run of 2."""
    proc = start_run(cache_dir, tmp_path / "run", start_method=start_method)
    wait_for(proc, booting(proc), "the workers")
    workers = descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    err = assert_stopped(proc, workers, 130, "editrain: interrupted")
    assert "KeyboardInterrupt" not in err and "Fatal Python error" not in err, err


@serial
@pytest.mark.slow
def test_ctrl_c_while_training_stops_everything_quietly(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    proc = start_run(cache_dir, run_dir)
    wait_for(proc, training(run_dir), "training")
    workers = descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    assert_stopped(proc, workers, 130, "editrain: interrupted")


@pytest.mark.slow
@pytest.mark.parametrize("sig, code, line", [
    (signal.SIGINT, 130, "editrain: interrupted"),
    (signal.SIGTERM, 143, "editrain: stopped by SIGTERM"),
])
@serial
def test_a_signal_to_the_launcher_alone_stops_its_workers(tmp_path, cache_dir, sig, code,
                                                         line):
    run_dir = tmp_path / "run"
    proc = start_run(cache_dir, run_dir)
    wait_for(proc, training(run_dir), "training")
    workers = descendants(proc.pid)
    os.kill(proc.pid, sig)
    assert_stopped(proc, workers, code, line)


def kill_launcher(proc: subprocess.Popen, below: list[int], timeout: float) -> list[int]:
    """SIGKILL the launcher; the processes of ``below`` still alive ``timeout`` s later
    (killed then, so that nothing is left behind for the rest of the suite)."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)  # not communicate(): orphans would hold its pipes open
    proc.stdout.close()
    proc.stderr.close()
    left = wait_until_gone(below, timeout)
    for p in left:
        os.kill(p, signal.SIGKILL)
    return left


@serial
@pytest.mark.slow
@pytest.mark.parametrize("when", ["starting", "training"])
def test_workers_die_with_a_launcher_killed_with_sigkill(tmp_path, cache_dir, when):
    """While the workers start, the launcher may die before they can ask to die with it:
    they find out once started. While they train: the kernel ends them."""
    run_dir = tmp_path / "run"
    proc = start_run(cache_dir, run_dir)
    if when == "starting":
        wait_for(proc, booting(proc), "the workers")
    else:
        wait_for(proc, training(run_dir), "training")
    workers = [p for p in descendants(proc.pid) if started_by_multiprocessing(p)]
    assert len(workers) == 2, [cmdline(p) for p in descendants(proc.pid)]
    # A starting worker first finishes importing torch (seconds on a loaded machine).
    left = kill_launcher(proc, workers, 60 if when == "starting" else GONE_WITHIN_S)
    assert not left, "workers outlived their launcher"


@serial
@pytest.mark.slow
def test_ft_workers_die_with_a_launcher_killed_with_sigkill(tmp_path, cache_dir):
    """The fault-tolerant launcher -> one process per replica group -> its workers: all of
    them die with the launcher."""
    pytest.importorskip("torchft")
    run_dir = tmp_path / "run"
    proc = start_run(cache_dir, run_dir, "--ft", "--nproc", "4", "--shard-size", "2")
    wait_for(proc, lambda: all(training(run_dir / f"replica{r}")() for r in (0, 1)),
             "both replica groups training", timeout=110)
    below = descendants(proc.pid)
    assert sum(map(started_by_multiprocessing, below)) >= 6, [cmdline(p) for p in below]
    left = kill_launcher(proc, below, GONE_WITHIN_S)
    assert not left, "replica groups or workers outlived their launcher"


@serial
@pytest.mark.slow
def test_ft_ctrl_c_stops_every_group_in_order_and_quietly(tmp_path, cache_dir):
    """Ctrl-C reaches the fault-tolerant launcher, its replica groups and their workers at
    once: the groups stop their workers in order (nothing left for the resource tracker to
    warn about) and only the launcher says something."""
    pytest.importorskip("torchft")
    run_dir = tmp_path / "run"
    proc = start_run(cache_dir, run_dir, "--ft", "--nproc", "4", "--shard-size", "2")
    wait_for(proc, lambda: all(training(run_dir / f"replica{r}")() for r in (0, 1)),
             "both replica groups training", timeout=110)
    below = descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    code, err = finish(proc)
    assert code == 130, err
    assert err.strip().splitlines()[-1] == "editrain: interrupted", err
    for noise in ("Traceback", "Logging error", "race condition", "leaked", "failed"):
        assert noise not in err, err
    assert not wait_until_gone(below), [cmdline(p) for p in alive(below)]


# ---------------------------------------------------------------------------- the port
@pytest.fixture
def taken_port():
    """A loopback port some other process listens on."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture
def in_process(monkeypatch):
    """Running the command in this process: its environment changes are undone after."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    for key in ("OMP_NUM_THREADS", "TORCHELASTIC_SIGNALS_TO_HANDLE"):
        monkeypatch.setenv(key, os.environ.get(key, ""))
        monkeypatch.delenv(key)


def test_a_port_taken_every_time_fails_in_one_line(tmp_path, cache_dir, taken_port,
                                                   monkeypatch, capsys, in_process):
    calls = []
    monkeypatch.setattr(elastic, "free_port", lambda: calls.append(taken_port) or taken_port)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    code = cli.main(["train", *tiny(cache_dir), *SMALL, "--steps", "2",
                     "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 1, err
    line = one_error_line(err)
    assert str(taken_port) in line and "rendezvous" in line, line
    assert len(calls) == elastic.PORT_TRIES
    assert {s: signal.getsignal(s) for s in handlers} == handlers  # left as they were


@pytest.mark.slow
def test_a_taken_port_is_replaced(tmp_path, cache_dir, taken_port, monkeypatch, capsys,
                                  in_process):
    from editrain.spawn import free_port

    ports = iter([taken_port])
    monkeypatch.setattr(elastic, "free_port", lambda: next(ports, None) or free_port())
    run_dir = tmp_path / "run"
    code = cli.main(["train", *tiny(cache_dir), *SMALL, "--steps", "2", "--run-dir",
                     str(run_dir)])
    assert code == 0, capsys.readouterr().err
    assert next(ports, None) is None  # the taken port was tried
    assert (run_dir / "summary.json").is_file()


# ---------------------------------------------------------------------------- the line
def error_file(path: Path, name: str, message: str) -> Path:
    """An error file as torch elastic's ``record`` writes it."""
    path.write_text(json.dumps({"message": {"message": f"{name}: {message}", "extraInfo": {
        "py_callstack": "Traceback ...", "timestamp": "0"}}}))
    return path


def test_every_group_failing_quotes_the_run_directory_not_the_logs_pattern(tmp_path):
    """The run directory is quoted as every path is, the pattern of the groups' log
    directories after it is not: quoted whole (``"RUN/replica*/logs"``, as 9668aa8 wrote
    it) the glob read as one directory named ``replica*``, and a shell would not expand
    it. The exit code is 2 only where every group died of an error editrain reported."""
    from editrain.launch.ft import every_group_failed

    run = tmp_path / "my run"
    e = every_group_failed(run, [2, 2])
    assert str(e) == ("every replica group failed (each one's reason is above; the "
                      f"tracebacks are in {shown(run)}/replica*/logs/); nothing finished")
    assert e.exit_code == 2
    assert every_group_failed(run, [2, 1]).exit_code == every_group_failed(run, []).exit_code == 1

def test_the_line_prefers_an_editrain_error_over_a_lost_peer(tmp_path):
    files = {0: error_file(tmp_path / "rank0.error.json", "RuntimeError",
                           "Connection closed by peer"),
             1: error_file(tmp_path / "rank1.error.json", "CheckpointError",
                           "step_2: cannot read\n  its data")}
    reported = (0, SimpleNamespace(exitcode=1))
    e = elastic.describe_failure(reported, files, tmp_path)
    assert e.exit_code == 2
    assert str(e) == f"rank 1: step_2: cannot read its data (traceback: {shown(files[1])})"
    (tmp_path / "rank1.log").write_text("Traceback ...")
    assert f"(traceback: {shown(tmp_path / 'rank1.log')})" in str(
        elastic.describe_failure(reported, files, tmp_path))


def test_the_line_of_a_crash_a_signal_and_an_unexpected_error(tmp_path):
    files = {0: tmp_path / "rank0.error.json", 1: tmp_path / "rank1.error.json"}
    e = elastic.describe_failure((1, SimpleNamespace(exitcode=-9)), files, tmp_path)
    assert e.exit_code == 1 and str(e).startswith("rank 1 was killed by SIGKILL"), e
    e = elastic.describe_failure((0, SimpleNamespace(exitcode=17)), files, tmp_path)
    assert str(e).startswith("rank 0 exited with code 17"), e
    error_file(files[0], "ZeroDivisionError", "division by zero")
    e = elastic.describe_failure((0, SimpleNamespace(exitcode=1)), files, tmp_path)
    assert e.exit_code == 1 and str(e).startswith("rank 0 failed: ZeroDivisionError: "), e


def test_error_files_are_per_rank_and_never_stale(tmp_path):
    specs = elastic.RunLogs(tmp_path)
    (tmp_path / "rank1.error.json").write_text("{}")  # an earlier run's
    envs = {0: {"RANK": "0"}, 1: {"RANK": "1"}}
    dest = specs.reify(envs)
    assert dest.error_files == {r: str(tmp_path / f"rank{r}.error.json") for r in (0, 1)}
    assert envs[1]["TORCHELASTIC_ERROR_FILE"] == str(tmp_path / "rank1.error.json")
    assert not (tmp_path / "rank1.error.json").exists()
    assert dest.stdouts == {0: "", 1: ""} and dest.stderrs == {0: "", 1: ""}  # the terminal


def test_read_error_file_and_one_line(tmp_path):
    assert read_error_file(tmp_path / "missing.json") is None
    assert read_error_file(error_file(tmp_path / "e.json", "ConfigError", "a: b")) == (
        "ConfigError", "a: b")
    assert "ConfigError" in USER_ERRORS and "RuntimeError" not in USER_ERRORS
    assert one_line("a\n  b\n\n c ") == "a b c"
    assert one_line("x" * 500, 20) == "x" * 17 + "..."


# ---------------------------------------------------------------------------- start methods
FORKED_CHILD = '''
import multiprocessing, os, sys, time
from editrain.spawn import die_with_parent

def child(ready):
    die_with_parent()
    ready.set()
    time.sleep(120)

if __name__ == "__main__":
    ctx = multiprocessing.get_context(sys.argv[1])
    ready = ctx.Event()
    p = ctx.Process(target=child, args=(ready,))
    p.start()
    assert ready.wait(120)
    print(p.pid, flush=True)
    time.sleep(120)
'''


@serial
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_child_dies_with_the_process_that_started_it(tmp_path, method):
    """A fork server's child has the server as its kernel parent, and the server lives as
    long as any of its children: the child watches the process that started it instead."""
    script = tmp_path / "launcher.py"
    script.write_text(FORKED_CHILD)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    proc = subprocess.Popen([sys.executable, str(script), method], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, PYTHONPATH=path))
    child = int(proc.stdout.readline())
    below = descendants(proc.pid)
    assert child in below
    if method == "forkserver":
        assert stat_of(child)[0] != proc.pid  # the server is the child's parent
    left = kill_launcher(proc, below, GONE_WITHIN_S)
    assert not left, [cmdline(p) for p in left]


@serial
def test_watch_process_calls_back_when_the_process_ends():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ended = threading.Event()
    watch_process(sleeper.pid, ended.set)
    assert not ended.wait(0.3)
    sleeper.kill()  # a zombie until reaped below: it has ended all the same
    assert ended.wait(GONE_WITHIN_S)
    sleeper.wait()
    gone = threading.Event()
    watch_process(sleeper.pid, gone.set)  # ended (and reaped) already: called at once
    assert gone.is_set()


def test_worker_start_method_follows_the_environment(monkeypatch):
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    assert worker_start_method() == "forkserver"
    monkeypatch.setenv(START_METHOD_ENV, "spawn")
    assert worker_start_method() == "spawn"
    monkeypatch.setenv(START_METHOD_ENV, "fork")
    with pytest.raises(LaunchError, match=f"{START_METHOD_ENV}=fork .*allowed: forkserver, "
                                          "spawn") as e:
        worker_start_method()
    assert e.value.exit_code == 2


def _agree_worker(rank: int, world: int, case: str, root: str) -> str:
    """What a worker's process-group setup (:func:`init_distributed`, whose check is
    :func:`check_ranks_agree`) says on this rank for a case of rank 1's command line."""
    from pathlib import Path

    from editrain import rundir
    from editrain.config import load_config
    from editrain.runtime import init_distributed

    over: dict = {"train": {"steps": 8}, "dist": {"shard_size": 1}}
    if rank == 1 and case == "steps":
        over = {"train": {"steps": 12, "lr": 0.03}, "dist": {"shard_size": 1}}
    if rank == 1 and case == "quiet":
        over = {**over, "quiet": True}
    if case == "mesh":  # 4 ranks: rank 1's mesh's groups would not be the others'
        over = {**over, "dist": {"shard_size": 1 if rank == 1 else 2}}
    if case in ("tokenizer", "same tokenizer"):  # each node's own copy
        copy = Path(root) / f"node{rank}" / "tokenizer.json"
        copy.parent.mkdir(parents=True)
        copy.write_text('{"model": "' + ("b" if rank and case == "tokenizer" else "a") + '"}')
        over = {**over, "data": {"tokenizer": str(copy)}}
    run_dir = Path(root) / ("node1" if rank == 1 and case == "unshared" else "shared")
    run_dir.mkdir(parents=True, exist_ok=True)
    if rank == 0 or case == "unshared":
        rundir.write_record(run_dir, rundir.RunRecord(run_id=f"run{rank}", branch="b"))
    import torch.distributed as dist

    dist.barrier()  # rank 0 has claimed it, as join() waits for
    try:
        init_distributed(load_config(None, over), run_dir)
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "ok"


def test_the_digest_of_a_model_directory_is_of_its_files_not_its_path(tmp_path, monkeypatch):
    """What check_ranks_agree compares for the per-node paths: the same files anywhere give
    the same digest; another config or other weights (at the start of a file larger than
    the two sampled ends) give another."""
    from editrain.runtime import SAMPLED_BYTES, input_digest

    weights = bytes(range(256)) * (3 * SAMPLED_BYTES // 256)
    for node in ("a", "b", "c", "d"):
        (tmp_path / node).mkdir()
        (tmp_path / node / "config.json").write_text('{"hidden_size": 8}')
        (tmp_path / node / "model.safetensors").write_bytes(weights)
        (tmp_path / node / "README.md").write_text(f"read by no one: {node}")
    (tmp_path / "c" / "config.json").write_text('{"hidden_size": 16}')
    (tmp_path / "d" / "model.safetensors").write_bytes(b"x" + weights[1:])
    digest = {node: input_digest(str(tmp_path / node)) for node in "abcd"}
    assert digest["a"] == digest["b"]
    assert len({digest["a"], digest["c"], digest["d"]}) == 3
    assert input_digest(str(tmp_path / "a" / "config.json")) != input_digest(
        str(tmp_path / "c" / "config.json"))
    assert input_digest(None) is None
    assert input_digest(str(tmp_path / "nowhere")) == f"not here: {tmp_path / 'nowhere'}"
    # a file this rank cannot read is a value to compare, not an error that would leave
    # the other ranks waiting in the gather
    import builtins

    real_open = builtins.open

    def refuse(file, *args, **kwargs):
        if str(file).endswith("config.json"):
            raise PermissionError(13, "Permission denied")
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", refuse)
    said = input_digest(str(tmp_path / "a"))
    monkeypatch.undo()
    assert said == f"unreadable: {tmp_path / 'a'}: Permission denied"


@pytest.mark.parametrize("case", ["same", "quiet", "same tokenizer", "steps", "mesh",
                                  "tokenizer", "unshared"])
def test_every_rank_runs_rank_0s_options_in_rank_0s_run_directory(case, tmp_path):
    """Under torchrun every node has its own command line: a node given other options (it
    hung at --steps, trained another model at --train.lr, hung making the mesh's groups
    with another --shard-size), other files at a per-node path (a tokenizer or a hub model's
    other revision) or a run directory other nodes do not see (it failed at the first
    checkpoint, one marked complete without its files) is refused on every rank at once,
    before the mesh is made; a node-local difference (--quiet, the path of the same
    tokenizer) is not."""
    got = run_ranks(_agree_worker, 4 if case == "mesh" else 2, case, str(tmp_path))
    if case in ("same", "quiet", "same tokenizer"):
        assert got == ["ok", "ok"]
    elif case == "steps":
        assert got[0] == got[1] == (
            "ConfigError: rank 1 was given other options than rank 0: train.lr = 0.03 "
            "(rank 0: 0.003); train.steps = 12 (rank 0: 8); every node of a job must run "
            "the same ones")
    elif case == "mesh":  # before the fix: every rank hung making the mesh's groups
        assert got == 4 * [
            "ConfigError: rank 1 was given other options than rank 0: dist.shard_size = 1 "
            "(rank 0: 2); every node of a job must run the same ones"]
    elif case == "tokenizer":
        assert got[0] == got[1] == (
            f"ConfigError: rank 1 reads other files than rank 0 for data.tokenizer (there "
            f"\"{tmp_path}/node1/tokenizer.json\", rank 0: \"{tmp_path}/node0/tokenizer.json\"): "
            "its path may differ between nodes, what it holds may not (another revision "
            "of a hub model, a tokenizer or weights changed on one node)")
    else:
        for said in got:  # each rank names the directory at its own path
            assert said.startswith("RunDirError: rank 1 does not see the run directory rank "
                                   "0 claimed") and "run run0, there run1" in said
            assert said.endswith("it must be on storage every node sees, at the same path")
