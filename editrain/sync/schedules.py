"""When rounds launch and merge: one schedule object per kind of sync, behind one interface.

A schedule decides, at each step boundary of the local phase, whether a round starts (and
of which units), when a delayed round merges, and what the last sync at the end of
training does. It never runs a collective itself: through the engine's
:class:`~editrain.sync.view.EngineView` (its counters and a few verbs, never the engine's
own attributes) it arms a round for the next forward, runs one now, launches one in the
background or merges one, and the engine's hooks and the shared reduction
(:mod:`editrain.sync.reduction`) do the rest. ``docs/architecture.md`` ("How to
add a schedule") walks through writing one.

- :class:`BlockingSchedule`: every ``H`` steps (or ``T`` seconds, A-EDiT), layer-wise in the
  next forward or at once at the step boundary (DiLoCo, Post-Local SGD).
- :class:`StreamingSchedule`: fragments that take turns, merged ``overlap_steps`` later
  (``docs/streaming.md``); with the eager merge a whole round later, just before the
  fragment launches again (section 3c).
- :class:`NonBlockingSchedule`: A-EDiT whose rendezvous and reduction run behind the next
  ``overlap_steps`` inner steps.
- The fault-tolerant mode's schedule is in :mod:`editrain.sync.ft_round`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from editrain.sync.round import SyncRound
from editrain.sync.triggers import FragmentSchedule

if TYPE_CHECKING:
    from editrain.sync.view import EngineView


class Schedule(ABC):
    """The interface: :meth:`step` at each step boundary of the local phase, :meth:`finish`
    at the end of training, :meth:`sync_point` to place evaluations and checkpoints.

    Args:
        engine: the engine as schedules see it (:class:`~editrain.sync.view.EngineView`).
    """

    def __init__(self, engine: EngineView) -> None:
        self.engine = engine
        self.needs_clock = bool(getattr(engine.trigger, "needs_clock", False))
        """Whether the trigger reads the (agreed) wall clock: A-EDiT's time trigger."""

    @abstractmethod
    def step(self) -> None:
        """A step boundary of the local phase (the step is counted): start, merge or arm
        rounds as due."""

    @abstractmethod
    def finish(self, force: bool, ran_armed: bool) -> None:
        """The end of training (``force``): a last sync so that every replica holds the
        global model. Called after the engine ran what was armed (``ran_armed``) and
        merged what was due."""

    @abstractmethod
    def sync_point(self) -> float | None:
        """Progress if this step boundary of the local phase is a sync point (identical on
        every rank), else None (see :meth:`SyncEngine.sync_point`)."""

    def due(self, since_window: float = 0.0) -> tuple[bool, float]:
        """Whether this replica's trigger (or, with the time trigger, the budget's end)
        says a round is due, and the agreed elapsed time it read (0 without a clock).
        ``since_window``: seconds of the window before the clock's start (non-blocking)."""
        eng = self.engine
        elapsed = eng.clock.elapsed() if self.needs_clock else 0.0
        steps = eng.counters.steps_since_sync
        due = eng.trigger.due(eng.replica, steps, elapsed)
        if not due and self.needs_clock and eng.config.use_async:
            # The budget's end (agreed: the elapsed time within the replica, the rate from
            # the gathered last window).
            due = eng.progress.budget_due(elapsed + since_window, steps)
        return due, elapsed

    def rendezvous(self, elapsed: float, allow_skip: bool = True) -> torch.Tensor | None:
        """A-EDiT's blocking rendezvous; a skipped round is counted."""
        eng = self.engine
        counts = eng.clock.rendezvous(eng.counters.steps_since_sync, elapsed, allow_skip)
        if counts is None:
            eng.counters.num_skipped_syncs += 1
        return counts


