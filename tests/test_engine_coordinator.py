"""Issue 52 item 3: the engine is a coordinator and schedules see it through one interface.

Single-process and fast: the schedules are driven through a hand-made
:class:`editrain.sync.view.EngineView` (no engine, no process group), which proves the view
is all they need; the parts moved out of the engine (counters, losses) are checked on
their own. The engine's behaviour itself is pinned by the golden runs and the engine
tests (tests/test_golden.py, tests/test_engine.py, ...).
"""

from __future__ import annotations

import ast
import inspect
import math
from pathlib import Path
from typing import Any

import torch

from editrain.sync.config import SyncConfig
from editrain.sync.edit import SyncEngine
from editrain.sync.losses import LossTracker
from editrain.sync.round import SyncRound
from editrain.sync.schedules import (
    BlockingSchedule,
    NonBlockingSchedule,
    StreamingSchedule,
    plain_schedule,
)
from editrain.sync.triggers import IntervalTrigger, StepScheduleTrigger
from editrain.sync.view import Counters, EngineView

SYNC = Path(__file__).resolve().parents[1] / "editrain" / "sync"


def test_sync_engine_fits_on_a_few_screens() -> None:
    lines, _ = inspect.getsourcelines(SyncEngine)
    assert len(lines) < 500, f"SyncEngine is {len(lines)} lines"


