"""The trainer's loop state as one object (issue 52 item 6): what it saves is exactly what a
rank's JSON held before it existed, it loads back as one (checked against the checkpoint's
schema), and its schedule helpers are the loop's arithmetic."""

from __future__ import annotations

import math
import time

import pytest

from editrain.checkpoint import RANK_STATE_SCHEMA
from editrain.errors import CheckpointError
from editrain.loop_state import (
    LOOP_STATE_SCHEMA,
    SAVED,
    LoopState,
    first_due_after,
    next_after,
)
from editrain.metrics import ReplayMarks


def _state(**changes) -> LoopState:
    loop = LoopState(next_eval=30, next_ckpt=40, step=27, last_eval=20, finished=True,
                     wall_offset=12.5, off_train_s=3.25, steps_run=7, val_tokens=4096,
                     healed_at=None, replays=ReplayMarks([{"step": 25, "loss": 5.0}]),
                     elastic=False)
    for k, v in changes.items():
        setattr(loop, k, v)
    return loop


def test_saved_keys_are_the_rank_json_keys_of_before_in_order():
    """The format on disk is unchanged: the keys and values the trainer wrote field by
    field (step, next_eval, next_ckpt, last_eval, finished, wall_time_s, off_train_s)."""
    loop = _state()
    t0 = time.perf_counter()
    d = loop.to_dict()
    elapsed = time.perf_counter() - loop.wall_start
    assert list(d) == list(SAVED) == ["step", "next_eval", "next_ckpt", "last_eval",
                                      "finished", "wall_time_s", "off_train_s"]
    assert {k: d[k] for k in SAVED if k != "wall_time_s"} == {
        "step": 27, "next_eval": 30, "next_ckpt": 40, "last_eval": 20, "finished": True,
        "off_train_s": 3.25}
    # The wall clock: the resumed offset plus this process's clock, read once.
    assert 12.5 + (t0 - loop.wall_start) <= d["wall_time_s"] <= 12.5 + elapsed
    # Every saved key is checked by the checkpoint's schema, with the same rules.
    assert set(SAVED) <= set(RANK_STATE_SCHEMA.fields)
    for k in SAVED:
        assert LOOP_STATE_SCHEMA.fields[k] is RANK_STATE_SCHEMA.fields[k]
    assert set(LOOP_STATE_SCHEMA.required) == set(SAVED) - {"off_train_s"}


def test_from_dict_restores_the_saved_part_and_starts_a_new_clock():
    saved = _state().to_dict()
    saved.update(data={"epoch": 0}, rng={}, sim_rng=[])  # the rest of a rank's JSON
    before = time.perf_counter()
    back = LoopState.from_dict(saved, "rank_00000.json")
    assert (back.step, back.next_eval, back.next_ckpt, back.last_eval, back.finished,
            back.off_train_s) == (27, 30, 40, 20, True, 3.25)
    assert back.wall_offset == saved["wall_time_s"]  # exactly: the resumed clock's offset
    assert back.wall_start >= before
    # This process's own fields start afresh.
    assert (back.steps_run, back.val_tokens, back.healed_at, back.replays,
            back.resumed_from, back.elastic) == (0, 0, None, None, None, False)
    # Saved again at once: the same values (the clock only moved on).
    again = back.to_dict()
    assert {k: again[k] for k in SAVED if k != "wall_time_s"} == \
        {k: saved[k] for k in SAVED if k != "wall_time_s"}
    assert again["wall_time_s"] >= saved["wall_time_s"]


def test_a_checkpoint_from_before_off_train_s_resumes_with_zero():
    saved = _state().to_dict()
    del saved["off_train_s"]
    assert LoopState.from_dict(saved).off_train_s == 0.0


@pytest.mark.parametrize("field,value,why", [
    ("step", -1, "an integer from 0 to 9007199254740992 is expected (found -1)"),
    ("step", True, "an integer from 0 to 9007199254740992 is expected (found true)"),
    ("next_eval", 1.5, "an integer from 0 to 9007199254740992 is expected (found 1.5)"),
    ("last_eval", "3", "an integer from 0 to 9007199254740992 is expected (found \"3\")"),
    ("finished", 1, "true or false is expected (found 1)"),
    ("wall_time_s", math.inf, "a finite number from 0 to 1e+12 is expected (found 1e+400)"),
    ("off_train_s", -0.5, "a finite number from 0 to 1e+12 is expected (found -0.5)"),
])
def test_from_dict_refuses_a_bad_field_in_one_line(field, value, why):
    saved = _state().to_dict()
    saved[field] = value
    with pytest.raises(CheckpointError) as e:
        LoopState.from_dict(saved, "ckpt/rank_00003.json")
    assert str(e.value) == f"ckpt/rank_00003.json: field {field!r}: {why}"