class BlockingSchedule(Schedule):
    """Every ``H`` inner steps, or every ``T`` seconds with A-EDiT's rendezvous first: a
    round of every unit, layer-wise in the next training forward (``edit``, ``aedit``) or
    at once at the step boundary (``diloco``, ``post_local_sgd``)."""

    def step(self) -> None:
        eng = self.engine
        due, elapsed = self.due()
        if not due:
            return
        counts = self.rendezvous(elapsed) if eng.config.use_async else None
        if eng.config.use_async and counts is None:
            return  # skipped: too few steps in total; clocks restarted
        if eng.config.layerwise:
            eng.arm(counts)
        else:
            eng.run_now(counts)

    def finish(self, force: bool, ran_armed: bool) -> None:
        eng = self.engine
        if ran_armed:
            return
        # Non-blocking A-EDiT: every replica launched the same rounds.
        while (rnd := eng.pop_inflight()) is not None:
            eng.merge_now(rnd)
        # A-EDiT replicas may differ in steps_since_sync: they all rendezvous to decide.
        counts = (self.rendezvous(eng.clock.elapsed(), allow_skip=False)
                  if eng.config.use_async else None)
        if ((counts is None and not eng.counters.steps_since_sync) or (
                counts is not None and float(counts.sum()) == 0)):
            # Nobody trained since the last sync. Eager: the replicas' own anchors still
            # differ (C is pending); every replica ends on G as it is, without a round
            # (one would send nothing but the error feedback's residual).
            if eng.config.merge == "eager":
                eng.anchors.end_on_global(range(len(eng.units)))
            return
        eng.counters.num_syncs_forced += 1
        eng.run_now(counts)  # eager: every replica ends on the global anchor G

    def sync_point(self) -> float | None:
        eng = self.engine
        step = float(eng.counters.global_step)
        if eng.config.streaming:
            return step
        if eng.armed():
            if eng.config.use_async:
                return eng.progress.at_sync(eng.armed_counts())
            return step
        if eng.counters.steps_since_sync == 0:
            return (eng.progress.synced_replica_steps / eng.num_replicas
                    if eng.config.use_async else step)
        return None


class StreamingSchedule(Schedule):
    """Fragments that take turns (fragment ``f`` every ``H`` steps, staggered by
    ``H / P``), each round merged ``overlap_steps`` steps after its launch, or run in the
    next forward (``overlap_steps = 0``)."""

    def __init__(self, engine: EngineView) -> None:
        super().__init__(engine)
        cfg = engine.config
        assert cfg.local_sgd_sync_interval is not None
        self.fragments = FragmentSchedule(cfg.local_sgd_sync_interval, cfg.fragments)

    def launches(self) -> list[int]:
        """The fragments due at this step boundary."""
        eng = self.engine
        return self.fragments.launches(eng.counters.global_step
                                       - eng.config.local_sgd_warmup_steps)

    def step(self) -> None:
        """Merge the delayed round that is due, then launch the fragments due now."""
        eng = self.engine
        cfg = eng.config
        step = eng.counters.global_step
        eng.settle()  # what no training forward took: merged or run now
        due = eng.oldest_inflight()
        if due is not None and due.apply_at == step:
            rnd = eng.pop_inflight()
            assert rnd is due
            if cfg.layerwise and cfg.merge != "eager":
                eng.merge_in_next_forward(rnd)
            else:
                eng.merge_now(rnd)
        for f in self.launches():
            if cfg.overlap_steps > 0:
                eng.launch(eng.fragments[f], f, apply_at=step + cfg.overlap_steps)
            elif cfg.layerwise:
                eng.arm(None, f)
            else:
                eng.run_now(None, eng.fragments[f], f)

    def finish(self, force: bool, ran_armed: bool) -> None:
        eng = self.engine
        while (rnd := eng.pop_inflight()) is not None:
            eng.merge_now(rnd)
        if eng.counters.global_step <= eng.config.local_sgd_warmup_steps:
            return
        units = list(range(len(eng.units)))
        if eng.config.merge == "eager":
            # A fragment launched at this very boundary has trained nothing since: its
            # round (merged above) is in G already, and a last round would send nothing
            # but the error feedback's residual (docs/streaming.md section 3c). Its units
            # end on G as it is; the others run the last round.
            fresh = {u for f in self.launches() for u in eng.fragments[f]}
            eng.anchors.end_on_global([u for u in units if u in fresh])
            units = [u for u in units if u not in fresh]
            if not units:
                return
        eng.counters.num_syncs_forced += 1
        eng.run_now(None, units)  # eager: every replica on G

    def sync_point(self) -> float | None:
        # In lock-step, but never all holding one model: every step is a point (evaluate
        # the anchors).
        return float(self.engine.counters.global_step)


