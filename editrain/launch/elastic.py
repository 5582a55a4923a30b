"""Local workers under torch's elastic launcher: the worker stage of a local launch.

Each replica group of ``--ft`` starts its workers the same way.

The workers are forked from a server that imported torch and editrain once
(:func:`editrain.spawn.start_worker_server`; ``EDITRAIN_START_METHOD=spawn`` spawns
each). Their output stays on the terminal; torch elastic's own multi-line reports go to
``RUN_DIR/logs/launcher.log``, and a failed attempt is said in one line naming the rank
and its error (:func:`describe_failure`), its traceback in the run's logs.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing import LogsDest, LogsSpecs

from editrain.config import Config
from editrain.paths import shown
from editrain.rundir import logs_dir
from editrain.safe_io import check_no_links, make_dir
from editrain.spawn import (
    LOOPBACK,
    USER_ERRORS,
    Interrupted,
    LaunchError,
    children_start_with_sigint_blocked,
    free_port,
    one_line,
    read_error_file,
    start_worker_server,
)

log = logging.getLogger("editrain")

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
            cause = describe_failure(None, self.error_files, root)
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


def describe_failure(reported: tuple[int, Any] | None, error_files: dict[int, Path],
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
                           f"{shown(logs / LAUNCHER_LOG)})")
    if rank in errors:
        name, message = errors[rank]
        where = logs / f"rank{rank}.log"
        where = where if where.exists() else error_files[rank]
        if name in USER_ERRORS:
            return LaunchError(f"rank {rank}: {one_line(message)} (traceback: {shown(where)})", 2)
        what = f"{name}: {message}" if name else message
        return LaunchError(f"rank {rank} failed: {one_line(what)} (traceback: {shown(where)})")
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
                       f"{shown(logs / LAUNCHER_LOG)})")


def _address_in_use(e: BaseException) -> bool:
    """Whether a rendezvous failed because its port was taken."""
    text = f"{e} {e.__cause__}"
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def _worker(cfg: Config, run_dir: str, data_entry: str | None) -> dict[str, Any]:
    """A worker's entry point as torch elastic starts it: :func:`editrain.train.run_worker`,
    imported in the worker (where the fork server has it already), so that the launcher
    never imports the trainer, FSDP and DTensor (about a second before the workers start)."""
    from editrain.train import run_worker

    return run_worker(cfg, run_dir, data_entry)


def run_elastic(cfg: Config, nproc: int, max_restarts: int, data_entry: str | None = None
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
                return elastic_launch(launch_cfg, _worker)(cfg, cfg.run_dir, data_entry)
        except RendezvousConnectionError as e:
            if not _address_in_use(e):
                raise LaunchError(f"cannot start the rendezvous on {LOOPBACK}:{port}: "
                                  f"{one_line(str(e.__cause__ or e))}") from None
            log.debug("rendezvous port %d was taken; trying another", port)
            taken.append(port)
        except ChildFailedError as e:
            reported = e.get_first_failure()
            raise describe_failure(reported, specs.error_files, logs) from None
        except SignalException as e:
            raise Interrupted(e.sigval) from None
        except KeyboardInterrupt:
            raise Interrupted(signal.SIGINT) from None
    raise LaunchError(f"cannot start the rendezvous: the free ports chosen for it "
                      f"({', '.join(map(str, taken))} on {LOOPBACK}) were taken by other "
                      f"processes before it could listen, {PORT_TRIES} times")
