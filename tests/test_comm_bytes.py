"""Every cross-replica byte of a run, by cause (docs/metrics.md, "Bytes across replicas").

``editrain train`` on 2 replicas with the sparse 2-bit codec: with the eager merge and with
delayed fragments. Whatever is not a round's own message must stay a few KB per round, and
an eager run with evaluations every few steps sends exactly what the same run without them
sends, plus the evaluations' loss sums (two float64 each).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from editrain.metrics import read_metrics, read_rank_logs
from tests.cli import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # three trainings in one fixture

SMALL = 4096
"""Bytes per round allowed for everything but the rounds (a few KB: the statistics gather
of a round is a float64 per unit and replica, the loss one more)."""
LOSS_SUMS = 16
"""Bytes a 2-rank world all-reduce of an evaluation's two float64 sums transmits per rank
(ring: 2 (W - 1) / W * 16)."""

SETTINGS = {
    "eager": ["--sync.local_sgd_sync_interval", "4", "--sync.overlap_steps", "4",
              "--sync.merge", "eager", "--sync.fragments", "2"],
    "fragments": ["--sync.local_sgd_sync_interval", "4", "--sync.overlap_steps", "3",
                  "--sync.merge", "keep_local", "--sync.fragments", "2"],
}


def _train(tmp: Path, cache: Path, name: str, eval_every: int) -> Path:
    run_dir = tmp / f"{name}-{eval_every}"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    proc = run_cli(["train", "--model.preset", "tiny", "--data.max_bytes", "300000",
                    "--data.vocab_size", "512", "--data.val_tokens", "4096",
                    "--data.cache_dir", str(cache), "--nproc", "2", "--shard-size", "1",
                    "--steps", "16", "--sync.method", "edit", "--sync.comm_dtype", "topk2",
                    *SETTINGS[name], "--train.eval_every", str(eval_every),
                    "--run-dir", str(run_dir), "--quiet"], env=env, merged=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    last = [line for line in proc.stdout.splitlines() if "done:" in line]
    assert last and "across replicas (rounds " in last[-1], proc.stdout[-2000:]
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    tmp = tmp_path_factory.mktemp("bytes")
    # the run without evaluations in between only where the test compares with it (eager)
    return {(name, every): _train(tmp, data_cache, name, every)
            for name in SETTINGS for every in ((4, 1000) if name == "eager" else (4,))}


def _bytes(run_dir: Path) -> tuple[dict, int, int]:
    """(cross_replica_bytes of summary.json, syncs, evaluations)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    evals = sum(1 for row in read_metrics(run_dir) if "val_loss" in row)
    return summary["cross_replica_bytes"], summary["num_syncs"], evals


@pytest.mark.parametrize("name", list(SETTINGS))
def test_only_the_rounds_send_more_than_a_few_kb_per_sync(runs, name):
    got, syncs, _ = _bytes(runs[(name, 4)])
    assert syncs >= 6
    assert got["total"] == sum(v for k, v in got.items() if k != "total")
    assert got["rounds"] > 0
    for cause, sent in got.items():
        if cause not in ("rounds", "total"):
            assert sent <= SMALL * syncs, (cause, sent, syncs)
    assert got["consensus"] == got["checkpoints"] == got["gradients"] == 0
    # every rank's totals close its rank log; rank 0's are the summary's
    logs = read_rank_logs(runs[(name, 4)])
    last = {rank: rows[-1] for rank, rows in logs.items()}
    assert sorted(last) == [0, 1]
    assert all(row["event"] == "cross_replica_bytes" for row in last.values())
    assert {k: last[0][k] for k in got} == got


def test_evaluations_send_their_loss_sums_only(runs):
    """Evaluating the global model of an eager run every 4 steps sends nothing but each
    evaluation's loss sums: every other cause is byte for byte the run's without the
    evaluations in between."""
    with_evals, _, n_with = _bytes(runs[("eager", 4)])
    without, _, n_without = _bytes(runs[("eager", 1000)])
    assert n_with >= n_without + 3
    for cause in with_evals:
        if cause not in ("evaluation", "total"):
            assert with_evals[cause] == without[cause], (cause, with_evals, without)
    assert with_evals["evaluation"] == LOSS_SUMS * n_with
    assert without["evaluation"] == LOSS_SUMS * n_without
    # the delayed fragments' global model (the anchors) costs nothing either
    fragments, _, n_fragments = _bytes(runs[("fragments", 4)])
    assert fragments["evaluation"] == LOSS_SUMS * n_fragments
