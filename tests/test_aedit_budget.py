"""A-EDiT's budget through ``editrain train``: the steps a run trains.

The forced step schedule ``[2, 3]`` (replica 0 syncs every 2 of its steps, replica 1 every
3) makes every round 5 replica-steps, 2.5 synchronous steps of progress on 2 replicas, so
the sync points fall at progress 2.5, 5, 7.5, 10, 12.5.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from editrain.metrics import current_rows
from tests.cli import run_cli

pytestmark = pytest.mark.slow

TOKENS_PER_STEP = 2 * 4 * 32
"""Tokens of one synchronous step: 2 replicas x batch 4 x 32 tokens."""


@pytest.fixture(scope="module")
def cache(data_cache) -> Path:
    return data_cache


def _train(cache: Path, run_dir: Path, *args: str):
    return run_cli(["train", "--model.preset", "tiny", "--data.max_bytes", "400000",
                    "--data.vocab_size", "512", "--data.cache_dir", str(cache),
                    "--train.batch_size", "4", "--train.seq_len", "32",
                    "--train.eval_tokens", "1024", "--train.final_eval_tokens", "1024",
                    "--quiet", "--nproc", "2", "--shard-size", "1", "--method", "aedit",
                    "--run-dir", str(run_dir), *args],
                   env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)


def _ok(proc) -> None:
    assert proc.returncode == 0, proc.stderr[-4000:]


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _rows(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return current_rows([json.loads(line) for line in lines])


@pytest.mark.parametrize("schedule,steps,trained", [("[3,3]", 6, 6), ("[2,3]", 10, 8)])
def test_nonblocking_run_trains_its_budget(cache, tmp_path, schedule, steps, trained):
    """``--steps N`` with ``overlap_steps 1`` trains the tokens of N synchronous steps (the
    replicas end at the launch of the round that reaches them, rank 0's replica at its
    step ``trained``); before, every replica trained one step more and a forced round
    synced it: ``--steps 6`` trained 7 steps, 1792 tokens."""
    run = tmp_path / "run"
    _ok(_train(cache, run, "--steps", str(steps), f"--sim.step_schedule={schedule}",
               "--sync.overlap_steps", "1"))
    summary = _summary(run)
    assert (summary["steps"], summary["steps_run"]) == (trained, trained)
    assert summary["tokens"] == steps * TOKENS_PER_STEP
    assert max(r["step"] for r in _rows(run)) == trained
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == [f"step_{steps:08d}"]
