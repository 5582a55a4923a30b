"""Starting workers: locally through torch's elastic launcher, or joining a torchrun job.

The run directory is prepared here, before any process group exists (see
:mod:`editrain.rundir`): a directory holding a different run is refused unless
``--overwrite``, a directory another job is using is refused, and the job holds the
directory's lock until it ends; the run record (identity, timeline) and the resolved
configuration (``RUN_DIR/config.toml``) are written; the corpus is tokenised once in the
parent so workers reuse it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing import LogsDest, LogsSpecs

from editrain import rundir
from editrain.config import Config, dumps_toml, to_dict, validate_world
from editrain.config.applicability import drop_inapplicable
from editrain.corpus import prepare_data
from editrain.rundir import logs_dir
from editrain.runtime import worker_threads
from editrain.safe_io import Obj, check_no_links, make_dir, read_json, write_atomic
from editrain.spawn import (
    LOOPBACK,
    USER_ERRORS,
    Interrupted,
    LaunchError,
    children_start_with_sigint_blocked,
    free_port,
    one_line,
    read_error_file,
    stop_worker_server,
    worker_start_method,
)

log = logging.getLogger("editrain")

RUN_FILES = rundir.RUN_FILES


def default_run_dir() -> Path:
    """``runs/<timestamp>`` (a short random suffix keeps parallel runs apart)."""
    return Path("runs") / (time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:4])


def resolved(cfg: Config) -> Config:
    """A copy with the method's defaults filled in, as it will run."""
    return dataclasses.replace(cfg, sync=cfg.sync.resolve())


