"""Local processes: a free port, a function run on N spawned ranks, launcher/worker hygiene.

``free_port`` is what the launcher's rendezvous, the tests and the benchmarks bind to;
``run_ranks`` runs ``fn(rank, world_size, *args)`` in ``world_size`` freshly spawned processes
that share a default process group, and returns what each rank's call returned::

    results = run_ranks(measure, 4, "tiny")   # [measure(0, 4, "tiny"), ..., measure(3, ...)]

Process hygiene (used by :mod:`editrain.launch` and :func:`editrain.runtime.setup_process`):

* a worker dies with the process that started it, also when that one is killed with SIGKILL
  (:func:`die_with_parent`);
* Ctrl-C reaches every process of the terminal's process group at once; workers end on it
  without a ``KeyboardInterrupt`` traceback (:func:`sigint_ends_quietly`), also while they
  are still starting (:func:`children_start_with_sigint_blocked`), and the launcher reports
  it in one line (:class:`Interrupted`);
* an exception in a worker is written with its traceback to ``logs/rank{RANK}.log`` of the
  run (:func:`errors_logged`) and comes back from the launcher as one line
  (:class:`LaunchError`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from editrain.argv import env_int
from editrain.errors import spelled_env

LOOPBACK = "127.0.0.1"

USER_ERRORS = frozenset({"ConfigError", "RunDirError", "CheckpointError", "FileNotFoundError",
                         "ValueError"})
"""Names of the exceptions the command line reports as an error in the user's input or files
(exit code 2; ``cli.main`` catches the same types). A worker's exception is known to the
launcher by its name only (torch elastic's error file), hence names."""

PEER_GRACE_S = 2.0
"""How long a worker whose error is not one of :data:`USER_ERRORS` waits before it exits.
Such an error is often the consequence of a peer's death (a collective that lost its
peer); the wait lets the launcher see the peer's death first and name it as the cause."""


class LaunchError(RuntimeError):
    """A job that failed after its workers started, or could not start them, said in one
    line.

    Args:
        message: the line (without the ``editrain: error:`` prefix).
        exit_code: what the command exits with: 2 for an error editrain reports (a corrupt
            checkpoint, a bad setting only a worker could see), 1 for a crash.
    """

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Interrupted(BaseException):
    """The job was stopped by a signal (Ctrl-C, SIGTERM, SIGHUP) and its workers with it.

    A ``BaseException``, like ``KeyboardInterrupt``, so that no ``except Exception`` on the
    way up swallows it.

    Args:
        signum: the signal received.
    """

    def __init__(self, signum: int) -> None:
        self.signum = int(signum)
        name = signal.Signals(self.signum).name
        super().__init__("interrupted" if self.signum == signal.SIGINT else f"stopped by {name}")

    @property
    def exit_code(self) -> int:
        """``128 + signum``, what a shell reports for a process ended by that signal."""
        return 128 + self.signum


_stop_signals: list[int] = []
"""The signals :func:`raise_interrupted` turned into :class:`Interrupted` in this process,
first first (see :func:`stop_signal_received`)."""


def raise_interrupted(signum: int, frame: Any) -> None:
    """A signal handler that raises :class:`Interrupted` (in the main thread) and records
    the signal (:func:`stop_signal_received`).

    Also the handler for SIGINT, in place of Python's ``KeyboardInterrupt``: an exception
    raised from a signal handler lands on whatever line is running, and a bare
    ``KeyboardInterrupt`` that passes through code compiled from a string (``exec``:
    ``dataclasses`` and ``namedtuple`` build their methods so, while torch is imported)
    makes CPython (3.11, 3.12) end the process by SIGINT at exit, whatever status it exits
    with. A subclass of ``BaseException`` that is not ``KeyboardInterrupt`` is not taken so.

    Args:
        signum: the signal received.
        frame: the interrupted frame (unused).
    """
    _stop_signals.append(int(signum))
    if not _deferring:
        raise Interrupted(signum)


_deferring: list[bool] = []
"""Non-empty inside :func:`stops_deferred`."""


@contextlib.contextmanager
def stops_deferred() -> Iterator[None]:
    """Inside the block :func:`raise_interrupted` records a stop signal but raises nothing;
    the block raises :class:`Interrupted` for it at its end (if it ends without an error).

    For code that an exception raised at any line can crash rather than stop: torch's
    import runs C++ (pybind11 module initialisation) that calls back into Python, where
    Python runs a pending signal handler, and the exception thrown through those C++ frames
    ends the process with ``terminate called after throwing an instance of
    'pybind11::error_already_set'`` (SIGABRT) instead of the stop. See :func:`import_torch`.
    """
    seen = stop_signals_seen()
    _deferring.append(True)
    try:
        yield
    finally:
        _deferring.pop()
    received = stop_signal_received(seen)
    if not _deferring and received is not None:
        raise Interrupted(received)


def import_torch() -> None:
    """Import torch and its distributed package with stop signals deferred to the end of the
    import (:func:`stops_deferred`): a Ctrl-C then stops the command a few seconds later,
    once the import is done, instead of aborting it. The command line calls this before the
    first import of torch of a command that needs it; later imports of torch are free."""
    with stops_deferred():
        import torch.distributed  # noqa: F401


def stop_signal_received(since: int = 0) -> int | None:
    """The first signal :func:`raise_interrupted` handled in this process after the first
    ``since`` of them, or None.

    The :class:`Interrupted` it raised lands on whatever line was running; code there that
    is not written for an exception at any point (a ``finally`` that reads a variable its
    ``try`` had not set yet, in torch elastic's metrics) can replace it with an error of
    its own. The command line asks this to report such an error as the stop it is.

    Args:
        since: how many signals to skip (:func:`stop_signals_seen` at the start of a
            command).
    """
    return _stop_signals[since] if len(_stop_signals) > since else None


def stop_signals_seen() -> int:
    """How many signals :func:`raise_interrupted` has handled in this process so far."""
    return len(_stop_signals)


def _raise_interrupted_once(signum: int, frame: Any) -> None:
    # A handler that does nothing rather than SIG_IGN: a signal that arrived meanwhile is
    # still handled by Python, which would print that it was 'ignored due to race condition'.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _do_nothing)
    raise_interrupted(signum, frame)


def _do_nothing(signum: int, frame: Any) -> None:
    pass


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now.

    Another process may take it before it is bound again; the launcher's rendezvous then
    tries another port (see :func:`editrain.launch.elastic.run_elastic`).
    """
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- hygiene
def die_with_parent(sig: int | None = None) -> None:
    """Have this process receive ``sig`` when the process that started it dies.

    Call it first thing in a process started by editrain's launcher: a launcher killed with
    SIGKILL cannot stop its workers, and they would otherwise train on alone until a
    collective times out. On Linux the kernel sends the signal when the parent *thread*
    exits (``prctl(PR_SET_PDEATHSIG)``); the launchers start their workers from their main
    thread, which lives as long as they do. A process started through a fork server
    (``multiprocessing``'s ``forkserver``) has the server as its kernel parent, and the
    server outlives the launcher while any worker is alive: such a process watches the
    launcher itself (:func:`watch_process`). If the launcher died before this call, ``sig``
    is sent now. Under torchrun (no ``multiprocessing`` parent) only the kernel's signal
    is set; elsewhere than Linux nothing is done.

    Args:
        sig: the signal; SIGKILL by default (nothing is left to report to).
    """
    if not sys.platform.startswith("linux"):
        return
    sig = signal.SIGKILL if sig is None else sig
    import multiprocessing

    if not _set_parent_death_signal(sig):
        return
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:
        # A fork server's child, or a spawned process whose parent died already (it was
        # handed to another parent): either way the process that started it is watched.
        watch_process(parent.pid, lambda: os.kill(os.getpid(), sig))


def _set_parent_death_signal(sig: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)``: whether it was set (Linux only)."""
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    pr_set_pdeathsig = 1  # <linux/prctl.h>
    args = [ctypes.c_ulong(v) for v in (int(sig), 0, 0, 0)]  # prctl reads unsigned longs
    return prctl(ctypes.c_int(pr_set_pdeathsig), *args) == 0


def children_die_with_this_process() -> None:
    """Every process this one forks from now on is killed (SIGKILL) when this one dies.

    For the fork server the workers are forked from (:mod:`editrain.worker_server` calls
    it there). A worker watches its launcher once it runs (:func:`die_with_parent`), but a
    forked child first reads its orders from the launcher: the function and its arguments,
    among them torch elastic's semaphores. A launcher interrupted in that moment stops the
    server (:func:`stop_worker_server`) and exits, removing the semaphores; the child, not
    yet known to torch elastic and so never stopped by it, then failed to open them and
    printed a ``FileNotFoundError`` traceback to the terminal after the launcher's
    ``editrain: interrupted``. Now it dies with the server, before the launcher exits. Only
    the server's own children are marked (not the processes its children fork in turn);
    only on Linux.
    """
    if not sys.platform.startswith("linux") or not hasattr(os, "register_at_fork"):
        return
    server = os.getpid()
    forking = {"from_server": False}

    def before() -> None:
        forking["from_server"] = os.getpid() == server

    def in_child() -> None:
        if not forking["from_server"]:
            return
        forking["from_server"] = False
        # the server may have died between the fork and here: its signal is then missed
        if _set_parent_death_signal(signal.SIGKILL) and os.getppid() != server:
            os.kill(os.getpid(), signal.SIGKILL)

    os.register_at_fork(before=before, after_in_child=in_child)


def watch_process(pid: int, on_exit: Callable[[], None]) -> None:
    """Call ``on_exit()`` from a daemon thread once process ``pid`` has ended (at once if
    it has ended already).

    Waits on a pidfd (Linux 5.3+): the thread sleeps in ``poll`` and wakes when the process
    ends, also while it is a zombie nobody has reaped. Without pidfds it checks every
    :data:`WATCH_POLL_S` seconds whether ``pid`` still exists.

    Args:
        pid: the process to watch.
        on_exit: what to do when it is gone (runs in the watcher thread).
    """
    import select

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        on_exit()
        return
    except (AttributeError, OSError):
        fd = None

    def wait() -> None:
        if fd is not None:
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            while not poller.poll():
                pass
            os.close(fd)
        else:
            while _exists(pid):
                time.sleep(WATCH_POLL_S)
        on_exit()

    threading.Thread(target=wait, name=f"editrain-watch-{pid}", daemon=True).start()


WATCH_POLL_S = 0.5
"""How often :func:`watch_process` checks a process where pidfds are not available."""


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sigint_ends_quietly() -> None:
    """SIGINT ends this process at once, as SIGTERM and SIGHUP do, without a
    ``KeyboardInterrupt`` traceback; SIGINT is unblocked (see
    :func:`children_start_with_sigint_blocked`).

    For a worker: Ctrl-C reaches it together with its launcher, which reports the
    interrupt once and stops whatever is left. SIGTERM and SIGHUP get their default action
    back too (a process forked from one that raises :class:`Interrupted` on them would
    inherit its handlers). A signal this process
    inherited as ignored (its launcher ignores it: started in the background, ``nohup``)
    stays ignored. Only in the main thread (signal handlers can only be set there).
    """
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None and signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, signal.SIG_DFL)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def interrupts_raise() -> None:
    """SIGINT and SIGTERM raise :class:`Interrupted` in this process, and SIGINT is
    unblocked (see :func:`children_start_with_sigint_blocked`).

    For a process that must stop in order when its launcher is interrupted: a replica
    group of a fault-tolerant run, whose torch elastic agent then stops its workers and
    whose semaphores are released on the way out (a process killed outright leaves them
    to the launcher's resource tracker, which warns about them). Only the first signal
    raises: later ones are ignored, so that they cannot cut the stopping short (the
    launcher kills a group that takes too long). A signal inherited as ignored stays
    ignored. Only in the main thread.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, _raise_interrupted_once)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@contextlib.contextmanager
def children_start_with_sigint_blocked() -> Iterator[None]:
    """Processes started from this thread inside the block begin with SIGINT blocked.

    A spawned worker spends seconds importing torch before it can call
    :func:`sigint_ends_quietly`; a Ctrl-C in that time would print a ``KeyboardInterrupt``
    traceback from each of them. Blocked, the signal waits until the worker unblocks it and
    then ends it quietly. The signal mask is per thread and inherited by child processes;
    this process still receives SIGINT through a helper thread that keeps it unblocked
    (Python runs the handler in the main thread either way, after at most the current
    blocking call). Nothing outside the main thread or without ``pthread_sigmask``.

    :mod:`multiprocessing`'s resource tracker is started first, if it is not running: the
    first process this one starts through :mod:`multiprocessing` (a fork server, a spawned
    worker) starts the tracker, and starting it unblocks SIGINT and SIGTERM in the calling
    thread once the tracker runs, whatever was blocked before. Inside the block, that undid
    the block for the fork server itself: a Ctrl-C while it imported torch printed its
    KeyboardInterrupt traceback.
    """
    if (not hasattr(signal, "pthread_sigmask")
            or threading.current_thread() is not threading.main_thread()):
        yield
        return
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    done = threading.Event()
    helper = threading.Thread(target=done.wait, name="editrain-sigint", daemon=True)
    helper.start()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        done.set()


@contextlib.contextmanager
def errors_logged(log_dir: Path, rank: int, world_size: int) -> Iterator[None]:
    """Write an exception raised inside the block, with its traceback, to
    ``log_dir/rank{rank}.log`` (appended: one section per failure) and raise it again.

    An error not in :data:`USER_ERRORS` in a job of several ranks waits
    :data:`PEER_GRACE_S` before it is raised (see there).

    Args:
        log_dir: the run's ``logs`` directory (created if missing).
        rank: this process's global rank.
        world_size: the number of ranks of the job.
    """
    try:
        yield
    except Exception as e:
        # The count as torch elastic set it, named as such: it is not the attempt's number
        # (a restart caused by a change of the nodes taking part is not counted, and after
        # one node's failure the counts differ between nodes).
        count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        header = (f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} rank {rank} (pid {os.getpid()}, "
                  f"TORCHELASTIC_RESTART_COUNT {count}): {type(e).__name__}\n")
        try:
            from editrain.safe_io import make_dir, open_write

            make_dir(log_dir, root=log_dir.parent)
            with open_write(log_dir / f"rank{rank}.log", "a", root=log_dir.parent) as f:
                f.write(header + traceback.format_exc() + "\n")
        except (OSError, ValueError):  # (a link there is refused: RunDirError)
            pass  # the error itself still reaches the launcher through torch's error file
        if type(e).__name__ not in USER_ERRORS and world_size > 1:
            time.sleep(PEER_GRACE_S)
        raise


def read_error_file(path: str | os.PathLike[str]) -> tuple[str, str] | None:
    """``(exception type name, message)`` from a torch elastic error file (written by
    ``torch.distributed.elastic.multiprocessing.errors.record`` when a worker raised);
    None when there is no such file or it cannot be read.

    Args:
        path: the file (``TORCHELASTIC_ERROR_FILE`` of the worker).
    """
    from editrain.safe_io import read_json

    try:
        data = read_json(path, max_bytes=16 << 20, error=ValueError, what="error file")
    except ValueError:
        return None
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):
        message = message.get("message")
    if not isinstance(message, str):
        return None
    name, sep, text = message.partition(": ")
    if not sep or not name.isidentifier():
        return "", message
    return name, text


def one_line(text: str, limit: int = 400) -> str:
    """``text`` on one line (line breaks become spaces), cut to ``limit`` characters.

    Args:
        text: any message.
        limit: the most characters kept (the rest becomes ``...``).
    """
    flat = " ".join(part.strip() for part in text.strip().splitlines() if part.strip())
    return flat if len(flat) <= limit else flat[: limit - 3].rstrip() + "..."


# ---------------------------------------------------------------------------- run_ranks
def _rank_entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, backend: str,
                out_dir: str, args: tuple) -> None:
    """One spawned rank: join the process group, run ``fn``, save its result."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)  # the ranks share this machine's cores
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        out = fn(rank, world_size, *args)
        torch.save(out, Path(out_dir) / f"{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


START_METHOD_ENV = "EDITRAIN_START_METHOD"
"""Environment variable: how editrain starts local processes, ``forkserver`` or ``spawn``.
Read by the launcher (:func:`worker_start_method`; ``forkserver`` if unset, where there is
one) and by :func:`run_ranks` when the call does not say (``spawn`` if unset). The test
suite sets ``forkserver`` with torch preloaded, so that a rank starts in a fraction of a
second instead of importing torch again."""

START_METHODS = ("forkserver", "spawn")
"""The start methods editrain uses. ``fork`` is not one: a process that has started threads
(the launcher's rendezvous store, torch's intra-op pool) cannot be forked safely. Tried for
the test suite's short runs (workers forked from the launcher: 3 s instead of 7 s per
run), it hung 2 runs out of about 450 (workers waiting forever)."""


def stop_worker_server() -> None:
    """Stop :mod:`multiprocessing`'s fork server now, if this process started one.

    A launcher starts the server as soon as it knows it will start workers, so that the
    server imports torch and editrain while the launcher prepares the data
    (:func:`start_worker_server`). A launcher that then refuses its input
    (a corpus too small, a checkpoint that does not fit) exits at once, but the server
    only notices that once its imports are done: it outlived the launcher by 5 to 9 s. And
    a server that ends by itself, after its launcher, tears its interpreter down first
    (torch loaded: 1.5 s on a 2-core machine) while it holds the launcher's stdout and
    stderr, so whoever reads them waits. Killed here instead (the launcher does so when its
    job ends, whatever the outcome), and reaped; its children, if any, die with it
    (:func:`children_die_with_this_process`). ``multiprocessing``
    offers no public way to stop its server: this uses the fields its own ``_stop``
    resets, and does nothing where a Python lacks them.
    """
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None or not hasattr(server, "_stop"):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        server._stop()  # closes the alive pipe, reaps the server, removes its socket


def worker_start_method() -> str:
    """How the launcher starts its workers: :data:`START_METHOD_ENV` if set, else
    ``forkserver`` where the platform has one, else ``spawn``.

    With ``forkserver`` one server process imports torch and editrain once and every worker
    of the job (and of its restarts) is forked from it: a job of N local workers imports
    torch twice (launcher and server) instead of N + 1 times, seconds of CPU each. The
    server never touches a GPU, so its children start as cleanly as spawned ones.

    Raises:
        LaunchError: :data:`START_METHOD_ENV` names something else (exit code 2).
    """
    import multiprocessing

    method = os.environ.get(START_METHOD_ENV, "").strip()
    if not method:
        return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    if method not in START_METHODS or method not in multiprocessing.get_all_start_methods():
        allowed = [m for m in START_METHODS if m in multiprocessing.get_all_start_methods()]
        raise LaunchError(f"{spelled_env(START_METHOD_ENV, method)} is not a start method editrain "
                          f"can use here; allowed: {', '.join(allowed)}", exit_code=2)
    return method


def start_worker_server() -> str:
    """Start the server the workers will be forked from, if they are (see
    :func:`worker_start_method`), and return the start method.

    Called as soon as a job is known to start workers, before the launcher imports torch
    itself, so that the server imports torch and editrain on the other core while the
    launcher imports its own part of torch and prepares the data and the run directory. The
    server starts with SIGINT blocked (a Ctrl-C meanwhile cannot print a traceback from it;
    its children unblock it once they can end quietly). Once running, it is reused by every
    restart of the job; :func:`editrain.launch.run_local` stops it when the job ends
    (:func:`stop_worker_server`).
    """
    import multiprocessing
    from multiprocessing import forkserver

    method = worker_start_method()
    if method == "forkserver":
        # editrain.worker_server: the server's children die with it. Then what a worker
        # (or a replica group of --ft) imports anyway, imported once by the server. torch imports torch._dynamo (2.5 s of CPU here) at the first optimizer a
        # process builds.
        multiprocessing.set_forkserver_preload(["editrain.worker_server", "editrain.train",
                                                "editrain.launch.ft", "torch._dynamo"])
        with children_start_with_sigint_blocked():
            forkserver.ensure_running()
    return method


def worker_threads(cfg: Any, local_world: int | None = None) -> int:
    """Intra-op threads of one worker: ``dist.threads_per_proc`` if set, else what the
    user (or torchrun, which sets 1 unless told otherwise) put in ``OMP_NUM_THREADS``, else
    the machine's cores shared out over the local processes.

    Args:
        cfg: the run's configuration.
        local_world: the processes on this machine (default: ``LOCAL_WORLD_SIZE``, as a
            worker sees it; the local launcher passes its ``dist.nproc``).

    Raises:
        ConfigError: ``OMP_NUM_THREADS`` is set to something but a thread count.
    """
    if cfg.dist.threads_per_proc:
        return cfg.dist.threads_per_proc
    from editrain.argv import env_count

    # OpenMP's nested form (4,2) gives the outer level first: that is torch's intra-op
    # count. Anything but a count is refused, not passed over for our own choice.
    omp = env_count("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "").split(",")[0])
    if omp is not None:
        return omp
    if local_world is None:
        local_world = env_int("LOCAL_WORLD_SIZE", 1, minimum=1)
    return max(1, (os.cpu_count() or 1) // local_world)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any,
              backend: str = "gloo", start_method: str | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned local processes.

    Each process has the default process group initialised (``backend``, over a free
    loopback port) and one CPU thread; an exception in any rank is raised here.

    Args:
        fn: a module-level function (it is pickled into the spawned processes).
        world_size: number of processes.
        *args: further arguments of ``fn`` (picklable).
        backend: the process group backend ("gloo" on CPU, "nccl" on CUDA).
        start_method: a :mod:`multiprocessing` start method; by default
            :data:`START_METHOD_ENV`, else ``spawn``.

    Returns:
        Each rank's return value, in rank order (passed back through ``torch.save``).
    """
    import torch
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank_entry, args=(fn, world_size, free_port(), backend, tmp, args),
                           nprocs=world_size, join=True,
                           start_method=start_method or os.environ.get(START_METHOD_ENV)
                           or "spawn")
        # Written by our own child processes just now: full unpickling is safe here.
        return [torch.load(Path(tmp) / f"{r}.pt", weights_only=False)
                for r in range(world_size)]