class NonBlockingSchedule(BlockingSchedule):
    """A-EDiT, non-blocking: a replica snapshots its model when its trigger fires and
    trains on; the rendezvous and the reduction run behind the next ``overlap_steps``
    inner steps, then the round is merged (``docs/streaming.md``). One round in flight at a
    time: the k-th launches of all replicas pair up.

    On the wall clock a round is merged at the first step boundary, ``overlap_steps`` or
    more after its launch, at which it is complete on every rank of the replica (never
    waited for); the clock restarts there. With a deterministic trigger (a fixed step
    schedule) it is merged exactly ``overlap_steps`` steps after its launch, waiting if
    need be."""

    def __init__(self, engine: EngineView) -> None:
        super().__init__(engine)
        self.merge_when_done = self.needs_clock

    def step(self) -> None:
        eng = self.engine
        cfg, clock, c = eng.config, eng.clock, eng.counters
        # The due round is merged here, at the step boundary (not in the next forward), so
        # that a launch at this very step snapshots the merged model.
        due = eng.oldest_inflight()
        if (due is not None and c.global_step >= due.apply_at
                and self.ready_to_merge(due)):
            eng.pop_inflight()
            eng.merge_now(due)
        if eng.oldest_inflight() is not None or eng.progress.spent:
            # Once a sync has spent the budget (agreed) nobody launches again: the run
            # ends there.
            return
        due, elapsed = self.due(since_window=clock.window_offset)
        if not due:
            return
        window = elapsed + clock.window_offset  # since the last launch (agreed)
        units = list(range(len(eng.units)))
        last = self.probably_last(c.steps_since_sync, window)
        rnd = eng.launch(units, 0, apply_at=c.global_step + cfg.overlap_steps,
                         rendezvous=[c.steps_since_sync, window])
        # This replica's next window starts at its snapshot: later steps count towards it.
        c.steps_since_sync = 0
        clock.launch = clock.now()
        clock.window_offset = 0.0
        if not self.merge_when_done:
            clock.start = clock.launch
        if last:
            self.end_if_spent(rnd)

    def probably_last(self, steps: int, window_s: float) -> bool:
        """Whether the round this replica launches now probably reaches the budget: its
        position with this round's steps (the trainer's own, which counts them on while
        the round is in flight), or with the time trigger the budget's rate over
        ``window_s``, the agreed seconds since the last launch. Agreed within the replica
        (gathered counts, the replica's own steps and agreed time)."""
        progress = self.engine.progress
        if progress.budget is None:
            return False
        if progress.position(self.engine.replica, steps) >= progress.budget:
            return True
        return self.needs_clock and progress.budget_due(window_s, steps)

    def end_if_spent(self, rnd: SyncRound) -> None:
        """The round just launched probably ends the run: wait for its rendezvous, and if
        the gathered counts reach the budget, merge it now (waiting for its reductions) so
        that the run ends at this launch, with no step trained past the budget. Trained on,
        those steps would be the next window's, synced only by the final forced round:
        ``overlap_steps`` or more steps per replica past ``train.steps``. Otherwise the
        round stays in flight as usual (this launch only waited for the slowest replica's
        launch, as a blocking rendezvous does)."""
        eng = self.engine
        assert rnd.rendezvous is not None
        t0 = time.perf_counter()
        rnd.rendezvous.result()  # re-raises a failed rendezvous's exception
        waited = time.perf_counter() - t0
        rnd.wait_s += waited
        eng.counters.total_wait_s += waited
        if rnd.skipped or rnd.step_counts is None:
            return
        if not eng.progress.reached_by(rnd.step_counts.tolist()):
            return
        eng.pop_inflight()
        eng.merge_now(rnd)
        # The next window (a resume with a larger budget trains on) starts at this launch,
        # as the exact schedule's do: nothing trained since, no offset.
        eng.clock.start = eng.clock.launch

    def ready_to_merge(self, rnd: SyncRound) -> bool:
        """Whether to merge ``rnd`` now (its ``apply_at`` reached). Exact schedule: always
        (the merge waits if need be). Merge when done: only if every job of the round is
        done on every rank of the replica; then the clock restarts here, so that every
        replica's next window starts when the round completed (within a step), whichever
        replica posted last, instead of drifting apart by a step per round."""
        if not self.merge_when_done:
            return True
        eng = self.engine
        pending = not rnd.done()
        now = eng.clock.now()
        flags = torch.tensor([float(pending), now - eng.clock.launch], dtype=torch.float64,
                             device=eng.device)
        if eng.replica_group is not None:
            # The main thread's own replica group (the communication thread has a private
            # one): the ranks of a replica merge at the same step boundary.
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=eng.replica_group)
        pending_any, since_launch = flags.tolist()
        if pending_any:
            return False
        eng.clock.window_offset = since_launch
        eng.clock.start = now
        return True

    def sync_point(self) -> float | None:
        eng = self.engine
        if eng.counters.last_sync_step == eng.counters.global_step:
            return eng.progress.synced_replica_steps * eng.progress.unit
        return None


def plain_schedule(engine: EngineView) -> Schedule:
    """The schedule the configuration asks for (the fault-tolerant mode aside): streaming
    fragments, non-blocking A-EDiT, or blocking rounds."""
    cfg = engine.config
    if cfg.streaming and not cfg.use_async:
        return StreamingSchedule(engine)
    if cfg.use_async and cfg.overlap_steps > 0:
        return NonBlockingSchedule(engine)
    return BlockingSchedule(engine)
