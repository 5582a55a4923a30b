"""The run directory stage of a launch: locked, checked, then claimed (record and config).

See :mod:`editrain.rundir`. The directory is locked for the whole job, checked before any
work, and claimed once the data and the checkpoint are known usable.

A directory holding a different run is refused unless ``--overwrite``, a directory another
job is using is refused, and the job holds the directory's lock until it ends; claiming it
writes the run record (identity, timeline) and the resolved configuration
(``RUN_DIR/config.toml``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from editrain import rundir
from editrain.config import Config, dumps_toml, to_dict
from editrain.config.applicability import drop_inapplicable
from editrain.errors import RunDirError
from editrain.launch.job import Job, resolved
from editrain.safe_io import write_atomic

TORCHRUN_WAIT_S = 120
"""How long a torchrun rank other than 0 waits for rank 0 to claim the run directory."""


def resume_checkpoints(cfg: Config) -> list[Path]:
    """The checkpoint(s) ``--resume`` names: one, or one per replica group of a
    fault-tolerant run (``RUN_DIR/replica{r}``); empty without ``--resume``."""
    if not cfg.resume:
        return []
    from editrain.checkpoint import resolve_resume  # imports torch: not for a fresh run

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


class RunDirClaim:
    """A job's hold on its run directory, from the check to the end of the job (a context
    manager: the directory's lock, if taken, is released on the way out).

    A local launch takes the lock at once when editrain has used the directory before
    (so a second job on it is refused before any work), checks it (:meth:`check`), and
    claims it once its inputs are known usable (:meth:`claim`). Under torchrun the
    ranks :meth:`join` it.

    Args:
        job: the checked job.
    """

    def __init__(self, job: Job) -> None:
        self.job = job
        self.lock = rundir.RunLock(job.run_dir)

    def __enter__(self) -> RunDirClaim:
        if not self.job.under_torchrun and (self.job.run_dir / rundir.LOCK).exists():
            self.lock.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.lock.release()

    def check(self) -> None:
        """Refuse the directory unless this job may use it (:func:`check_run_dir`);
        nothing is written."""
        check_run_dir(self.job.cfg, self.job.run_dir)

    def claim(self) -> rundir.RunRecord:
        """Make the directory this job's (:func:`prepare_run_dir`, under the lock)."""
        return prepare_run_dir(self.job.cfg, self.job.run_dir, self.lock)

    def join(self) -> None:
        """Under torchrun: rank 0 holds the directory's lock for the job and claims it
        (after a restart by torchrun the directory is this job's already, its record is
        there: it resumes it as is); every other rank waits for rank 0 to have written
        ``config.toml``, which it writes last."""
        job = self.job
        if job.rank != 0:
            deadline = time.monotonic() + TORCHRUN_WAIT_S
            while not (job.run_dir / "config.toml").exists():
                if time.monotonic() > deadline:
                    raise RunDirError(
                        f"--run-dir: rank {job.rank} saw no config.toml from rank 0 in "
                        f"{job.run_dir} within {TORCHRUN_WAIT_S} s: the run directory must "
                        f"be on storage every node sees, at the same path")
                time.sleep(0.1)
            return
        self.lock.acquire()
        if not (job.restart > 0 and rundir.read_record(job.run_dir) is not None):
            self.claim()