def resume_checkpoints(cfg: Config) -> list[Path]:
    """The checkpoint(s) ``--resume`` names: one, or one per replica group of a
    fault-tolerant run (``RUN_DIR/replica{r}``); empty without ``--resume``."""
    from editrain.checkpoint import resolve_resume

    if not cfg.resume:
        return []
    if cfg.dist.fault_tolerance != "torchft":
        return [resolve_resume(cfg.resume)]
    groups = max(1, cfg.dist.nproc // cfg.dist.replica_size)
    out = []
    for r in range(groups):
        sub = Path(cfg.resume) / f"replica{r}"
        out.append(resolve_resume(sub if sub.is_dir() else cfg.resume))
    return out


def check_run_dir(cfg: Config, run_dir: Path) -> rundir.Claim:
    """Whether this job may use ``run_dir`` (:func:`editrain.rundir.check`): a directory
    holding a run is refused unless this job resumes that same run or ``--overwrite`` is
    given, and ``--overwrite`` never removes what editrain did not write. Touches nothing."""
    return rundir.check(run_dir, overwrite=cfg.overwrite, resume=resume_checkpoints(cfg))


def choose_run_dir(cfg: Config, default) -> Path:
    """``--run-dir``; else, when resuming a run directory, that directory; else a new one."""
    if cfg.run_dir:
        return Path(cfg.run_dir)
    if cfg.resume:
        from editrain.checkpoint import CKPT_DIR, MARKER

        p = Path(cfg.resume)
        if (p / MARKER).is_file() and p.parent.name == CKPT_DIR:
            return p.parent.parent
        if (p / CKPT_DIR).is_dir() or (p / rundir.RECORD).is_file():
            return p
    return default()


def prepare_run_dir(cfg: Config, run_dir: Path, lock: rundir.RunLock | None = None
                    ) -> rundir.RunRecord:
    """Make ``run_dir`` this job's: checked again under the directory's lock, the old run
    replaced if ``--overwrite``, a timeline abandoned by resuming an older checkpoint set
    aside, the run record and ``config.toml`` written.

    Args:
        cfg: the configuration.
        run_dir: the run directory (created if missing).
        lock: the job's lock on ``run_dir``, held by the caller for the whole job; without
            one, the directory is locked while it is prepared.

    Returns:
        The run record of this job.
    """
    own = lock is None
    lock = lock or rundir.RunLock(run_dir)
    try:
        if not lock.held:
            lock.acquire()
        record = rundir.claim(check_run_dir(cfg, run_dir))
        if cfg.resume and (run_dir / "config.toml").exists():
            return record  # the run's own record of its configuration stays as it was
        # Resolved, less what the method or mode does not use (a method's resolved sync
        # interval under `sync`, say): the file must load back as the run's configuration,
        # and the loader refuses an option set where it does nothing.
        data = drop_inapplicable(to_dict(resolved(cfg)))
        data["run_dir"] = str(run_dir)
        write_atomic(run_dir / "config.toml", dumps_toml(data), root=run_dir)
        return record
    finally:
        if own:
            lock.release()


def _pretokenise(cfg: Config) -> Any:
    from editrain.data import SequenceStream, check_batch_size, eval_batches

    t0 = time.perf_counter()
    data = prepare_data(cfg)
    # The windows every worker will cut; a too-small corpus or a batch larger than a
    # rank's share (the sampler would loop over epochs to fill it) fails here, not in the
    # workers. Data ranks: every replica's shards (tensor-parallel peers and the stages of
    # a pipeline read alike).
    t = cfg.train
    data_world = cfg.dist.nproc // (cfg.dist.tp_size * cfg.dist.pp_size)
    SequenceStream(data.train, t.seq_len, 0, data_world, t.seed)
    check_batch_size(data.train, t.seq_len, t.batch_size, data_world)
    eval_batches(data.val[: 2 * t.seq_len + 2], t.seq_len, t.batch_size, 0, data_world)
    how = "reused cache" if data.reused else f"built in {time.perf_counter() - t0:.1f} s"
    if not cfg.quiet:
        log.info("data: %d train / %d val tokens, vocab %d (%s: %s)", len(data.train),
                 len(data.val), data.vocab_size, how, data.cache_dir)
    return data  # the resume preflight compares its token stream with the checkpoint's


def run_local(cfg: Config) -> dict:
    """Spawn ``dist.nproc`` local workers with torch elastic (restarts from torch); with
    ``dist.fault_tolerance = torchft`` one job per replica group around a lighthouse."""
    validate_world(cfg, cfg.dist.nproc)
    run_dir = choose_run_dir(cfg, default_run_dir)
    cfg = dataclasses.replace(cfg, run_dir=str(run_dir))
    # The job holds the directory's lock until it ends. A directory editrain has used
    # before is locked at once, so a second job on it is refused before any work.
    lock = rundir.RunLock(run_dir)
    if (run_dir / rundir.LOCK).exists():
        lock.acquire()
    try:
        return _run_local(cfg, run_dir, lock)
    except BaseException:
        # Refused input, a failed job or Ctrl-C: the fork server may still be importing
        # torch, and would outlive this process by seconds (spawn.stop_worker_server).
        stop_worker_server()
        raise
    finally:
        lock.release()


def _run_local(cfg: Config, run_dir: Path, lock: rundir.RunLock) -> dict:
    """:func:`run_local` once the run directory is chosen (and locked if it was used)."""
    from editrain.metrics import plot_runs

    nproc = cfg.dist.nproc
    # Nothing is written before the data and the checkpoint to resume are known to be usable.
    check_run_dir(cfg, run_dir)
    threads = worker_threads(cfg, local_world=nproc)  # the user's OMP_NUM_THREADS stands
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    if cfg.dist.fault_tolerance != "torchft":  # there each replica group starts its own
        start_worker_server()
    data = _pretokenise(cfg)
    if cfg.resume:
        from editrain.checkpoint import preflight_resume

        if cfg.dist.fault_tolerance == "torchft":
            from editrain.fault import replica_run_dir

            for r in range(nproc // cfg.dist.replica_size):
                preflight_resume(replica_run_dir(cfg.resume, r), cfg, data.vocab_size, data)
        else:
            preflight_resume(cfg.resume, cfg, data.vocab_size, data)
    prepare_run_dir(cfg, run_dir, lock)
    if not cfg.quiet:
        log.info("run directory: %s; %d local workers (%d threads each)", run_dir, nproc,
                 threads)
    if cfg.dist.fault_tolerance == "torchft":
        summary = run_ft(cfg, run_dir, str(data.cache_dir))
        plotted = [run_dir / f"replica{r}" for r in range(nproc // cfg.dist.replica_size)]
        plotted = [p for p in plotted if (p / "metrics.jsonl").exists()]
    else:
        results = _elastic(cfg, nproc, cfg.dist.max_restarts, str(data.cache_dir))
        summary = results.get(0, {}) if isinstance(results, dict) else {}
        plotted = [run_dir]
    for path in plot_runs(plotted) if plotted else []:
        if not cfg.quiet:
            log.info("plot: %s", path)
    return summary


def run_group(cfg: Config, data_entry: str | None = None) -> dict:
    """One replica group of a fault-tolerant run (``cfg.run_dir`` prepared): a torch
    elastic job of ``pp_size x shard_size x tp_size`` workers, never restarted by torch (the
    launcher restarts the whole group, which then heals from its peers). ``data_entry``:
    the token cache entry the launcher prepared."""
    results = _elastic(cfg, cfg.dist.replica_size, 0, data_entry)
    return results.get(0, {}) if isinstance(results, dict) else {}


LAUNCHER_LOG = "launcher.log"
PORT_TRIES = 3
"""Rendezvous ports tried before a launch gives up (a free port can be taken by another
process between :func:`editrain.spawn.free_port` and the bind)."""

TORCH_LAUNCH_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher",
                        "torch.multiprocessing")


class RunLogs(LogsSpecs):
    """torch elastic's log layout for editrain: every worker's output stays on the terminal
    (progress, warnings); its error file is ``LOGS/rank{RANK}.error.json``, flat in the
    run's ``logs`` directory and removed when a new attempt starts (so a file there belongs
    to the latest attempt).

    Args:
        log_dir: the run's logs directory (:func:`logs_dir`).
    """

    def __init__(self, log_dir: Path) -> None:
        super().__init__(log_dir=str(log_dir))
        self.error_files: dict[int, Path] = {}
        """Global rank -> error file of the current attempt."""

    @property
    def root_log_dir(self) -> str:
        """The logs directory."""
        return str(self._root_log_dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """Error files of one attempt, keyed by local rank; sets ``TORCHELASTIC_ERROR_FILE``
        in each worker's environment.

        Args:
            envs: each local rank's environment, as torch elastic's agent made it.
        """
        root = make_dir(Path(self._root_log_dir), root=Path(self._root_log_dir).parent)
        attempt = int(next(iter(envs.values()), {}).get("TORCHELASTIC_RESTART_COUNT", "0"))
        if attempt and self.error_files:
            # The agent restarts the workers after a failure (--max-restarts): say why in
            # one line, as torch's own multi-line report stays in launcher.log.
            cause = _describe(None, self.error_files, root)
            log.warning("worker restart %d after a failure: %s", attempt, cause.args[0])
        files = {}
        self.error_files = {}
        for local_rank, env in envs.items():
            rank = int(env.get("RANK", local_rank))
            path = root / f"rank{rank}.error.json"
            path.unlink(missing_ok=True)  # left by an earlier attempt or run (a link: only it)
            env["TORCHELASTIC_ERROR_FILE"] = str(path)
            files[local_rank] = str(path)
            self.error_files[rank] = path
        console = dict.fromkeys(envs, "")  # "": the worker's stream stays the terminal's
        return LogsDest(stdouts=console, stderrs=dict(console), error_files=files)


@contextlib.contextmanager
def _torch_logs_to(path: Path) -> Iterator[None]:
    """Send torch elastic's log records (its multi-line failure reports with tracebacks,
    'Closing process ...') to ``path`` instead of the terminal, for the block."""
    handler = logging.FileHandler(path, delay=True)  # a file only when torch logs
    handler.setFormatter(logging.Formatter(
        "%(asctime)s pid %(process)d %(name)s %(levelname)s: %(message)s"))
    saved = []
    for name in TORCH_LAUNCH_LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.propagate))
        logger.addHandler(handler)
        logger.propagate = False
    try:
        yield
    finally:
        for logger, propagate in saved:
            logger.removeHandler(handler)
            logger.propagate = propagate
        handler.close()


@contextlib.contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """Restore this process's signal handlers after the block: torch elastic installs its
    own for SIGTERM, SIGHUP and SIGQUIT when it starts workers and leaves them there."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = [s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None),
                        getattr(signal, "SIGQUIT", None)) if s is not None]
    saved = {s: signal.getsignal(s) for s in sigs}
    try:
        yield
    finally:
        for s, handler in saved.items():
            if handler is not None:
                signal.signal(s, handler)


def _describe(reported: tuple[int, Any] | None, error_files: dict[int, Path],
              logs: Path) -> LaunchError:
    """One line for a failed attempt: the first failing worker, its error, where its
    traceback is.

    torch elastic reports the failure it saw first (``reported``: global rank and its
    ``ProcessFailure``); when another rank's error file holds an error editrain raises on
    purpose (a corrupt checkpoint, say) while the reported one does not, that one is named:
    the reported failure is then most likely a consequence (a collective that lost its
    peer).
    """
    errors = {r: e for r, p in sorted(error_files.items())
              if (e := read_error_file(p)) is not None}
    rank = reported[0] if reported else None
    if rank is None or errors.get(rank, ("", ""))[0] not in USER_ERRORS:
        user = [r for r, (name, _) in errors.items() if name in USER_ERRORS]
        if user:
            rank = user[0]
        elif rank is None and errors:
            rank = next(iter(errors))
    if rank is None:
        return LaunchError(f"a worker died without a Python error (torch elastic's log: "
                           f"{logs / LAUNCHER_LOG})")
    if rank in errors:
        name, message = errors[rank]
        where = logs / f"rank{rank}.log"
        where = where if where.exists() else error_files[rank]
        if name in USER_ERRORS:
            return LaunchError(f"rank {rank}: {one_line(message)} (traceback: {where})", 2)
        what = f"{name}: {message}" if name else message
        return LaunchError(f"rank {rank} failed: {one_line(what)} (traceback: {where})")
    failure = reported[1] if reported else None
    code = getattr(failure, "exitcode", None)
    if isinstance(code, int) and code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    return LaunchError(f"rank {rank} {how} without a Python error (torch elastic's log: "
                       f"{logs / LAUNCHER_LOG})")


def _address_in_use(e: BaseException) -> bool:
    """Whether a rendezvous failed because its port was taken."""
    text = f"{e} {e.__cause__}"
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def start_worker_server() -> str:
    """Start the server the workers will be forked from, if they are (see
    :func:`editrain.spawn.worker_start_method`), and return the start method.

    Called as soon as a job is known to start workers, so that the server imports torch and
    editrain while this process still prepares the data and the run directory. The server
    starts with SIGINT blocked (a Ctrl-C meanwhile cannot print a traceback from it; its
    children unblock it once they can end quietly). Once running, it is reused by every
    later job and restart of this process; it exits with this process.
    """
    from multiprocessing import forkserver

    method = worker_start_method()
    if method == "forkserver":
        # What a worker (or a replica group of --ft) imports anyway, imported once by the
        # server. torch imports torch._dynamo (2.5 s of CPU here) at the first optimizer a
        # process builds.
        mp.set_forkserver_preload(["editrain.train", "editrain.launch", "torch._dynamo"])
        with children_start_with_sigint_blocked():
            forkserver.ensure_running()
    return method


def _elastic(cfg: Config, nproc: int, max_restarts: int, data_entry: str | None = None
             ) -> Any:
    """``nproc`` local workers running :func:`editrain.train.run_worker` under torch elastic.

    The rendezvous listens on a free loopback port (a local job, like ``torchrun
    --standalone``: ``MASTER_ADDR`` / ``MASTER_PORT`` in the environment are not used; they
    belong to multi-node jobs, which run under torchrun); a port taken between choosing and
    binding it is replaced, :data:`PORT_TRIES` times in all.

    Args:
        cfg: the run's configuration (``run_dir`` prepared).
        nproc: the number of workers.
        max_restarts: how often torch elastic restarts them all after a failure.
        data_entry: the token cache entry prepared for the job, handed to every worker
            (:func:`editrain.corpus.prepare_data`); None: each worker finds it.

    Raises:
        LaunchError: a worker failed (one line naming the rank and its error or exit code;
            the traceback is in :func:`logs_dir`), or no rendezvous port could be bound.
        Interrupted: Ctrl-C (SIGINT), SIGTERM or SIGHUP; every worker has been stopped.
    """
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from editrain.train import run_worker

    logs = make_dir(logs_dir(cfg, cfg.run_dir), root=cfg.run_dir)
    check_no_links(logs / LAUNCHER_LOG)  # torch's log handler opens it by name
    specs = RunLogs(logs)
    # torch's agent turns these signals into its own exception (and forwards them to the
    # workers); a signal for which this process already raises Interrupted (the command
    # line, a replica group) keeps that handler: it stops the workers on the way out too.
    # SIGINT stays KeyboardInterrupt (or Interrupted): the agent then stops the workers
    # with SIGTERM, which ends even one still starting (its own handler would forward
    # SIGINT, which a starting worker holds blocked).
    in_main = threading.current_thread() is threading.main_thread()
    to_handle = ",".join(name for name in ("SIGTERM", "SIGHUP", "SIGQUIT")
                         if hasattr(signal, name) and (not in_main or signal.getsignal(
                             getattr(signal, name)) is signal.SIG_DFL))
    method = start_worker_server()
    taken = []
    for _ in range(PORT_TRIES):
        port = free_port()
        launch_cfg = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=nproc,
            run_id=f"editrain-{uuid.uuid4().hex[:8]}",
            rdzv_backend="c10d", rdzv_endpoint=f"{LOOPBACK}:{port}",
            rdzv_configs={"is_host": True},
            # torch's default poll: the job ends (or reports a failed worker) within
            # 0.1 s of its workers, not 0.5 s
            max_restarts=max_restarts, start_method=method, monitor_interval=0.1,
            local_addr=LOOPBACK,  # a laptop run is not reachable from the network
            logs_specs=specs, signals_to_handle=to_handle,
        )
        try:
            with (_torch_logs_to(logs / LAUNCHER_LOG), _signal_handlers_kept(),
                  children_start_with_sigint_blocked()):
                return elastic_launch(launch_cfg, run_worker)(cfg, cfg.run_dir, data_entry)
        except RendezvousConnectionError as e:
            if not _address_in_use(e):
                raise LaunchError(f"cannot start the rendezvous on {LOOPBACK}:{port}: "
                                  f"{one_line(str(e.__cause__ or e))}") from None
            log.debug("rendezvous port %d was taken; trying another", port)
            taken.append(port)
        except ChildFailedError as e:
            reported = e.get_first_failure()
            raise _describe(reported, specs.error_files, logs) from None
        except SignalException as e:
            raise Interrupted(e.sigval) from None
        except KeyboardInterrupt:
            raise Interrupted(signal.SIGINT) from None
    raise LaunchError(f"cannot start the rendezvous: the free ports chosen for it "
                      f"({', '.join(map(str, taken))} on {LOOPBACK}) were taken by other "
                      f"processes before it could listen, {PORT_TRIES} times")


def run_under_torchrun(cfg: Config) -> dict:
    """Join a torchrun job: rank 0 prepares the run directory, everyone trains."""
    from editrain.train import run_worker

    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "torchrun")
    run_dir = choose_run_dir(cfg, lambda: Path("runs") / run_id)
    cfg = dataclasses.replace(cfg, run_dir=str(run_dir))
    validate_world(cfg, int(os.environ["WORLD_SIZE"]))
    lock = rundir.RunLock(run_dir)
    if int(os.environ.get("RANK", "0")) == 0:
        # Rank 0 holds the directory's lock for the job. After a restart by torchrun the
        # directory is this job's already (its record is there): it resumes it as is.
        lock.acquire()
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        if not (restarted and rundir.read_record(run_dir) is not None):
            try:
                prepare_run_dir(cfg, run_dir, lock)
            except BaseException:
                lock.release()
                raise
    else:
        # Wait for rank 0 to create the directory (it writes config.toml last).
        deadline = time.monotonic() + 300
        while not (run_dir / "config.toml").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    try:
        summary = run_worker(cfg, str(run_dir))
    finally:
        lock.release()
    if int(os.environ.get("RANK", "0")) == 0:
        from editrain.metrics import plot_runs

        plot_runs([run_dir])
    return summary


# ---------------------------------------------------------------------------- fault tolerant
def _group_main(cfg: Config, replica: int, attempt: int, lighthouse: str,
                data_entry: str | None = None) -> None:
    """One replica group: a torch elastic job of ``pp_size x shard_size x tp_size`` local
    workers, or with one worker that worker itself, in this process (one interpreter
    start-up less: a restarted replica is back sooner).

    The group dies with the launcher (also one killed with SIGKILL; its workers die with it
    in turn); Ctrl-C or SIGTERM stop it in order and quietly (the launcher reports the
    interrupt; exit code 128 + the signal's number). A failure is said in one line on
    stderr and the process exits with 2 for an error editrain reports, 1 otherwise; the
    tracebacks are in ``RUN_DIR/replica{replica}/logs/`` (see
    :func:`editrain.launch.logs_dir`).

    Args:
        cfg: the run's configuration (``run_dir`` prepared).
        replica: this group's replica id.
        attempt: how many times this group was started before.
        lighthouse: the torchft lighthouse's address.
        data_entry: the token cache entry the launcher prepared.
    """
    from editrain.fault import ATTEMPT_ENV
    from editrain.spawn import die_with_parent, interrupts_raise
    from editrain.sync.ft import LIGHTHOUSE_ENV, REPLICA_ENV
    from editrain.train import run_worker

    die_with_parent()
    # Warnings as bare lines, whatever this process inherited.
    logging.basicConfig(level=logging.WARNING, format="%(message)s", force=True)
    os.environ[REPLICA_ENV] = str(replica)
    os.environ[ATTEMPT_ENV] = str(attempt)
    os.environ[LIGHTHOUSE_ENV] = lighthouse
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers log every quorum at info
    try:
        interrupts_raise()  # inside the try: a Ctrl-C held back while starting comes now
        if cfg.dist.replica_size > 1:
            run_group(cfg, data_entry)
            return
        os.environ.update(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(free_port()), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        run_worker(cfg, cfg.run_dir, data_entry)
        return
    except Interrupted as e:
        sys.exit(e.exit_code)
    except LaunchError as e:
        line, code = str(e), e.exit_code
    except Exception as e:  # the group's one worker ran here; run_worker logged the traceback
        name = type(e).__name__
        what = str(e) if name in USER_ERRORS else f"{name}: {e}"
        line = (f"rank 0: {one_line(what)} (traceback: "
                f"{logs_dir(cfg, cfg.run_dir) / 'rank0.log'})")
        code = 2 if name in USER_ERRORS else 1
    print(f"editrain: replica group {replica} failed: {line}", file=sys.stderr, flush=True)
    sys.exit(code)


def run_ft(cfg: Config, run_dir: Path, data_entry: str | None = None) -> dict[str, Any]:
    """``editrain train --ft``: a lighthouse here, one process tree per replica group, a
    group that dies started again (after ``sim.fail_restart_s``) as long as the others
    still train. Returns the run's summary (also written to ``summary.json``).

    A group says why it failed in one line (see :func:`_group_main`). On Ctrl-C or SIGTERM
    here (``KeyboardInterrupt`` / :class:`editrain.spawn.Interrupted`), or any error, the
    groups still running are stopped on the way out: SIGTERM, SIGKILL after 10 s (a
    group's workers die with their group).

    Args:
        cfg: the run's configuration.
        run_dir: the prepared run directory.
        data_entry: the token cache entry prepared for the run, handed to every group.

    Raises:
        LaunchError: every replica group failed.
    """
    from editrain.sync.ft import start_lighthouse

    d = cfg.dist
    replicas = d.nproc // d.replica_size
    lighthouse = None
    address = d.ft_lighthouse
    if not address:
        lighthouse = start_lighthouse(d.ft_min_replicas, d.ft_join_timeout_s,
                                      d.ft_heartbeat_timeout_s,
                                      tick_s=d.ft_heartbeat_interval_s)
        address = lighthouse.address()
    cfg = dataclasses.replace(cfg, dist=dataclasses.replace(d, ft_replicas=replicas,
                                                            fault_tolerance="torchft"))
    # The groups start as the workers of a local job do: forked from the server that has
    # imported torch (a restarted group is back sooner), or spawned as EDITRAIN_START_METHOD
    # says; never forked from this process, which runs the lighthouse.
    ctx = mp.get_context(start_worker_server())
    procs: dict[int, Any] = {}
    attempts = dict.fromkeys(range(replicas), 0)
    events: list[dict[str, Any]] = []
    t0 = time.perf_counter()

    def start(r: int) -> None:
        procs[r] = ctx.Process(target=_group_main,
                               args=(cfg, r, attempts[r], address, data_entry),
                               name=f"editrain-replica{r}")
        with children_start_with_sigint_blocked():  # no traceback on a Ctrl-C while it boots
            procs[r].start()
        events.append({"event": "start", "replica": r, "attempt": attempts[r],
                       "time_s": time.perf_counter() - t0, "unix_time": time.time()})

    try:
        for r in range(replicas):
            start(r)
        finished_at: float | None = None
        while any(p.is_alive() for p in procs.values()):
            # A restarted group that has not rejoined when every other group is done never
            # will (there is nobody left to heal from): stop it after a grace period.
            done = [s for s, p in procs.items() if not p.is_alive() and p.exitcode == 0]
            late = [s for s, p in procs.items() if p.is_alive() and attempts[s] > 0]
            if done and len(done) + len(late) == len(procs) and late:
                finished_at = finished_at or time.perf_counter()
                if time.perf_counter() - finished_at > d.ft_heartbeat_timeout_s + 5:
                    for s in late:
                        if not (run_dir / f"replica{s}" / "summary.json").exists():
                            log.warning("replica group %d restarted too late: the others "
                                        "finished before it could rejoin; stopping it", s)
                            procs[s].kill()
                            procs[s].join()
                            events.append({"event": "stopped_late", "replica": s,
                                           "attempt": attempts[s],
                                           "time_s": time.perf_counter() - t0})
                            procs.pop(s)
                    continue
            for r, p in list(procs.items()):
                if p.is_alive() or p.exitcode == 0 or p.exitcode is None:
                    continue
                events.append({"event": "died", "replica": r, "attempt": attempts[r],
                               "exit_code": p.exitcode, "time_s": time.perf_counter() - t0,
                               "unix_time": time.time()})
                others = [q for s, q in procs.items() if s != r and q.is_alive()]
                if not others or attempts[r] >= max(1, d.max_restarts):
                    log.warning("replica group %d died (exit code %s); not restarted",
                                r, p.exitcode)
                    procs.pop(r)
                    continue
                log.warning("replica group %d died (exit code %s); restarting it in %.1f s "
                            "while the others train on", r, p.exitcode, cfg.sim.fail_restart_s)
                time.sleep(cfg.sim.fail_restart_s)
                attempts[r] += 1
                start(r)
            time.sleep(0.1)
    finally:
        # Interrupted or failed: the groups still alive stop in order (their workers with
        # them) within a few seconds, else they are killed (their workers die with them).
        for p in procs.values():
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + 10
        for p in procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
        if lighthouse is not None:
            lighthouse.shutdown()
    summary = _summarise(run_dir, replicas, events, time.perf_counter() - t0)
    if not summary["finished_replicas"]:
        codes = [e["exit_code"] for e in events if e["event"] == "died"]
        raise LaunchError("every replica group failed (each one's reason is above; the "
                          f"tracebacks are in {run_dir}/replica*/logs/); nothing finished",
                          2 if codes and all(c == 2 for c in codes) else 1)
    return summary


SUMMARY_MAX_BYTES = 16 << 20
"""The largest replica group's ``summary.json`` read back (a few kilobytes are written)."""


def _summarise(run_dir: Path, replicas: int, events: list[dict[str, Any]],
               wall_s: float) -> dict[str, Any]:
    """The run's summary from every replica group's own ``summary.json``."""
    groups = {}
    for r in range(replicas):
        path = run_dir / f"replica{r}" / "summary.json"
        if os.path.lexists(path):
            groups[r] = read_json(path, max_bytes=SUMMARY_MAX_BYTES, schema=Obj(),
                                  error=rundir.RunDirError, what="replica group's summary")
    finished = [g for g in groups.values()]
    summary = {
        "fault_tolerance": "torchft",
        "replicas": replicas,
        "finished_replicas": len(finished),
        "wall_time_s": wall_s,
        "tokens_processed": sum(g.get("tokens_processed", 0) for g in finished),
        "final_val_loss": finished[0]["final_val_loss"] if finished else float("nan"),
        "steps": max((g["steps"] for g in finished), default=0),
        "events": events,
        "per_replica": groups,
    }
    from editrain.metrics import to_json  # strict JSON: a NaN loss is written null

    write_atomic(run_dir / "summary.json", to_json(summary, indent=1), root=run_dir)
    return summary
