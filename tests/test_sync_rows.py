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
from editrain.metrics import END, current_rows, read_metrics
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
    row, with the round that ended there or None), ``(step, round, "own")`` (a round's own
    row before its step's row, without a loss), ``(step, round, "end")`` (a round the end
    completed: its own row, marked ``"end": true``), ``(step, "eval")`` (an evaluation's
    row without a loss, such as step 0's) or ``(step, "final")`` (the final evaluation's,
    marked ``"end": true``); rows up to ``replay_until`` are marked replayed, as the
    trainer marks them where the history holds each of them (one it lacks is marked
    ``"fills_gap"`` now: tests/test_metrics_replay.py)."""
    out: list[dict] = [{"event": "job_start", "step": start}]
    for step, what, *own in rows:
        row: dict = {"step": step}
        if what in ("eval", "final"):
            row["val_loss"] = 5.0
        else:
            row.update({} if own else {"loss": 6.0})
            if what is not None:
                row["sync"] = {"sync": what, "step": step}
        if what == "final" or own == ["end"]:
            row[END] = True
        if step <= replay_until:
            row["replayed"] = True
        out.append(row)
    return out


def _unmarked(rows: list[dict]) -> list[dict]:
    """``rows`` as editrain wrote them before the end's rows were marked (no ``end``)."""
    return [{k: v for k, v in r.items() if k != END} for r in rows]


# A finished 12-step run: rounds ending at steps 5 and 8, the end's round at 12, in a row of
# its own after step 12's, and the final evaluation.
FINISHED = _job(0, (0, "eval"), *[(s, {5: 0, 8: 1}.get(s)) for s in range(1, 13)],
                (12, 2, "end"), (12, "final"))