@pytest.mark.parametrize("field", [k for k in SAVED if k != "off_train_s"])
def test_from_dict_refuses_a_missing_field(field):
    saved = _state().to_dict()
    del saved[field]
    with pytest.raises(CheckpointError, match=rf"^r\.json: field '{field}' is missing$"):
        LoopState.from_dict(saved, "r.json")


def test_skip_due_is_next_after_for_both_schedules():
    loop = _state(next_eval=10, next_ckpt=8)
    loop.skip_due(25.5, eval_every=10, ckpt_every=4)
    assert (loop.next_eval, loop.next_ckpt) == (30, 28)
    assert (next_after(10, 25.5, 10), next_after(8, 25.5, 4)) == (30, 28)
    loop.skip_due(25.5, eval_every=0, ckpt_every=0)  # never (every 0): unchanged
    assert (loop.next_eval, loop.next_ckpt) == (30, 28)


def _taken(loop: LoopState, points: list[float], eval_every: int, ckpt_every: int
           ) -> tuple[list[float], list[float]]:
    """The sync points at which the trainer's loop takes an evaluation and a checkpoint
    (its rule: due at or before the point, then advanced past it by its interval)."""
    evals, ckpts = [], []
    for point in points:
        if point >= loop.next_eval:
            evals.append(point)
            loop.next_eval = next_after(loop.next_eval, point, eval_every)
        if ckpt_every and point >= loop.next_ckpt:
            ckpts.append(point)
            loop.next_ckpt = next_after(loop.next_ckpt, point, ckpt_every)
    return evals, ckpts


SYNC_POINTS = {
    "every step (sync)": [float(p) for p in range(1, 41)],
    "every 4 steps (local SGD)": [float(p) for p in range(4, 41, 4)],
    "every 2.5 steps (A-EDiT, 2 replicas)": [2.5 * k for k in range(1, 17)],
}


@pytest.mark.parametrize("points", SYNC_POINTS.values(), ids=SYNC_POINTS)
@pytest.mark.parametrize("old,new", [((3, 4), (2, 6)), ((2, 6), (3, 4)), ((5, 8), (5, 3)),
                                     ((4, 0), (7, 5)), ((3, 4), (3, 4)), ((3, 8), (3, 8))])
