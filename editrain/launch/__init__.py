"""Starting a training job, stage after stage: inputs, run directory, data, workers, summary.


1. :mod:`editrain.launch.job`: the inputs checked into a frozen :class:`Job` (world size,
   run directory, threads); every later stage reads the job, nothing else.
2. :mod:`editrain.launch.run_dir`: the run directory locked for the whole job and checked
   before any work (a different run, another job's directory: refused), claimed (run
   record, ``config.toml``) only once the data and checkpoint are known usable.
3. :mod:`editrain.launch.data`: the corpus tokenised once, here, for every worker; the
   checkpoint to resume checked against it.
4. The workers: locally under torch's elastic launcher (:mod:`editrain.launch.elastic`,
   restarts from torch), as ``--ft`` replica groups around a torchft lighthouse
   (:mod:`editrain.launch.ft`), or, under torchrun, this process is one of them.
5. The summary: the loss curves plotted (a ``--ft`` run's ``summary.json`` gathered from
   its groups').

Nothing up to stage 2 imports torch: the server the workers are forked from
(:func:`editrain.spawn.start_worker_server`) starts right after it and imports torch and
editrain on one core while this process imports torch for itself (the data and workers
stages) on the other, instead of one after the other (about 5 s of a local launch's start
on a 2-core machine).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from editrain.config import Config
from editrain.launch.data import prepare_job_data
from editrain.launch.job import Job, check_local, check_torchrun
from editrain.launch.run_dir import RunDirClaim, ended_run_watch
from editrain.spawn import import_torch, start_worker_server, stop_worker_server

log = logging.getLogger("editrain")


def run_local(cfg: Config, started_at: float | None = None) -> dict[str, Any]:
    """``editrain train`` without torchrun: ``dist.nproc`` local workers under torch
    elastic (restarts from torch), or with ``dist.fault_tolerance = torchft`` one process
    tree per replica group around a lighthouse (``started_at``: when the command started,
    :attr:`Job.started_at`). Returns the run's summary."""
    job = check_local(cfg, started_at)
    with RunDirClaim(job) as run_dir:  # locked at once if editrain used it before
        try:
            run_dir.check()  # refused before anything is written
            start_processes(job)
            # torch imported for the data and workers stages here, its Ctrl-C deferred to
            # the end of the import (an interrupt inside it can abort the process)
            import_torch()
            data = prepare_job_data(job)
            run_dir.claim()
            summary = start_workers(job, str(data.cache_dir))
        finally:
            # The workers are done (or were never started: refused input, a failed job,
            # Ctrl-C, when the fork server may still be importing torch): the server would
            # otherwise outlive this process by seconds, its interpreter's teardown holding
            # the terminal's (or a caller's) stdout and stderr (spawn.stop_worker_server).
            stop_worker_server()
        summarise(job)
        return summary


def run_under_torchrun(cfg: Config, started_at: float | None = None) -> dict[str, Any]:
    """Join a torchrun job: rank 0 claims the run directory (the other ranks wait for its
    decision, and share its refusal), every rank trains, rank 0 plots (``started_at``:
    when this rank's command started, :attr:`Job.started_at`). Returns this rank's
    summary.

    Rank 0 summarises while the job still holds its lock: a replica group of a
    fault-tolerant run notes there that it finished the run (:func:`summarise`), and a new
    job of the same group that started between the release and the note was taken as
    finished after it had joined the run."""
    import_torch()
    from editrain.train import run_worker

    job = check_torchrun(cfg, started_at)
    with RunDirClaim(job) as run_dir:
        # Rank 0's decision, the same on every rank: whether the workers resume the run's
        # latest checkpoint (not each rank's TORCHELASTIC_RESTART_COUNT, which differs
        # between nodes after one node's failure).
        rejoined = run_dir.join()
        summary = run_worker(job.cfg, str(job.run_dir), rejoined=rejoined,
                             run_ended=ended_run_watch(job))
        if job.rank == 0:
            summarise(job)
    return summary


def start_processes(job: Job) -> None:
    """Before the data: each worker's threads in the environment the workers inherit, and
    the server they are forked from started, so that it imports torch and editrain while
    this process prepares the data (a ``--ft`` run starts it with its groups)."""
    os.environ.setdefault("OMP_NUM_THREADS", str(job.threads))
    if not job.ft:
        start_worker_server()


def start_workers(job: Job, data_entry: str) -> dict[str, Any]:
    """Run the local workers (or the ``--ft`` replica groups) to the end; returns the
    run's summary (rank 0's, or the groups' gathered).

    Args:
        job: the checked job, its run directory claimed.
        data_entry: the token cache entry prepared for the workers.
    """
    if not job.cfg.quiet:
        log.info("run directory: %s; %d local workers (%d threads each)", job.run_dir,
                 job.world, job.threads)
    if job.ft:
        from editrain.launch.ft import run_ft

        return run_ft(job, data_entry)
    from editrain.launch.elastic import run_elastic

    results = run_elastic(job.cfg, job.world, job.cfg.dist.max_restarts, data_entry)
    return results.get(0, {}) if isinstance(results, dict) else {}


def summarise(job: Job) -> None:
    """Plot the run's loss curves into its directory: its own, or those of the ``--ft``
    replica groups that wrote metrics, each plot logged, unless quiet or under torchrun.

    A torchrun job of a fault-tolerant run is one replica group of several jobs sharing
    the directory: each gathers the run's ``summary.json`` and draws every group's curve
    when it ends, under the run's lock, so that they never write the run's files at once
    and the last group to end leaves them whole."""
    from editrain.metrics import plot_runs

    if job.ft and job.under_torchrun:
        from editrain import rundir
        from editrain.fault import ft_identity
        from editrain.launch.ft import summarise_groups
        from editrain.launch.run_dir import RUN_LOCK_WAIT_S

        with rundir.RunLock(job.run_dir).acquire(wait_s=RUN_LOCK_WAIT_S):
            # This group's job is over, and it finished the run (its workers returned): a
            # group that starts now need not wait for it (editrain.launch.run_dir.
            # RunDirClaim.join), nor one waiting in its first quorum, once every other
            # group has finished too, even where no checkpoint says so (ended_run_problem).
            rundir.note_group(job.run_dir, ft_identity(job.cfg, job.world)[0], ended=True,
                              finished_steps=job.cfg.train.steps)
            summarise_groups(job.run_dir, _group_count(job), events=[])
            plot_runs(_groups_with_metrics(job), job.run_dir)
        return
    runs = _groups_with_metrics(job) if job.ft else [job.run_dir]
    plots = plot_runs(runs, job.run_dir) if runs else []
    for path in plots if not (job.cfg.quiet or job.under_torchrun) else []:
        log.info("plot: %s", path)


def _group_count(job: Job) -> int:
    """The replica groups of a fault-tolerant run: the launcher's, or under torchrun
    (where this job is one of them) ``dist.ft_replicas``."""
    if not job.under_torchrun:
        return job.groups
    from editrain.fault import ft_identity

    return ft_identity(job.cfg, job.world)[1]


def _groups_with_metrics(job: Job) -> list:
    """The directories of a fault-tolerant run's replica groups that wrote metrics (one
    curve per group, drawn in the run directory)."""
    runs = [job.group_dir(r) for r in range(_group_count(job))]
    return [p for p in runs if (p / "metrics.jsonl").exists()]
