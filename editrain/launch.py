"""Starting workers: locally through torch's elastic launcher, or joining a torchrun job.

The run directory is prepared here, before any process group exists: a directory holding a
different run is refused unless ``--overwrite``; the resolved configuration is written to
``RUN_DIR/config.toml``; the corpus is tokenised once in the parent so workers reuse it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from editrain.config import Config, ConfigError, dumps_toml, to_dict, validate_world
from editrain.corpus import prepare_data
from editrain.spawn import LOOPBACK, free_port

log = logging.getLogger("editrain")

RUN_FILES = ("config.toml", "metrics.jsonl", "ranks", "loss_vs_tokens.png", "loss_vs_time.png",
             "tb", "checkpoints", "summary.json")


def default_run_dir() -> Path:
    """``runs/<timestamp>`` (a short random suffix keeps parallel runs apart)."""
    return Path("runs") / (time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:4])


def resolved(cfg: Config) -> Config:
    """A copy with the method's defaults filled in, as it will run."""
    return dataclasses.replace(cfg, sync=cfg.sync.resolve())


def check_run_dir(cfg: Config, run_dir: Path) -> list[str]:
    """Refuse a ``run_dir`` holding another run (unless ``--overwrite`` or ``--resume``);
    returns the run files that ``prepare_run_dir`` will replace. Touches nothing."""
    existing = [n for n in RUN_FILES if (run_dir / n).exists()]
    # A fault-tolerant run's replica groups write into replica0/, replica1/, ...
    existing += sorted(p.name for p in run_dir.glob("replica*")
                       if p.is_dir() and p.name[len("replica"):].isdigit())
    if existing and not cfg.resume and not cfg.overwrite:
        raise ConfigError(
            f"--run-dir: {run_dir} already holds a run ({', '.join(existing)}); choose "
            "another directory, resume it with --resume, or pass --overwrite to replace it"
        )
    return existing


def choose_run_dir(cfg: Config, default) -> Path:
    """``--run-dir``; else, when resuming a run directory, that directory; else a new one."""
    if cfg.run_dir:
        return Path(cfg.run_dir)
    if cfg.resume:
        from editrain.checkpoint import CKPT_DIR, MARKER

        p = Path(cfg.resume)
        if (p / MARKER).is_file() and p.parent.name == CKPT_DIR:
            return p.parent.parent
        if (p / CKPT_DIR).is_dir():
            return p
    return default()


def prepare_run_dir(cfg: Config, run_dir: Path) -> None:
    """Create ``run_dir``; refuse to mix two runs; write ``config.toml``."""
    existing = check_run_dir(cfg, run_dir)
    if existing and not cfg.resume:
        for name in existing:
            path = run_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        log.warning("--overwrite: removed %s from %s", ", ".join(existing), run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.resume and (run_dir / "config.toml").exists():
        return  # the run's own record of its configuration stays as it was
    data = to_dict(resolved(cfg))
    data["run_dir"] = str(run_dir)
    tmp = run_dir / "config.toml.tmp"
    tmp.write_text(dumps_toml(data))
    os.replace(tmp, run_dir / "config.toml")


def _pretokenise(cfg: Config) -> int:
    from editrain.data import SequenceStream, eval_batches

    t0 = time.perf_counter()
    data = prepare_data(cfg)
    # The windows every worker will cut; a too-small corpus fails here, not in the workers.
    t = cfg.train
    SequenceStream(data.train, t.seq_len, 0, cfg.dist.nproc, t.seed)
    eval_batches(data.val[: 2 * t.seq_len + 2], t.seq_len, t.batch_size, 0, cfg.dist.nproc)
    how = "reused cache" if data.reused else f"built in {time.perf_counter() - t0:.1f} s"
    if not cfg.quiet:
        log.info("data: %d train / %d val tokens, vocab %d (%s: %s)", len(data.train),
                 len(data.val), data.vocab_size, how, data.cache_dir)
    return data.vocab_size


def run_local(cfg: Config) -> dict:
    """Spawn ``dist.nproc`` local workers with torch elastic (restarts from torch); with
    ``dist.fault_tolerance = torchft`` one job per replica group around a lighthouse."""
    from editrain.metrics import plot_runs

    nproc = cfg.dist.nproc
    validate_world(cfg, nproc)
    run_dir = choose_run_dir(cfg, default_run_dir)
    cfg = dataclasses.replace(cfg, run_dir=str(run_dir))
    # Nothing is written before the data and the checkpoint to resume are known to be usable.
    check_run_dir(cfg, run_dir)
    vocab = _pretokenise(cfg)
    if cfg.resume:
        from editrain.checkpoint import preflight_resume

        if cfg.dist.fault_tolerance == "torchft":
            from editrain.train import replica_run_dir

            for r in range(nproc // cfg.dist.replica_size):
                preflight_resume(replica_run_dir(cfg.resume, r), cfg, vocab)
        else:
            preflight_resume(cfg.resume, cfg, vocab)
    prepare_run_dir(cfg, run_dir)
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
    if int(os.environ.get("RANK", "0")) == 0:
        prepare_run_dir(cfg, run_dir)
    else:
        # Wait for rank 0 to create the directory (it writes config.toml last).
        deadline = time.monotonic() + 300
        while not (run_dir / "config.toml").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    summary = run_worker(cfg, str(run_dir))
    if int(os.environ.get("RANK", "0")) == 0:
        from editrain.metrics import plot_runs

        plot_runs([run_dir])
    return summary