def test_a_resume_takes_what_a_new_run_with_its_intervals_takes_after_the_checkpoint(
        points, old, new):
    """A run saved at a checkpoint (its schedule advanced with ``old`` intervals, as the
    loop does) and resumed with ``new`` ones evaluates and saves where a run with the new
    ones from the start does after that point. Before, the saved schedule was only moved
    past the checkpoint: eval_every 3 resumed at 8 with 2 evaluated at 9, 11, ... (a new
    run: 10, 12, ...); checkpoint.every 4 -> 6 saved at 12, 16, ... (a new run: 12, 18)."""
    at = points[len(points) // 2 - 1]  # the checkpoint, at a sync point
    saved = LoopState(next_eval=old[0], next_ckpt=old[1])
    _taken(saved, [p for p in points if p <= at], *old)
    resumed = LoopState.from_dict({**saved.to_dict(), "step": int(at)})
    resumed.reschedule(at, *new)
    fresh = _taken(LoopState(next_eval=new[0], next_ckpt=new[1]), points, *new)
    after = _taken(resumed, [p for p in points if p > at], *new)
    assert after == tuple([p for p in each if p > at] for each in fresh)


@pytest.mark.parametrize("points", SYNC_POINTS.values(), ids=SYNC_POINTS)
@pytest.mark.parametrize("every", [(3, 4), (1, 1), (4, 0), (7, 10)])
@pytest.mark.parametrize("final", [False, True])
def test_with_the_same_intervals_a_resume_keeps_the_saved_schedule(points, every, final):
    """An exact resume with unchanged options goes on as the run that never stopped: the
    rescheduled next evaluation and checkpoint are the saved ones moved past the
    checkpoint (what a resume did before), at every sync point, the final save's too (its
    last ones not taken, ``final``)."""
    for at in points[:-1]:
        saved = LoopState(next_eval=every[0], next_ckpt=every[1])
        _taken(saved, [p for p in points if p < at or (p == at and not final)], *every)
        moved = LoopState(next_eval=saved.next_eval, next_ckpt=saved.next_ckpt)
        moved.skip_due(at, *every)
        saved.reschedule(at, *every)
        assert (saved.next_eval, saved.next_ckpt) == (moved.next_eval, moved.next_ckpt), at


def test_first_due_after_is_the_next_multiple_of_the_interval():
    assert [first_due_after(p, 4) for p in (0, 3.5, 4, 7.5, 8, 8.0001)] == [4, 4, 8, 8, 12, 12]
    assert first_due_after(12.5, 0) == 0  # never due (checkpoint.every 0: a new run's 0)


def test_a_healed_replica_adopts_its_peers_schedule_and_step():
    peer = _state(next_eval=60, next_ckpt=80, last_eval=50, step=55)
    peer.tokens_base, peer.progress_base = 40_960, 40.0  # a resume at another batch
    sent = peer.heal_state(step=52)  # the engine's global step, not the replica's own
    assert sent == {"step": 52, "next_eval": 60, "next_ckpt": 80, "last_eval": 50,
                    "tokens_base": 40_960, "progress_base": 40.0}
    joining = LoopState(next_eval=10, next_ckpt=20)
    joining.adopt(sent)
    assert (joining.step, joining.next_eval, joining.next_ckpt, joining.last_eval,
            joining.healed_at) == (52, 60, 80, 50, 52)
    # the peers' token count: a healed group counts tokens as they do
    assert (joining.tokens_base, joining.progress_base) == (40_960, 40.0)


@pytest.mark.parametrize("options, exact, replays", [
    ({"sync": {"method": "edit"}}, True, True),       # the same steps, bitwise
    ({"sync": {"method": "diloco"}}, True, True),
    ({"sync": {"method": "edit"}}, False, False),     # other replicas, other batches
    ({"sync": {"method": "aedit"}, "sim": {"step_schedule": [2, 3]}}, True, True),
    ({"sync": {"method": "aedit"}, "sim": {"step_schedule": [2, 3]}}, False, False),
    ({"sync": {"method": "aedit"}}, True, False),     # the wall clock: other windows
    ({"sync": {"method": "aedit"}}, False, False),
])
def test_only_a_resume_that_computes_the_logged_rows_again_replays_them(options, exact,
                                                                        replays):
    """Rows marked replayed are left out by readers as duplicates of rows logged before:
    only an exact resume of a run whose steps do not depend on the clock writes such
    duplicates; an elastic one, or A-EDiT on the wall clock, logs new rows (its final
    evaluation is the run's)."""
    from editrain.config import load_config
    from editrain.train import replays_logged_rows

    assert replays_logged_rows(load_config(None, options), exact=exact) is replays


def _rows(*spec: tuple) -> list[dict]:
    """Rows of a metrics file: ``(step, loss)``, ``(step, loss, "replayed")`` or
    ``("event", name, step)``."""
    out = []
    for item in spec:
        if item[0] == "event":
            out.append({"event": item[1], "step": item[2]})
        else:
            out.append({"step": item[0], "loss": item[1],
                        **({"replayed": True} if len(item) > 2 else {})})
    return out


def test_readers_keep_the_runs_current_history():
    """What plots, benchmarks and plan --calibrate read of a metrics file appended to by
    resumed jobs: a replay's rows are duplicates (left out); a later job whose steps go
    back without being replays (elastic, A-EDiT, a new timeline) replaces the earlier
    job's rows from that step on, also those past where it ends."""
    from editrain.metrics import current_rows

    def history(rows):
        return [(r["step"], r["loss"]) for r in current_rows(rows)]

    first = [(s, 10.0 + s) for s in range(1, 9)]  # a job to step 8, checkpoints at 4, 8
    exact = _rows(*first, ("event", "checkpoint", 8), (5, 15.0, "r"), (8, 18.0, "r"),
                  (9, 19.0), (10, 20.0))
    assert history(exact) == first + [(9, 19.0), (10, 20.0)]
    elastic = _rows(*first, ("event", "timeline", 4), (5, 5.0), (6, 6.0))
    assert history(elastic) == first[:4] + [(5, 5.0), (6, 6.0)]
    # then an exact resume of the elastic history from step 5, run on to 7
    again = elastic + _rows((6, 6.0, "r"), (7, 7.0))
    assert history(again) == first[:4] + [(5, 5.0), (6, 6.0), (7, 7.0)]
    aedit = _rows(*first, (3, 3.0), (4, 4.0), (4, 4.5))  # steps anew, from the mean
    assert history(aedit) == first[:2] + [(3, 3.0), (4, 4.0), (4, 4.5)]
    # a job that logged 1-5 and died after its step-4 checkpoint, resumed elastically: its
    # step 5 is the abandoned history's (the new job's first row is at 5 too)
    died = _rows(*first[:5]) + [{"event": "elastic_resume", "step": 4, "val_loss": 3.65}]
    died += _rows((5, 105.0), (6, 106.0))
    assert history(died) == first[:4] + [(5, 105.0), (6, 106.0)]
    plotted = current_rows(died, resume_evaluations=True)  # the resume's evaluation too
    assert [r.get("val_loss") for r in plotted if r.get("event")] == [3.65]