@pytest.mark.parametrize("name, later, rounds, evals", [
    # the same --steps from step 8: steps 9-12 and the end computed again (replays)
    ("exact resume", _job(8, *[(s, None) for s in range(9, 13)], (12, 2, "end"),
                          (12, "final"), replay_until=12),
     [(5, 0), (8, 1), (12, 2)], [0, 12]),
    # on from the final checkpoint (saved after the end's round): it stays
    ("extension from the final checkpoint",
     _job(12, *[(s, None) for s in range(13, 17)], (16, 3, "end"), (16, "final")),
     [(5, 0), (8, 1), (12, 2), (16, 3)], [0, 12, 16]),
    # on from step 8: round 2 completes at step 13, and the old end is not this history's
    ("extension from an earlier checkpoint",
     _job(8, *[(s, {13: 2}.get(s)) for s in range(9, 17)], (16, 3, "end"), (16, "final"),
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
     _job(8, *[(s, None) for s in range(9, 13)], (12, 2, "end"), (12, "final"),
          replay_until=12)
     + _job(12, *[(s, None) for s in range(13, 17)], (16, 3, "end")),
     [(5, 0), (8, 1), (12, 2), (16, 3)], [0, 12]),
    # elastic from step 8: other replicas, rounds of their own from step 9
    ("elastic resume", _job(8) + [{"event": "elastic_resume", "step": 8, "val_loss": 5.0}]
     + _job(8, *[(s, {12: 2}.get(s)) for s in range(9, 13)], (12, "final"))[1:],
     [(5, 0), (8, 1), (12, 2)], [0, 12]),
    # A-EDiT on the wall clock from step 11: no replays, and its first row is at step 12,
    # the step where the old rows end (its last round merged there, in the step's row)
    ("A-EDiT without replays", _job(11, (12, 2), (13, None), (14, 3), (14, "final")),
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


def _current(rows: list[dict]) -> tuple[list, list, list]:
    """``current_rows(rows)``: the rounds ``(step, index)``, the evaluations' steps and the
    steps with a training loss."""
    current = current_rows(rows)
    return ([(r["step"], r["sync"]["sync"]) for r in current if r.get("sync")],
            [r["step"] for r in current if "val_loss" in r],
            [r["step"] for r in current if "loss" in r])


def test_a_job_that_died_after_a_row_without_a_loss_keeps_it_through_a_replay() -> None:
    """Evaluations every 6 steps, checkpoints every 4: the first job logs an evaluation's
    row at step 6 and dies in step 7; the job resumed from step 4 computes steps 5 and 6
    and that evaluation again (replays) and trains on. The first job's evaluation at step
    6 is the current one (the new job's copy is a replay). Before, every row after the
    last loss was taken for the end of the history and dropped at the new job's first
    row of its own: the evaluations were [0, 12], the one at step 6 in neither copy.
    Only rows the end writes (marked ``"end": true``) are the end now."""
    first = _job(0, (0, "eval"), *[(s, {5: 0}.get(s)) for s in range(1, 7)], (6, "eval"))
    resumed = _job(4, (5, 0), (6, None), (6, "eval"),
                   *[(s, {8: 1}.get(s)) for s in range(7, 13)], (12, 2, "end"),
                   (12, "final"), replay_until=6)
    assert _current(first + resumed) == ([(5, 0), (8, 1), (12, 2)], [0, 6, 12],
                                         list(range(1, 13)))


def test_a_job_that_died_between_a_rounds_own_row_and_its_steps_keeps_the_round() -> None:
    """Two rounds end at step 5: round 0 in a row of its own, written before step 5's row
    (which carries round 1); the first job dies between the two writes. The job resumed
    from step 4 logs round 0's row again (a replay). Before, the first job's row, the last
    one without a loss, was dropped as the end of the history, and round 0 was in no
    current row; it is no end's row (unmarked), so it stays."""
    first = _job(0, (0, "eval"), *[(s, None) for s in range(1, 5)], (5, 0, "own"))
    resumed = _job(4, (5, 0, "own"), (5, 1), *[(s, None) for s in range(6, 9)],
                   replay_until=5)
    rounds, evals, _ = _current(first + resumed)
    # (Step 5's row, with round 1, is the resumed job's alone, but marked replayed here,
    # as the trainer marked every row up to the last step the file holds before it marked
    # such a row "fills_gap" instead: tests/test_metrics_replay.py. Not this rule's matter.)
    assert [r for r in rounds if r[1] == 0] == [(5, 0)]
    assert evals == [0]


def test_a_restart_after_replaying_an_evaluation_at_the_old_last_step_drops_the_old_end(
        ) -> None:
    """A finished 12-step run (rounds at steps 5 and 8, round 2 completed by its end at
    step 12, the final evaluation); a job resumed from step 8 with --steps 16 replays
    steps 9-12 and an evaluation's row at step 12, saves step 12 and dies in step 13
    (round 2 still in flight); torchrun restarts it from that checkpoint and round 2
    completes at step 13. The two jobs are one history from step 8, which the old end is
    not part of. Before, the replayed evaluation's row (no loss) was taken for the replayed
    end, the restart was read as a history on its own from step 12, and round 2 was
    current twice: [(5, 0), (8, 1), (12, 2), (13, 2), (16, 3)]."""
    extension = _job(8, *[(s, None) for s in range(9, 13)], (12, "eval"), replay_until=12)
    restart = _job(12, *[(s, {13: 2}.get(s)) for s in range(13, 17)], (16, 3, "end"),
                   (16, "final"))
    assert _current(FINISHED + extension + restart) == (
        [(5, 0), (8, 1), (13, 2), (16, 3)], [0, 16], list(range(1, 17)))


def _current_before_the_end_rule(rows: list[dict]) -> list[dict]:
    """What ``current_rows`` kept before a later job superseded the end rows (0b86403):
    replays and events out, and a step that goes back ends the rows from it on."""
    kept: list[dict] = []
    for row in rows:
        if row.get("event") == "elastic_resume":
            kept = [r for r in kept if r["step"] <= row["step"]]
            continue
        if "event" in row or row.get("replayed"):
            continue
        if kept and row["step"] < kept[-1]["step"]:
            kept = [r for r in kept if r["step"] < row["step"]]
        kept.append(row)
    return kept


@pytest.mark.parametrize("later, rounds, evals", [
    # extension from an earlier checkpoint: the old end stays beside the new round 2
    (_job(8, *[(s, {13: 2}.get(s)) for s in range(9, 17)], (16, 3, "end"), (16, "final"),
          replay_until=12),
     [(5, 0), (8, 1), (12, 2), (13, 2), (16, 3)], [0, 12, 16]),
    # ... restarted after its own checkpoint, having replayed an evaluation at step 12
    (_job(8, *[(s, None) for s in range(9, 13)], (12, "eval"), replay_until=12)
     + _job(12, *[(s, {13: 2}.get(s)) for s in range(13, 17)], (16, 3, "end")),
     [(5, 0), (8, 1), (12, 2), (13, 2), (16, 3)], [0, 12]),
    # exact resume, then extension from its final checkpoint
    (_job(8, *[(s, None) for s in range(9, 13)], (12, 2, "end"), (12, "final"),
          replay_until=12) + _job(12, *[(s, None) for s in range(13, 17)], (16, 3, "end")),
     [(5, 0), (8, 1), (12, 2), (16, 3)], [0, 12]),
], ids=["extension", "restart", "exact then extension"])
def test_rows_written_before_the_end_mark_are_read_as_before(later: list[dict], rounds: list,
                                                             evals: list) -> None:
    """A run written before the end's rows were marked: nothing tells its end rows from
    other rows without a loss, so a later job drops none of them; the rows current are
    exactly those the rule before 0b86403 kept (round 2 twice where a job resumed before
    the old end and trained past it, as then)."""
    rows = _unmarked(FINISHED + later)
    assert current_rows(rows) == _current_before_the_end_rule(rows)
    assert _current(rows)[:2] == (rounds, evals)


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
    # The end's rows (its rounds, the final evaluation) are marked, and only they: readers
    # tell the end of a history by the mark (editrain.metrics.current_rows).
    assert [i for i, r in enumerate(rows) if r.get(END)] == list(range(last + 1, len(rows)))
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
