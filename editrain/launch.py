"""Starting workers: locally through torch's elastic launcher, or joining a torchrun job.

The run directory is prepared here, before any process group exists (see
:mod:`editrain.rundir`): a directory holding a different run is refused unless
``--overwrite``, a directory another job is using is refused, and the job holds the
directory's lock until it ends; the run record (identity, timeline) and the resolved
configuration (``RUN_DIR/config.toml``) are written; the corpus is tokenised once in the
parent so workers reuse it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

from editrain import rundir
from editrain.config import Config, dumps_toml, to_dict, validate_world
from editrain.corpus import prepare_data
from editrain.spawn import LOOPBACK, free_port

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
        data = to_dict(resolved(cfg))
        data["run_dir"] = str(run_dir)
        tmp = run_dir / "config.toml.tmp"
        tmp.write_text(dumps_toml(data))
        os.replace(tmp, run_dir / "config.toml")
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
    # workers. Data ranks: every replica's shards (tensor-parallel peers read alike).
    t = cfg.train
    data_world = cfg.dist.nproc // cfg.dist.tp_size
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
    finally:
        lock.release()


def _run_local(cfg: Config, run_dir: Path, lock: rundir.RunLock) -> dict:
    """:func:`run_local` once the run directory is chosen (and locked if it was used)."""
    from editrain.metrics import plot_runs

    nproc = cfg.dist.nproc
    # Nothing is written before the data and the checkpoint to resume are known to be usable.
    check_run_dir(cfg, run_dir)
    data = _pretokenise(cfg)
    if cfg.resume:
        from editrain.checkpoint import preflight_resume

        if cfg.dist.fault_tolerance == "torchft":
            from editrain.train import replica_run_dir

            for r in range(nproc // cfg.dist.replica_size):
                preflight_resume(replica_run_dir(cfg.resume, r), cfg, data.vocab_size, data)
        else:
            preflight_resume(cfg.resume, cfg, data.vocab_size, data)
    prepare_run_dir(cfg, run_dir, lock)
    threads = cfg.dist.threads_per_proc or max(1, (os.cpu_count() or 1) // nproc)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    if not cfg.quiet:
        log.info("run directory: %s; %d local workers (%d threads each)", run_dir, nproc,
                 threads)
    if cfg.dist.fault_tolerance == "torchft":
        from editrain.fault import run_ft

        summary = run_ft(cfg, run_dir)
        plotted = [run_dir / f"replica{r}" for r in range(nproc // cfg.dist.replica_size)]
        plotted = [p for p in plotted if (p / "metrics.jsonl").exists()]
    else:
        results = _elastic(cfg, nproc, cfg.dist.max_restarts)
        summary = results.get(0, {}) if isinstance(results, dict) else {}
        plotted = [run_dir]
    for path in plot_runs(plotted) if plotted else []:
        if not cfg.quiet:
            log.info("plot: %s", path)
    return summary


def run_group(cfg: Config) -> dict:
    """One replica group of a fault-tolerant run (``cfg.run_dir`` prepared): a torch
    elastic job of ``shard_size x tp_size`` workers, never restarted by torch (the
    launcher restarts the whole group, which then heals from its peers)."""
    results = _elastic(cfg, cfg.dist.replica_size, 0)
    return results.get(0, {}) if isinstance(results, dict) else {}


def _elastic(cfg: Config, nproc: int, max_restarts: int) -> Any:
    """``nproc`` local workers running :func:`editrain.train.run_worker` under torch elastic."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from editrain.train import run_worker

    launch_cfg = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc,
        run_id=f"editrain-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint=f"{LOOPBACK}:{free_port()}",
        rdzv_configs={"is_host": True},
        max_restarts=max_restarts, start_method="spawn", monitor_interval=0.5,
        local_addr=LOOPBACK,  # a laptop run is not reachable from the network
    )
    return elastic_launch(launch_cfg, run_worker)(cfg, cfg.run_dir)


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
