"""A resumed job's rows up to the last step ``metrics.jsonl`` holds are told apart by what
each records (:func:`editrain.metrics.computation_of`), not by their step alone: a
computation the current history holds is a replay (``"replayed": true``), one it lacks,
which the earlier job died before writing, fills a gap (``"fills_gap": true``) and is
current where its step puts it.

Before, the trainer marked every row up to that step replayed: a job that died between
two rows of one step (a round's own row, then the step's row) or inside its end (the end's
rounds, then the final evaluation) left those rows in no current row once a resumed job
wrote them, and the run's history had no final evaluation.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from editrain.checkpoint import list_checkpoints
from editrain.metrics import (
    END,
    FILLS_GAP,
    JOB_START,
    ReplayMarks,
    computation_of,
    current_rows,
    read_metrics,
)


def _rows(*specs: tuple) -> list[dict]:
    """Rows of ``metrics.jsonl`` as the trainer writes them, unmarked: ``(step, round)``
    (a step's row with the round that ended there, or None), ``(step, round, "own")`` (a
    round's own row before its step's row), ``(step, round, "end")`` (a round the end
    completed), ``(step, "eval")`` (step 0's evaluation) and ``(step, "final")`` (the
    final evaluation)."""
    out = []
    for step, what, *kind in specs:
        row: dict = {"step": step}
        if what in ("eval", "final"):
            row["val_loss"] = 5.0
        else:
            if not kind:
                row["loss"] = 6.0
            if what is not None:
                row["sync"] = {"sync": what, "step": step}
        if what == "final" or kind == ["end"]:
            row[END] = True
        out.append(row)
    return out


def _resumed(earlier: list[dict], start: int, *specs: tuple) -> list[dict]:
    """A job resumed at ``start`` after the rows ``earlier``: its start event, then its rows
    marked as the trainer marks them (:class:`ReplayMarks` of the current history)."""
    marks = ReplayMarks(current_rows(earlier))
    rows = _rows(*specs)
    for row in rows:
        marks.mark(row)
    return [{"event": JOB_START, "step": start}, *rows]


def _summary(rows: list[dict]) -> tuple[list, list, list]:
    """The current rounds ``(step, index)``, evaluations' steps and steps with a loss."""
    current = current_rows(rows)
    return ([(r["step"], r["sync"]["sync"]) for r in current if r.get("sync")],
            [r["step"] for r in current if "val_loss" in r],
            [r["step"] for r in current if "loss" in r])


# The first 12 steps of a run: rounds end at steps 5 and 8, the end's round at 12 in a row
# of its own after step 12's, then the final evaluation.
STEPS = [(0, "eval"), *[(s, {5: 0, 8: 1}.get(s)) for s in range(1, 13)]]
END_ROWS = [(12, 2, "end"), (12, "final")]
RESUMED_FROM_8 = [*[(s, None) for s in range(9, 13)], *END_ROWS]


def test_a_steps_row_after_its_rounds_own_row_is_current_after_a_replay() -> None:
    """Two rounds end at step 5: round 0 in a row of its own, then step 5's row with round
    1; the first job dies between the two writes, the job resumed from step 4 writes both.
    Round 0's row is a replay; step 5's row fills the gap (before: marked replayed, so step
    5 had no loss and round 1 was in no current row)."""
    first = [{"event": JOB_START, "step": 0},
             *_rows((0, "eval"), *[(s, None) for s in range(1, 5)], (5, 0, "own"))]
    resumed = _resumed(first, 4, (5, 0, "own"), (5, 1), *[(s, None) for s in range(6, 9)])
    assert [(r["step"], bool(r.get("replayed")), bool(r.get(FILLS_GAP)))
            for r in resumed[1:4]] == [(5, True, False), (5, False, True), (6, False, False)]
    assert _summary(first + resumed) == ([(5, 0), (5, 1)], [0], list(range(1, 9)))
    # Round 0's row is the first job's (the replay is left out), before step 5's row.
    current = current_rows(first + resumed)
    assert current[5] is first[6] and current[6] is resumed[2]


