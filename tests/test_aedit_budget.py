"""A-EDiT's budget through ``editrain train``: the steps a run trains, and a resume from a
checkpoint whose progress is fractional (its label is that progress rounded).

The forced step schedule ``[2, 3]`` (replica 0 syncs every 2 of its steps, replica 1 every
3) makes every round 5 replica-steps, 2.5 synchronous steps of progress on 2 replicas, so
the sync points fall at progress 2.5, 5, 7.5, 10, 12.5.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from editrain.checkpoint import steps_left_problem
from editrain.metrics import current_rows, latest_job_start, read_rank_steps
from editrain.plan.calibrate import calibrate, job_rows
from editrain.rundir import read_marker
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


@pytest.mark.parametrize("overlap", [1, 2])
def test_nonblocking_tokens_and_lr_never_go_back(cache, tmp_path, overlap):
    """Non-blocking on ``[2, 3]``: the tokens and the learning rate (still in its warm-up,
    so rising with the progress) of every logged step never go back, and the tokens end
    at every replica's steps (the rank files'). Before, a round's steps were counted
    nowhere from its launch to its merge: replica 0 logged 256 tokens at step 1, 0 at its
    launch at step 2, and trained step 3 at the learning rate of step 1."""
    run = tmp_path / "run"
    _ok(_train(cache, run, "--steps", "10", "--sim.step_schedule=[2,3]",
               "--sync.overlap_steps", str(overlap)))
    rows = [r for r in _rows(run) if "loss" in r]
    tokens, lrs = [r["tokens"] for r in rows], [r["lr"] for r in rows]
    assert all(b > a for a, b in zip(tokens, tokens[1:])), tokens
    assert all(b > a for a, b in zip(lrs, lrs[1:])), lrs
    ranks = read_rank_steps(run)
    replica_steps = sum(max(r["step"] for r in got) for got in ranks.values())
    assert tokens[-1] == _summary(run)["tokens"] == replica_steps * TOKENS_PER_STEP // 2


def test_steps_left_compares_the_progress_not_its_label():
    """A checkpoint at progress 7.5 is labelled 8: ``train.steps`` 8 leaves half a step.
    A marker without ``progress`` (written before it was recorded) is judged by its label,
    as before."""
    def cfg(steps: int) -> SimpleNamespace:
        return SimpleNamespace(train=SimpleNamespace(steps=steps))

    assert steps_left_problem({"step": 8, "progress": 7.5}, cfg(8)) is None
    refused = steps_left_problem({"step": 8, "progress": 7.5}, cfg(7))
    assert refused is not None and "progress 7.5" in refused
    assert "step 8" in steps_left_problem({"step": 8}, cfg(8))
    assert steps_left_problem({"step": 8}, cfg(9)) is None


def test_resume_from_a_fractional_progress(cache, tmp_path):
    """A run saves at progress 7.5 (``checkpoint.every 7``), labelled ``step_00000008``.
    Resumed with ``--steps 8`` it trains the half step left (before: refused, "not beyond
    the checkpoint's step 8"). Resumed with the run's own ``--steps 12`` it evaluates where
    the run that never stopped did: at progress 10, due at 8 (before, the evaluations were
    moved past the label 8, and the one at 10 was lost)."""
    common = ["--sim.step_schedule=[2,3]", "--train.eval_every", "8",
              "--checkpoint.every", "7"]
    full = tmp_path / "full"
    _ok(_train(cache, full, "--steps", "12", *common))
    ckpt = full / "checkpoints" / "step_00000008"
    marker = read_marker(ckpt)
    assert (marker["step"], marker["progress"]) == (8, 7.5)
    assert read_marker(full / "checkpoints" / "step_00000012")["progress"] == 12.5

    half = tmp_path / "half"
    _ok(_train(cache, half, "--steps", "8", "--resume", str(ckpt), *common))
    assert _summary(half)["tokens"] == 10 * TOKENS_PER_STEP  # the sync at 10 reaches 8

    resumed = tmp_path / "resumed"
    _ok(_train(cache, resumed, "--steps", "12", "--resume", str(ckpt), *common))

    def evaluations(run: Path) -> list[tuple[int, int, float]]:
        return [(r["step"], r["tokens"], r["val_loss"]) for r in _rows(run)
                if r.get("val_loss") is not None and r["step"] > 6]

    # replica 0's step 8 is progress 10; step 10 the end (12.5); bitwise: an exact resume
    assert [e[:2] for e in evaluations(full)] == [(8, 10 * TOKENS_PER_STEP),
                                                  (10, 12.5 * TOKENS_PER_STEP)]
    assert evaluations(resumed) == evaluations(full)


def test_latest_job_rows_of_a_resumed_run(cache, tmp_path):
    """A run resumed in its own directory from its checkpoint at progress 7.5 (labelled
    8), where replica 0 was at its step 6 and replica 1 at its step 9: the latest job's
    rows (``plan --calibrate``) are each file's from the step its rank resumed at. Before,
    they were the rows after the label 8: replica 0's first two were lost, and replica 1's
    step 9 of the first job counted as the latest's."""
    run = tmp_path / "run"
    common = ["--sim.step_schedule=[2,3]", "--checkpoint.every", "7"]
    _ok(_train(cache, run, "--steps", "12", *common))
    _ok(_train(cache, run, "--steps", "16", "--resume",
               str(run / "checkpoints" / "step_00000008"), *common))
    start, rows, ranks = job_rows(run, 2)
    assert start == latest_job_start(run) == 6
    # (rows up to step 10 replay the first job's: the latest job's own measurements)
    assert [r["step"] for r in rows if "loss" in r][:5] == [7, 8, 9, 10, 11]
    assert [r["step"] for r in ranks[0]] == list(range(7, 15))
    assert [r["step"] for r in ranks[1]] == list(range(10, 22))
    (sample,) = calibrate([run]).samples
    assert sample.replicas == 2
