"""The first stage of a launch: the inputs checked into a :class:`Job`, read by every later one.

Nothing here touches the file system: the world size is checked against the mesh and the
simulation's replica indices, the run directory chosen, and each worker's threads worked
out. The later stages (:mod:`editrain.launch.run_dir`, :mod:`editrain.launch.data`,
:mod:`editrain.launch.elastic`, :mod:`editrain.launch.ft`) take the :class:`Job` and
nothing else of the configuration.
"""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from editrain import rundir
from editrain.argv import env_int, rayon_threads
from editrain.config import Config, validate_world
from editrain.errors import ConfigError
from editrain.spawn import worker_threads


@dataclasses.dataclass(frozen=True)
class Job:
    """One ``editrain train`` job, as checked before any work.

    Args:
        cfg: the configuration, its ``run_dir`` filled in.
        run_dir: the run directory (not necessarily there yet).
        world: the processes that train: the local workers (``dist.nproc``), or
            torchrun's ``WORLD_SIZE``.
        threads: intra-op threads of each local worker (0 under torchrun: each worker
            finds its own).
        rank: this process's rank under torchrun (0 for the local launcher).
        restart: torchrun's restart count of this process (0 for the local launcher).
        under_torchrun: this process is a worker of a torchrun job.
        started_at: the Unix time the ``editrain train`` command started (recorded in the
            run record's history: the trainer's ``done:`` line counts the job's end-to-end
            time from it); None where no command said (a library call).
    """

    cfg: Config
    run_dir: Path
    world: int
    threads: int = 0
    rank: int = 0
    restart: int = 0
    under_torchrun: bool = False
    started_at: float | None = None

    @property
    def ft(self) -> bool:
        """A fault-tolerant run (``--ft``): one process tree per replica group."""
        return self.cfg.dist.fault_tolerance == "torchft"

    @property
    def groups(self) -> int:
        """The replica groups of a fault-tolerant run."""
        return self.world // self.cfg.dist.replica_size

    def group_dir(self, replica: int) -> Path:
        """Replica group ``replica``'s own directory of a fault-tolerant run."""
        return self.run_dir / f"replica{replica}"


def default_run_dir() -> Path:
    """``runs/<timestamp>`` (a short random suffix keeps parallel runs apart)."""
    return Path("runs") / (time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:4])


def resolved(cfg: Config) -> Config:
    """A copy with the method's defaults filled in, as it will run."""
    return dataclasses.replace(cfg, sync=cfg.sync.resolve())


def choose_run_dir(cfg: Config, default: Callable[[], Path]) -> Path:
    """``--run-dir``; else, when resuming a run directory, that directory; else a new one."""
    if cfg.run_dir:
        return Path(cfg.run_dir)
    run = rundir.resumed_run_dir(cfg.resume) if cfg.resume else None
    return run if run is not None else default()


def check_local(cfg: Config, started_at: float | None = None) -> Job:
    """The job of a local launch: ``dist.nproc`` workers on this machine (``started_at``:
    :attr:`Job.started_at`).

    Raises:
        ConfigError: the world does not fit the configuration (the mesh, ``sim.*``).
    """
    nproc = cfg.dist.nproc
    validate_world(cfg, nproc)
    run_dir = choose_run_dir(cfg, default_run_dir)
    rayon_threads()  # the data stage may build the token cache: junk refused before it
    # The user's OMP_NUM_THREADS stands (see editrain.spawn.worker_threads).
    return Job(dataclasses.replace(cfg, run_dir=str(run_dir)), run_dir, nproc,
               threads=worker_threads(cfg, local_world=nproc), started_at=started_at)


def check_torchrun(cfg: Config, started_at: float | None = None) -> Job:
    """The job this process joins as a worker of torchrun (its environment: ``RANK``,
    ``WORLD_SIZE``, ``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT``); the run
    directory defaults to ``runs/<run id>``, the same on every rank (``started_at``:
    :attr:`Job.started_at`).

    Raises:
        ConfigError: the world does not fit the configuration; a fault-tolerant job
            without ``dist.ft_replicas``.
    """
    if cfg.dist.fault_tolerance == "torchft" and not cfg.dist.ft_replicas:
        # Derived from dist.nproc, which torchrun ignores and may differ between the
        # groups' jobs, the count would be each job's own.
        raise ConfigError("dist.ft_replicas: a replica group of a fault-tolerant run started "
                          "by torchrun must name the run's number of groups (the same in "
                          "every group's job), with dist.ft_replica_id and dist.ft_lighthouse")
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "torchrun")
    run_dir = choose_run_dir(cfg, lambda: Path("runs") / run_id)
    cfg = dataclasses.replace(cfg, run_dir=str(run_dir))
    world = env_int("WORLD_SIZE", minimum=1)
    validate_world(cfg, world)
    rayon_threads()  # every rank's data stage may build the token cache
    return Job(cfg, run_dir, world, rank=env_int("RANK", 0),
               restart=env_int("TORCHELASTIC_RESTART_COUNT", 0),
               under_torchrun=True, started_at=started_at)