@pytest.mark.parametrize("died_after", [
    # after step 12's row: the end's round and the final evaluation are the new job's
    STEPS,
    # after the end's round: the final evaluation is
    [*STEPS, (12, 2, "end")],
])
def test_a_job_that_died_inside_its_end_ends_with_the_new_final_evaluation(
        died_after: list[tuple]) -> None:
    """The first job dies inside its end; a job resumed from step 8 with the same steps
    replays steps 9-12 and writes its end. The history ends with one final evaluation, the
    new job's, after each round once (before: the new end's rows up to step 12 were all
    marked replayed, and the history had no final evaluation, nor round 2 where the first
    job died before writing it)."""
    first = [{"event": JOB_START, "step": 0}, *_rows(*died_after)]
    resumed = _resumed(first, 8, *RESUMED_FROM_8)
    rows = first + resumed
    assert _summary(rows) == ([(5, 0), (8, 1), (12, 2)], [0, 12], list(range(1, 13)))
    current = current_rows(rows)
    assert current[-1] is resumed[-1] and current[-1][FILLS_GAP] is True
    assert [r for r in current if r.get(END)][-1]["val_loss"] == 5.0


def test_an_end_the_earlier_job_wrote_whole_stays_its_own() -> None:
    """The first job wrote its whole end and died before its final checkpoint: the resumed
    job's end is the same computation again, every row of it a replay, and the history
    holds the end once."""
    first = [{"event": JOB_START, "step": 0}, *_rows(*STEPS, *END_ROWS)]
    resumed = _resumed(first, 8, *RESUMED_FROM_8)
    assert all(r.get("replayed") for r in resumed[1:])
    assert _summary(first + resumed) == ([(5, 0), (8, 1), (12, 2)], [0, 12],
                                         list(range(1, 13)))
    assert current_rows(first + resumed) == current_rows(first)


@pytest.mark.parametrize("later, rounds, evals", [
    # on from the final checkpoint the resumed job saved after its end: that end stays
    (lambda rows: _resumed(rows, 12, *[(s, None) for s in range(13, 17)], (16, 3, "end"),
                           (16, "final")),
     [(5, 0), (8, 1), (12, 2), (16, 3)], [0, 12, 16]),
    # on from step 8 with --steps 16: round 2 completes at step 13, the end at 12 is not
    # this history's (neither its replayed round nor its gap-filling evaluation)
    (lambda rows: _resumed(rows, 8, *[(s, {13: 2}.get(s)) for s in range(9, 17)],
                           (16, 3, "end"), (16, "final")),
     [(5, 0), (8, 1), (13, 2), (16, 3)], [0, 16]),
], ids=["from the final checkpoint", "from an earlier checkpoint"])
def test_a_filled_end_is_an_end_for_the_jobs_after_it(later, rounds: list, evals: list
                                                      ) -> None:
    """The end a resumed job completed (its round replayed, its final evaluation filling
    the gap) is the history's end for a later job: kept from its final checkpoint on,
    ended by a job that resumed before it and trains past it."""
    first = [{"event": JOB_START, "step": 0}, *_rows(*STEPS, (12, 2, "end"))]
    rows = first + _resumed(first, 8, *RESUMED_FROM_8)
    rows += later(rows)
    assert _summary(rows)[:2] == (rounds, evals)
    current = current_rows(rows)
    assert [r["step"] for r in current] == sorted(r["step"] for r in current)


def test_a_file_written_before_the_mark_reads_as_before() -> None:
    """Every row up to the last step logged marked replayed, as editrain wrote them
    before: the rows current are those of then (step 5's row of the resumed job lost)."""
    first = [{"event": JOB_START, "step": 0},
             *_rows((0, "eval"), *[(s, None) for s in range(1, 5)], (5, 0, "own"))]
    resumed = [{"event": JOB_START, "step": 4},
               *_rows((5, 0, "own"), (5, 1), *[(s, None) for s in range(6, 9)])]
    for row in resumed[1:3]:
        row["replayed"] = True
    assert _summary(first + resumed) == ([(5, 0)], [0], [1, 2, 3, 4, 6, 7, 8])


