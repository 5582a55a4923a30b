"""Every round the engine completes is in a run's record once, in order: one log line and
one ``sync`` entry in ``metrics.jsonl`` per round, those that ``engine.finish(force=True)``
completes after the last step included (in rows of their own, docs/metrics.md).

Before, the loop took the engine's log only after each step, so the rounds the end
completed (the armed layer-wise round, rounds in flight, the forced ones) were counted in
``summary.json`` and the ``done:`` line but had no log line and no entry: the default run
printed 3 sync lines and said 4 syncs.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from editrain.bench.runs import read_run
from editrain.bench.stragglers import _replica_steps
from editrain.metrics import current_rows, read_metrics
from editrain.tracking import standard_metrics
from tests.cli import run_cli
from tests.test_checkpoint import _base_args

# 12 steps as the default run does its 80: a sync every H steps, evaluations at the syncs
# and a final one over other tokens than the loop's (so the loop does not evaluate, and
# finish the round, at the last step: the end's finish(force=True) runs it).
SHORT = ["--nproc", "2", "--shard-size", "1", "--steps", "12", "--train.eval_every", "4",
         "--train.final_eval_tokens", "2048"]
CASES = {
    # The round armed at step 12 runs in no forward: the end runs it.
    "edit": ["--method", "edit", "--sync.local_sgd_sync_interval", "4"],
    # Two fragments merged two steps after their launch: fragment 1's round launched at
    # step 12 is in flight at the end, and the end syncs fragment 0 once more.
    "streaming": ["--method", "edit", "--sync.local_sgd_sync_interval", "4",
                  "--sync.fragments", "2", "--sync.overlap_steps", "2"],
    # Non-blocking A-EDiT: its last round merges at its launch, the last step.
    "aedit": ["--method", "aedit", "--sim.step_schedule=[2,3]", "--sync.overlap_steps", "1"],
}
SYNC_LINE = re.compile(r"^sync (\d+)\b", re.MULTILINE)


@pytest.fixture(scope="module")
def cache(data_cache) -> Path:
    return data_cache


def train(cache: Path, run_dir: Path, *args: str) -> str:
    """Run ``editrain train`` (not quiet: the sync lines are what is checked) and return
    what it printed."""
    argv = [a for a in _base_args(cache) if a != "--quiet"]
    out = run_cli(["train", *argv, "--run-dir", str(run_dir), *args], timeout=400,
                  env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout + out.stderr


def entries(run_dir: Path) -> list[dict]:
    """The sync entries of the run's current history, in file order."""
    return [r["sync"] for r in current_rows(read_metrics(run_dir)) if r.get("sync")]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_every_round_has_one_log_line_and_one_entry(case: str, cache: Path,
                                                    tmp_path: Path) -> None:
    run = tmp_path / case
    printed = train(cache, run, *SHORT, *CASES[case])
    summary = json.loads((run / "summary.json").read_text())
    syncs = summary["num_syncs"]
    assert re.search(rf"done: .*, {syncs} syncs, ", printed), printed[-2000:]
    # One line per round, in order; one entry per round, in order, each once.
    assert [int(i) for i in SYNC_LINE.findall(printed)] == list(range(syncs)), printed
    assert [e["sync"] for e in entries(run)] == list(range(syncs))
    # The end's rounds: rows of their own at the last step, after its row and before the
    # final evaluation's, with the run's tokens and no loss; trackers get their values.
    rows = [r for r in read_metrics(run) if "event" not in r]
    last = max(i for i, r in enumerate(rows) if "loss" in r)
    own = [r for r in rows[last + 1:] if "sync" in r]
    # Non-blocking A-EDiT merges the budget's round at its launch, the last step
    # (docs/streaming.md 3b): its entry is that step's, and no round is left for the end.
    assert (not own) if case == "aedit" else own, own
    assert all(r["step"] == rows[last]["step"] == summary["steps"]
                       and r["tokens"] == summary["tokens"] and "loss" not in r
                       and r["train_time_s"] <= r["wall_time_s"] for r in own), own
    assert "val_loss" in rows[-1] and "sync" not in rows[-1]
    assert all(standard_metrics(r)["sync/index"] == r["sync"]["sync"] for r in own)
    if case == "streaming":  # a round launched at the last step, merged by the end
        assert any(r["sync"].get("launch_step") == rows[last]["step"] for r in own), own
    if case == "aedit":  # the benchmarks' per-replica steps count the last round's too
        bench = read_run("aedit", run, {})
        assert bench.sync_rows == own
        total = [sum(e["replica_steps"][r] for e in entries(run)) for r in (0, 1)]
        assert _replica_steps(bench) == total


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_resumed_run_neither_repeats_nor_loses_the_end_rounds(cache: Path,
                                                                tmp_path: Path) -> None:
    """A job that resumes an earlier checkpoint of a finished run computes the end's round
    again: its row is a replay (left out by the readers), so the round is there once. A
    job that extends the finished run from its final checkpoint (saved after the end's
    round) logs only the rounds after it."""
    run = tmp_path / "run"
    args = [*SHORT, *CASES["edit"], "--checkpoint.every", "4", "--quiet"]
    train(cache, run, *args)
    assert [e["sync"] for e in entries(run)] == [0, 1, 2]
    train(cache, run, *args, "--resume", str(run / "checkpoints" / "step_00000008"))
    raw = [r for r in read_metrics(run) if r.get("sync")]
    assert [(r["sync"]["sync"], bool(r.get("replayed"))) for r in raw] == [
        (0, False), (1, False), (2, False), (2, True)]
    assert [e["sync"] for e in entries(run)] == [0, 1, 2]
    train(cache, run, *args, "--resume", str(run), "--steps", "16")
    assert [e["sync"] for e in entries(run)] == [0, 1, 2, 3]
    assert json.loads((run / "summary.json").read_text())["num_syncs"] == 4