def test_schedules_never_import_the_engine() -> None:
    # Not even for type hints: the view (sync/view.py) is their whole contract.
    for name in ("schedules.py", "ft_round.py"):
        tree = ast.parse((SYNC / name).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "editrain.sync.edit" not in imported, name
        assert "editrain.sync.view" in imported, name


class _Log:
    """The verbs of a view, recorded in call order."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.inflight: list[SyncRound] = []

    def verb(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, *args, *sorted(kwargs.items())))
            if name == "launch":
                rnd = SyncRound(index=len(self.inflight), step_counts=None, units=args[0],
                                fragment=args[1], delayed=True, apply_at=kwargs["apply_at"])
                self.inflight.append(rnd)
                return rnd
            return False if name == "settle" else None
        return call


def _view(cfg: SyncConfig, log: _Log, counters: Counters, units: int = 4,
          trigger: Any = None) -> EngineView:
    fragments = [list(range(f, units, cfg.fragments)) for f in range(cfg.fragments)]
    verbs = {n: log.verb(n) for n in ("arm", "run_now", "launch", "merge_now",
                                      "merge_in_next_forward", "settle", "open_round",
                                      "close_round")}
    if trigger is None:
        assert cfg.local_sgd_sync_interval is not None
        trigger = IntervalTrigger(cfg.local_sgd_sync_interval)
    return EngineView(
        config=cfg, units=[object()] * units, fragments=fragments, replica=0,  # type: ignore[list-item]
        num_replicas=2, device=torch.device("cpu"), counters=counters,
        trigger=trigger, clock=None,  # type: ignore[arg-type]
        progress=None, comm=None, reduction=None, replica_group=None,  # type: ignore[arg-type]
        oldest_inflight=lambda: log.inflight[0] if log.inflight else None,
        pop_inflight=lambda: log.inflight.pop(0) if log.inflight else None,
        armed=lambda: False, armed_counts=lambda: None, anchors=None,  # type: ignore[arg-type]
        **verbs)


def _steps(schedule: Any, counters: Counters, n: int) -> None:
    """What SyncEngine.step does in the local phase (no warm-up), ``n`` times."""
    for _ in range(n):
        counters.global_step += 1
        counters.steps_since_sync += 1
        schedule.step()


def test_blocking_schedule_arms_through_the_view_every_h_steps() -> None:
    cfg = SyncConfig(method="edit", local_sgd_sync_interval=3).resolve()
    log, counters = _Log(), Counters()
    schedule = plain_schedule(_view(cfg, log, counters))
    assert type(schedule) is BlockingSchedule
    _steps(schedule, counters, 3)
    assert log.calls == [("arm", None)]  # the third step boundary: H = 3 steps since sync
    assert schedule.sync_point() is None  # armed() is False in this view, steps pending
    counters.steps_since_sync = 0  # (what the engine's close_round does)
    assert schedule.sync_point() == 3.0
    _steps(schedule, counters, 2)
    assert log.calls == [("arm", None)]
    schedule.finish(force=True, ran_armed=False)
    assert log.calls[-1] == ("run_now", None) and counters.num_syncs_forced == 1


def test_non_layerwise_methods_run_at_the_step_boundary() -> None:
    cfg = SyncConfig(method="diloco", local_sgd_sync_interval=2).resolve()
    log, counters = _Log(), Counters()
    schedule = plain_schedule(_view(cfg, log, counters))
    _steps(schedule, counters, 2)
    assert log.calls == [("run_now", None)]


def test_streaming_schedule_launches_and_merges_through_the_view() -> None:
    cfg = SyncConfig(method="edit", local_sgd_sync_interval=4, fragments=2,
                     overlap_steps=1).resolve()
    log, counters = _Log(), Counters()
    schedule = plain_schedule(_view(cfg, log, counters))
    assert type(schedule) is StreamingSchedule
    _steps(schedule, counters, 4)
    launches = [c for c in log.calls if c[0] == "launch"]
    # Fragment f launches at local step (f + 1) * H / P: 2 and 4; each merges one later.
    assert [(c[1], c[2], c[3]) for c in launches] == [
        ([0, 2], 0, ("apply_at", 3)), ([1, 3], 1, ("apply_at", 5))]
    merged = [c[1] for c in log.calls if c[0] in ("merge_now", "merge_in_next_forward")]
    assert [r.units for r in merged] == [[0, 2]]
    assert [c[0] for c in log.calls if c[0] != "settle"] == [
        "launch", "merge_in_next_forward", "launch"]
    schedule.finish(force=True, ran_armed=False)
    assert [r.units for r in (c[1] for c in log.calls if c[0] == "merge_now")] == [[1, 3]]
    assert log.calls[-1] == ("run_now", None, [0, 1, 2, 3])
    assert counters.num_syncs_forced == 1


def test_the_configuration_picks_the_schedule() -> None:
    # A-EDiT with overlap: non-blocking (its rounds need the engine's clock and groups, so
    # tests/test_aedit_clock.py runs it); a step-schedule trigger stands in for the clock.
    cfg = SyncConfig(method="aedit", overlap_steps=1).resolve()
    view = _view(cfg, _Log(), Counters(), trigger=StepScheduleTrigger([2]))
    schedule = plain_schedule(view)
    assert type(schedule) is NonBlockingSchedule and not schedule.merge_when_done
    cfg = SyncConfig(method="aedit").resolve()
    assert type(plain_schedule(_view(cfg, _Log(), Counters(),
                                     trigger=StepScheduleTrigger([2])))) is BlockingSchedule


def test_counters_round_trip_and_elastic_restart() -> None:
    c = Counters(global_step=9, steps_since_sync=2, num_syncs=3, num_skipped_syncs=1,
                 num_syncs_forced=1, next_index=5, last_sync_step=7, total_wait_s=0.5)
    sd = c.state_dict()
    assert sd == {"global_step": 9, "steps_since_sync": 2, "num_syncs": 3,
                  "num_skipped_syncs": 1, "num_syncs_forced": 1, "next_index": 5}
    same = Counters()
    same.load_state_dict(sd, elastic=False)
    assert same.state_dict() == sd
    moved = Counters()
    moved.load_state_dict(sd, elastic=True)
    # Another topology: rounds in flight are dropped (the next index is the sync count)
    # and the local phase restarts.
    assert (moved.steps_since_sync, moved.next_index, moved.global_step) == (0, 3, 9)


def test_loss_tracker_means_since_the_last_round() -> None:
    losses = LossTracker(torch.device("cpu"))
    assert losses.take() is None and losses.state_dict() is None  # not tracking
    losses.record(torch.tensor(2.0))
    losses.record(4.0)
    assert float(losses.take()) == 3.0
    assert math.isnan(float(losses.take()))  # a round with no step recorded since
    losses.record(1.5)
    sd = losses.state_dict()
    assert sd == {"sum": 1.5, "steps": 1}
    other = LossTracker(torch.device("cpu"))
    other.load_state_dict(sd)
    assert float(other.take()) == 1.5