def test_the_computation_of_a_row() -> None:
    """A step's row is its step's whatever it carries; a round's own row its round's
    (with the end's mark or without: a run an older editrain wrote lacks it); an
    evaluation's row its step's; a hostile file's values are keys too."""
    step_row, own, end_round, final = _rows((5, 1), (5, 0, "own"), (12, 2, "end"),
                                            (12, "final"))
    assert computation_of(step_row) == computation_of({**step_row, "val_loss": 4.0})
    assert computation_of(own) != computation_of({**own, "sync": {"sync": 1}})
    assert computation_of(end_round) == computation_of(
        {k: v for k, v in end_round.items() if k != END})
    assert computation_of(final) == ("evaluation", 12, None)  # (_rows writes no val_tokens)
    assert computation_of({**final, "val_tokens": 2048}) == ("evaluation", 12, 2048)
    assert hash(computation_of({"step": [1], "sync": {"sync": {"a": [2]}}}))


def test_marks_leave_events_and_later_rows_alone() -> None:
    marks = ReplayMarks(current_rows(_rows((0, "eval"), (1, None), (2, None))))
    event, later = {"event": "checkpoint", "step": 2}, {"step": 3, "loss": 6.0}
    marks.mark(event)
    marks.mark(later)
    assert event == {"event": "checkpoint", "step": 2} and later == {"step": 3, "loss": 6.0}
    nothing = ReplayMarks([])
    row = {"step": 1, "loss": 6.0}
    nothing.mark(row)
    assert row == {"step": 1, "loss": 6.0}


def _evaluating(steps: range, evaluated: set[int], tokens: int = 1024) -> list[dict]:
    """Step rows as the trainer writes them, unmarked, those of the steps ``evaluated``
    carrying their evaluation (over ``tokens``)."""
    return [{"step": s, "loss": 6.0 - s / 100,
             **({"val_loss": 5.0 - s / 100, "val_tokens": tokens, "eval_time_s": 0.1}
                if s in evaluated else {})} for s in steps]


def _resumed_rows(earlier: list[dict], start: int, rows: list[dict]) -> list[dict]:
    """:func:`_resumed` of rows given whole: what the trainer writes for each (the rows
    :meth:`ReplayMarks.mark` returns)."""
    marks = ReplayMarks(current_rows(earlier))
    return [{"event": JOB_START, "step": start}, *[out for r in rows for out in marks.mark(r)]]


def _evaluations(rows: list[dict]) -> list[tuple]:
    return [(r["step"], r["val_loss"], r.get("val_tokens")) for r in current_rows(rows)
            if "val_loss" in r]


def test_a_resume_with_another_eval_every_keeps_every_evaluation() -> None:
    """The first job evaluated every 3 steps and died after step 11; the job resumed from
    step 8 evaluates every 2 (its first at 9, the checkpoint's next: an older editrain's
    schedule, whose rows a resume still reads; now the first is at 10), replaying
    steps 9-11. Its evaluation at 11 rode in a replayed step's row: it was in no current
    row. Now the step's row is a replay without it and the evaluation a row of its own
    that fills the gap; every evaluation the first job wrote stays current, and a later
    job resumed the same way replays it instead of writing it again."""
    first = [{"event": JOB_START, "step": 0}, {"step": 0, "val_loss": 5.0, "val_tokens": 1024},
             *_evaluating(range(1, 12), {3, 6, 9})]
    # its first evaluation at 9 (the checkpoint's next, as an older editrain did), then
    # every 2 steps
    resumed_rows = _evaluating(range(9, 13), {9, 11})
    resumed = _resumed_rows(first, 8, resumed_rows)
    marks = [(r["step"], "loss" in r, "val_loss" in r, r.get("replayed"), r.get(FILLS_GAP))
             for r in resumed[1:]]
    assert marks == [(9, True, True, True, None), (10, True, False, True, None),
                     (11, True, False, True, None), (11, False, True, None, True),
                     (12, True, False, None, None)]
    rows = first + resumed
    evaluations = _evaluations(rows)
    assert [e[0] for e in evaluations] == [0, 3, 6, 9, 11]
    assert evaluations[4] == (11, resumed_rows[2]["val_loss"], 1024)
    assert all(r in current_rows(rows) for r in first[1:])  # nothing the first job wrote lost
    assert [r["step"] for r in current_rows(rows) if "loss" in r] == list(range(1, 13))
    again = _resumed_rows(rows, 8, [dict(r) for r in resumed_rows])
    assert len(again) == 5 and all(r.get("replayed") for r in again[1:])  # 9-12, whole
    assert _evaluations(rows + again) == evaluations


