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


def _job(start: int, *rows: tuple, replay_until: int = -1) -> list[dict]:
    """One job's rows of ``metrics.jsonl``: its start event, then ``(step, round)`` (a step
    row, with the round that ended there or None), ``(step, round, "end")`` (a round's own
    row, without a loss) or ``(step, "eval")`` (an evaluation's row); rows up to
    ``replay_until`` are marked replayed, as the trainer marks them."""
    out: list[dict] = [{"event": "job_start", "step": start}]
    for step, what, *own in rows:
        row: dict = {"step": step}
        if what == "eval":
            row["val_loss"] = 5.0
        else:
            row.update({} if own else {"loss": 6.0})
            if what is not None:
                row["sync"] = {"sync": what, "step": step}
        if step <= replay_until:
            row["replayed"] = True
        out.append(row)
    return out


# A finished 12-step run: rounds ending at steps 5 and 8, the end's round at 12, in a row of
# its own after step 12's, and the final evaluation.
FINISHED = _job(0, (0, "eval"), *[(s, {5: 0, 8: 1}.get(s)) for s in range(1, 13)],
                (12, 2, "end"), (12, "eval"))


@pytest.mark.parametrize("name, later, rounds, evals", [
    # the same --steps from step 8: steps 9-12 and the end computed again (replays)
    ("exact resume", _job(8, *[(s, None) for s in range(9, 13)], (12, 2, "end"),
                          (12, "eval"), replay_until=12),
     [(5, 0), (8, 1), (12, 2)], [0, 12]),
    # on from the final checkpoint (saved after the end's round): it stays
    ("extension from the final checkpoint",
     _job(12, *[(s, None) for s in range(13, 17)], (16, 3, "end"), (16, "eval")),
     [(5, 0), (8, 1), (12, 2), (16, 3)], [0, 12, 16]),
    # on from step 8: round 2 completes at step 13, and the old end is not this history's
    ("extension from an earlier checkpoint",
     _job(8, *[(s, {13: 2}.get(s)) for s in range(9, 17)], (16, 3, "end"), (16, "eval"),
          replay_until=12),
     [(5, 0), (8, 1), (13, 2), (16, 3)], [0, 16]),
    # ... whose first job stopped in step 13, after saving step 12 while replaying: its
    # restart resumes that checkpoint, still not the old end's
    ("extension restarted after its own checkpoint",
     _job(8, *[(s, None) for s in range(9, 13)], replay_until=12)
     + _job(12, *[(s, {13: 2}.get(s)) for s in range(13, 17)], (16, 3, "end")),
     [(5, 0), (8, 1), (13, 2), (16, 3)], [0]),
    # the same --steps from step 8 (to its own final checkpoint, after the same end), then
    # on from there: that end is in the checkpoint
    ("exact resume, then extension from its final checkpoint",
     _job(8, *[(s, None) for s in range(9, 13)], (12, 2, "end"), (12, "eval"),
          replay_until=12)
     + _job(12, *[(s, None) for s in range(13, 17)], (16, 3, "end")),
     [(5, 0), (8, 1), (12, 2), (16, 3)], [0, 12]),
    # elastic from step 8: other replicas, rounds of their own from step 9
    ("elastic resume", _job(8) + [{"event": "elastic_resume", "step": 8, "val_loss": 5.0}]
     + _job(8, *[(s, {12: 2}.get(s)) for s in range(9, 13)], (12, "eval"))[1:],
     [(5, 0), (8, 1), (12, 2)], [0, 12]),
    # A-EDiT on the wall clock from step 11: no replays, and its first row is at step 12,
    # the step where the old rows end (its last round merged there, in the step's row)
    ("A-EDiT without replays", _job(11, (12, 2), (13, None), (14, 3), (14, "eval")),
     [(5, 0), (8, 1), (12, 2), (14, 3)], [0, 14]),
])
def test_each_round_is_current_once_in_every_resume_pattern(name: str, later: list[dict],
                                                            rounds: list, evals: list
                                                            ) -> None:
    """``current_rows`` (what every reader of the sync entries reads) holds each round
    once after a resume. A job that resumed before the end of the history and trains past
    it ends the earlier job's end rows: before, a job resumed from an earlier checkpoint
    with a larger --steps kept the old end row of round 2 beside its own (step 13), and
    a wall-clock A-EDiT job whose first row was at the old last step kept both rows."""
    current = current_rows(FINISHED + later)
    assert [(r["step"], r["sync"]["sync"]) for r in current if r.get("sync")] == rounds, name
    assert [r["step"] for r in current if "val_loss" in r] == evals, name
    # one history, in step order
    assert [r["step"] for r in current] == sorted(r["step"] for r in current), name


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


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_job_that_trains_past_the_end_round_of_an_earlier_checkpoint_logs_it_once(
        cache: Path, tmp_path: Path) -> None:
    """A finished 12-step run resumed from its step-8 checkpoint with a larger --steps: the
    new job computes steps 9-12 again (replays), but does not end there: the round armed at
    step 12, which the first job's end completed in a row of its own at step 12, it
    completes in step 13's forward. Before, the old end row stayed current beside the new
    step-13 row (entries [0, 1, 2, 2, 3] where summary.json said 4 syncs); the new job's
    start now supersedes the old job's end rows (``metrics.current_rows``)."""
    run = tmp_path / "run"
    args = [*SHORT, *CASES["edit"], "--checkpoint.every", "8", "--train.eval_every", "8",
            "--quiet"]
    train(cache, run, *args)
    assert [e["sync"] for e in entries(run)] == [0, 1, 2]
    train(cache, run, *args, "--resume", str(run / "checkpoints" / "step_00000008"),
          "--steps", "16")
    current = current_rows(read_metrics(run))
    got = [(r["step"], r["sync"]["sync"]) for r in current if r.get("sync")]
    assert got == [(5, 0), (8, 1), (13, 2), (16, 3)]
    assert json.loads((run / "summary.json").read_text())["num_syncs"] == len(got)
    # The first job's final evaluation (of its end, after round 2) is not this history's.
    assert [r["step"] for r in current if "val_loss" in r] == [0, 8, 16]


def test_the_benchmarks_read_the_rounds_of_one_step_in_their_order(tmp_path: Path) -> None:
    """Rounds that end at one step: all but the last in rows of their own before the
    step's row, which carries the last; the end's after it. ``Run.sync_entries`` (the
    stragglers' per-replica steps, the spikes' outlier counts) gives them in the order
    they ended; before, a sort by step alone put the step row's round before the earlier
    rounds of its step ([2, 5, 3, 4, 6, 7])."""
    from editrain.bench.runs import Run

    def own(step: int, index: int) -> dict:
        return {"step": step, "sync": {"sync": index, "step": step}}

    rows = [{"step": 8, "loss": 6.0, "sync": {"sync": 2, "step": 8}},
            {"step": 12, "loss": 5.0, "sync": {"sync": 5, "step": 12}}]
    run = Run("streaming", tmp_path, {}, rows=rows,
              sync_rows=[own(12, 3), own(12, 4), own(12, 6), own(12, 7)])
    assert [s["sync"] for s in run.sync_entries()] == [2, 3, 4, 5, 6, 7]