def test_an_evaluation_an_older_editrain_wrote_without_its_tokens_is_replayed() -> None:
    """A run an editrain before val_tokens wrote (its evaluations say no token count) is
    resumed from step 8 with the same train.eval_every: the replayed step 9 carries the
    same evaluation, now with its tokens. It is a replay, whole, not a second evaluation
    at step 9 in a row of its own."""
    older = [{k: v for k, v in r.items() if k != "val_tokens"}
             for r in _evaluating(range(1, 12), {3, 6, 9})]
    first = [{"event": JOB_START, "step": 0}, {"step": 0, "val_loss": 5.0}, *older]
    resumed = _resumed_rows(first, 8, _evaluating(range(9, 13), {9, 12}))
    assert [(r["step"], r.get("replayed"), r.get(FILLS_GAP)) for r in resumed[1:]] == [
        (9, True, None), (10, True, None), (11, True, None), (12, None, None)]
    assert [e[0] for e in _evaluations(first + resumed)] == [0, 3, 6, 9, 12]


def test_a_periodic_evaluation_is_not_the_final_one_over_other_tokens() -> None:
    """The first job's end evaluated step 12 over train.final_eval_tokens; a job resumed
    from step 8 with more steps evaluates step 12 periodically, over train.eval_tokens:
    another computation, kept (the earlier end is not this history's), where the replay
    of step 12 carried it out of every current row."""
    first = [{"event": JOB_START, "step": 0}, *_evaluating(range(1, 13), {4, 8}),
             {"step": 12, "val_loss": 4.0, "val_tokens": 2048, END: True}]
    resumed = _resumed_rows(first, 8, _evaluating(range(9, 17), {12, 16}))
    assert _evaluations(first + resumed) == [(4, 4.96, 1024), (8, 4.92, 1024),
                                             (12, 4.88, 1024), (16, 4.84, 1024)]


# ------------------------------------------------------------------ real runs
# 12 steps with the end's rounds after the last step's row (tests/test_sync_rows.py) and
# a checkpoint every 4 steps: the job that dies in its end has step 8's to resume.
RUN = ["--nproc", "2", "--shard-size", "1", "--steps", "12", "--train.eval_every", "4",
       "--train.final_eval_tokens", "2048", "--checkpoint.every", "4",
       "--method", "edit", "--sync.local_sgd_sync_interval", "4"]
DEATHS = {
    # after step 12's row (the last with a loss), before the end's round (armed at step
    # 12) and evaluation
    "edit": ([], lambda rows: max(i for i, r in enumerate(rows) if "loss" in r)),
    # the end completes three rounds of two fragments: after the first of them
    "streaming": (["--sync.fragments", "2", "--sync.overlap_steps", "2"],
                  lambda rows: min(i for i, r in enumerate(rows) if r.get(END) is True)),
}


@pytest.fixture(scope="module")
def cache(data_cache) -> Path:
    return data_cache


def _died_in_its_end(run: Path, to: Path, last_row) -> None:
    """``to``: ``run`` as a job that died in its end leaves it: ``metrics.jsonl`` up to
    the row ``last_row`` picks of its rows, neither the final checkpoint nor the summary."""
    shutil.copytree(run, to)
    lines = (to / "metrics.jsonl").read_text().splitlines(keepends=True)
    last = last_row([json.loads(line) for line in lines])
    assert "loss" in json.loads(lines[last]) or json.loads(lines[last]).get("sync")
    (to / "metrics.jsonl").write_text("".join(lines[:last + 1]))
    final = list_checkpoints(to)[-1]
    assert final.name.endswith("12"), final
    shutil.rmtree(final)
    (to / "summary.json").unlink()


def _record(rows: list[dict]) -> list[tuple]:
    """What each current row computed and its values (an exact resume: bitwise)."""
    return [(computation_of(r), r.get("loss"), r.get("val_loss"),
             (r.get("sync") or {}).get("sync"), r.get(END)) for r in current_rows(rows)]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(DEATHS))
def test_a_run_resumed_after_dying_in_its_end_has_the_uninterrupted_history(
        case: str, cache: Path, tmp_path: Path) -> None:
    """A run killed inside its end (simulated: the file and checkpoints it leaves), then
    resumed with the same steps from step 8, has the uninterrupted run's history: every
    round once and one final evaluation, the resumed job's. Before, the end's rows it
    wrote were all marked replayed, the history ended without a final evaluation (and
    without the end's rounds the first job had not written)."""
    from tests.test_checkpoint import train

    extra, last_row = DEATHS[case]
    whole, died = tmp_path / "whole", tmp_path / "died"
    train(cache, whole, *RUN, *extra)
    _died_in_its_end(whole, died, last_row)
    train(cache, died, *RUN, *extra, "--resume", str(died))
    rows = read_metrics(died)
    assert _record(rows) == _record(read_metrics(whole))
    finals = [r for r in current_rows(rows) if r.get(END) and "val_loss" in r]
    assert len(finals) == 1 and finals[0].get(FILLS_GAP) is True
    assert finals[0]["val_loss"] == json.loads((died / "summary.json").read_text())[
        "final_val_loss"]


def test_rows_whose_step_is_no_number_are_no_measurements(tmp_path) -> None:
    """A hostile or damaged metrics.jsonl may hold a row whose step is text, a list, a
    bool or null, a row marked to fill a gap among them. current_rows leaves them out (a
    measurement row has a step number), so that the history a resumed job replays
    (ReplayMarks) and every reader (editrain plot, summary, bench, plan --calibrate) reads
    the rest. Before, comparing their steps raised TypeError: `editrain plot` ended in a
    traceback, and so would the resumed trainer reading its history."""
    import subprocess
    import sys

    good = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    hostile = [{"step": "x", "loss": 1.0}, {"step": [3], "loss": 1.0},
               {"step": None, "loss": 1.0}, {"step": True, "loss": 1.0},
               {"step": float("nan"), "loss": 1.0}, {"step": "y", FILLS_GAP: True},
               {"step": {"a": 1}, FILLS_GAP: True}]
    rows = [good[0], *hostile, good[1]]
    assert current_rows(rows) == good
    assert ReplayMarks(current_rows(rows)).until == 2

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = subprocess.run([sys.executable, "-m", "editrain", "plot", str(run)],
                          capture_output=True, text=True, timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_resumed_with_another_eval_every_keeps_both_jobs_evaluations(
        cache: Path, tmp_path: Path) -> None:
    """A run evaluating every 3 steps and saving every 4 dies after step 12 (sim.fail),
    before its end; resumed from its step-8 checkpoint with train.eval_every 2 and
    checkpoint.every 3, the new job evaluates and saves where a run with those options
    does after step 8: evaluations at 10, a step the first job did not evaluate, and 12
    (the end's), a checkpoint at 9. Before, that evaluation rode in step 10's replayed row,
    in no current row; and the job kept the old schedule's next ones (evaluations at 9 and
    11, no checkpoint before the end's)."""
    from tests.test_checkpoint import train

    run = tmp_path / "run"
    args = ["--nproc", "2", "--shard-size", "1", "--steps", "12", "--method", "sync"]
    out = train(cache, run, *args, "--train.eval_every", "3", "--checkpoint.every", "4",
                "--sim.fail", "0@12", check=False)
    assert out.returncode != 0
    first = [r for r in read_metrics(run) if "event" not in r]
    assert [r["step"] for r in first if "val_loss" in r] == [0, 3, 6, 9]
    train(cache, run, *args, "--train.eval_every", "2", "--checkpoint.every", "3",
          "--resume", str(run))
    rows = read_metrics(run)
    current = current_rows(rows)
    assert [r["step"] for r in current if "val_loss" in r] == [0, 3, 6, 9, 10, 12]
    job = rows[max(i for i, r in enumerate(rows) if r.get("event") == JOB_START):]
    assert [r["step"] for r in job if r.get("event") == "checkpoint"] == [9, 12]
    assert all(r in current for r in first)  # nothing the first job wrote is lost
    assert [r["step"] for r in current if "loss" in r] == list(range(1, 13))
