"""The engine's round slots, and a round's way from its start to its close.

A round (:class:`~editrain.sync.round.SyncRound`) is *armed* (it runs layer-wise in the
next training forward), *running* (the forward's pre-hooks wait for its units one by one,
or it runs at once at a step boundary), *in flight* (a delayed round: launched at a step
boundary, merged later) or *due for merge in the next forward*. :class:`Rounds` holds
these slots and does what a schedule asks of them (arm, run now, launch, merge, settle);
:meth:`Rounds.open_round` and :meth:`Rounds.close_round` are every round's one start and
one book-keeping, the fault-tolerant path's included. The engine's forward hooks drive a
running round through :meth:`Rounds.advance`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd.profiler import record_function

from editrain.sync.clock import SyncClock
from editrain.sync.comm import CommPath, CommStats
from editrain.sync.config import SyncConfig
from editrain.sync.losses import LossTracker
from editrain.sync.outer import SyncUnit
from editrain.sync.progress import Progress
from editrain.sync.reduction import Reduction
from editrain.sync.round import SyncRound
from editrain.sync.setup import reshard
from editrain.sync.view import Counters


class Rounds:
    """The round slots of one engine.

    Args:
        config: the resolved sync configuration.
        units: the engine's units, in forward order.
        fragments: each fragment's units.
        model: the root module (resharded before a round that runs at a step boundary).
        comm: the communication path the round's jobs are queued on.
        reduction: the jobs (statistics, unit reductions).
        clock: A-EDiT's clock (windows, waits, traffic before the round).
        progress: A-EDiT's progress (recorded at each sync).
        counters: the engine's counters.
        losses: the losses a round carries.
        before_sync: called with the round's index just before a round starts (or None).
        replica: this replica's id.
    """

    def __init__(self, config: SyncConfig, units: Sequence[SyncUnit],
                 fragments: Sequence[list[int]], model: nn.Module, comm: CommPath,
                 reduction: Reduction, clock: SyncClock, progress: Progress,
                 counters: Counters, losses: LossTracker,
                 before_sync: Callable[[int], None] | None, replica: int) -> None:
        self.config, self.units, self.fragments, self.model = config, units, fragments, model
        self.comm, self.reduction, self.clock = comm, reduction, clock
        self.progress, self.counters, self.losses = progress, counters, losses
        self.before_sync, self.replica = before_sync, replica
        self.armed = False
        """A round is armed: it runs layer-wise in the next training forward."""
        self.armed_counts: torch.Tensor | None = None
        self.armed_fragment = 0
        self.running: SyncRound | None = None
        """The round whose units the current forward waits for (or that runs blocking)."""
        self.inflight: list[SyncRound] = []
        """Delayed rounds launched and not yet merged, in launch order."""
        self.merge_next: SyncRound | None = None
        """A delayed round due: merged unit by unit in the next training forward."""
        self.starting: list[int] | None = None
        """The units of the round that starts, while ``before_sync`` runs."""
        self.sync_log: list[dict[str, Any]] = []
        self.log_fragments = config.streaming and not config.use_async
        """Whether log entries name the round's fragment (streaming)."""
        self.reset_at_launch = False
        """Non-blocking A-EDiT: a window starts at the launch, not when the round closes."""
        self.on_sync: Callable[[CommStats], None] | None = None
        """Called with the round's counters when a round is applied (the engine then syncs
        the model's buffers at the next step boundary: :mod:`editrain.sync.buffers`)."""

    @property
    def pending(self) -> bool:
        """Whether the next training forward will run a layer-wise sync (or merge one)."""
        return self.armed or self.merge_next is not None

    # ------------------------------------------------------------------ what schedules ask
    def arm(self, step_counts: torch.Tensor | None, fragment: int = 0) -> None:
        """Arm a round of ``fragment``'s units (all units without fragments): it runs
        layer-wise in the next training forward."""
        self.armed, self.armed_counts = True, step_counts
        self.armed_fragment = fragment

    def run_now(self, step_counts: torch.Tensor | None, units: list[int] | None = None,
                fragment: int = 0) -> None:
        """Run a round of ``units`` (default: all) now, at the step boundary, and wait."""
        self.armed = False
        reshard(self.model)
        self.start(step_counts, list(range(len(self.units))) if units is None else units,
                   fragment)
        self.drain()

    def launch(self, units: list[int], fragment: int, apply_at: int,
               rendezvous: list[float] | None = None) -> SyncRound:
        """Start a delayed round: snapshot the units' parameters and queue all its jobs
        (first, with ``rendezvous``, A-EDiT's gather of this row); it is merged after step
        ``apply_at`` (:meth:`merge_now` or :meth:`merge_in_next_forward`)."""
        self.call_before_sync(units)
        for u in units:
            if self.config.merge == "eager":
                self.units[u].eager_launch()  # D kept, own share applied, theta <- A
            else:
                self.units[u].launch = self.units[u].flat_params()
        # (with a rendezvous, the statistics job is queued after it: it needs the counts)
        rnd = self.open_round(None, units, fragment, apply_at=apply_at,
                              statistics=None if rendezvous is None else False)
        if rendezvous is not None:
            rnd.my_steps = self.counters.steps_since_sync
            rnd.rendezvous = self.comm.submit(self.clock.round_rendezvous, rnd, rendezvous,
                                              stats=rnd.comm, cause="control")
            rnd.stats = self.comm.submit(self.reduction.statistics, rnd, stats=rnd.comm,
                                         cause="statistics")
        rnd.submitted = [self.comm.submit(self.reduction.unit_job, rnd, i, stats=rnd.comm,
                                          cause="rounds") for i in range(len(units))]
        self.inflight.append(rnd)
        return rnd

    def merge_now(self, rnd: SyncRound) -> None:
        """Wait for a delayed round's jobs and merge it into the live parameters now."""
        self.running = rnd
        self.drain()

    def merge_in_next_forward(self, rnd: SyncRound) -> None:
        """Merge a delayed round unit by unit in the next training forward."""
        self.merge_next = rnd

    def settle(self) -> bool:
        """Merge the delayed round that is due and run the armed round now (what the next
        training forward would have done). Returns whether an armed round ran."""
        if self.merge_next is not None:
            rnd, self.merge_next = self.merge_next, None
            self.merge_now(rnd)
        if not self.armed:
            return False
        self.run_now(self.armed_counts, self.fragments[self.armed_fragment],
                     self.armed_fragment)
        return True

    def oldest_inflight(self) -> SyncRound | None:
        """The delayed round launched first and not yet merged (None: none in flight)."""
        return self.inflight[0] if self.inflight else None

    def pop_inflight(self) -> SyncRound | None:
        """Take :meth:`oldest_inflight` out of the slots (the caller merges it)."""
        return self.inflight.pop(0) if self.inflight else None

    def unsynced_steps(self) -> int:
        """This replica's steps that no merged round counted yet: those since its last
        sync (non-blocking: since its last launch) and those up to the launch of each
        round in flight, until its merge adds the gathered counts (a skipped round's
        return to the steps since the sync there). Each step is counted exactly once."""
        return self.counters.steps_since_sync + sum(r.my_steps for r in self.inflight)

    # ------------------------------------------------------------------ a round's life
    def open_round(self, step_counts: torch.Tensor | None, units: Sequence[int],
                   fragment: int = 0, apply_at: int | None = None,
                   statistics: bool | None = None, numbered: bool = True) -> SyncRound:
        """A new round of ``units``; delayed (merged after step ``apply_at``) when given.
        Its statistics job is queued at once when ``statistics`` says so (default: when
        the penalty or A-EDiT's step weights need them). ``numbered``: the round takes the
        next index now (the fault-tolerant path numbers it when it closes)."""
        c = self.counters
        rnd = SyncRound(index=c.next_index, step_counts=step_counts, units=list(units),
                        fragment=fragment, launch_step=c.global_step,
                        delayed=apply_at is not None, apply_at=apply_at or 0,
                        comm=self.clock.take_traffic(),
                        windows=self.clock.pending_windows if step_counts is not None
                        else None)
        if numbered:
            c.next_index += 1
        rnd.loss = self.losses.take()
        auto = statistics is None
        if statistics is None:
            statistics = self.config.penalty_enabled or step_counts is not None
        if statistics:
            rnd.stats = self.comm.submit(self.reduction.statistics, rnd, stats=rnd.comm,
                                         cause="statistics")
        elif auto and rnd.loss is not None:
            rnd.stats = self.comm.submit(self.reduction.replica_losses, rnd, stats=rnd.comm,
                                         cause="statistics")
        return rnd

    def close_round(self, rnd: SyncRound, applied: bool = True,
                    record: Mapping[str, Any] | None = None) -> None:
        """The one book-keeping of a finished round. Applied (and with units): it counts as a
        sync, the next window starts (a non-blocking round's started at its launch) and
        its log entry goes to the sync log. Skipped (A-EDiT, too few steps in total): its
        steps count towards the next round. ``record``: the fault-tolerant path's fields
        (committed, quorum, ...) for the log entry, which is then written whatever the
        outcome."""
        c = self.counters
        if rnd.skipped:
            c.num_skipped_syncs += 1
            if rnd.delayed:
                # Non-blocking: the steps up to the snapshot count towards the next sync
                # (defect 7), whose window already started at the snapshot; so does the
                # time they took.
                c.steps_since_sync += rnd.my_steps
                if rnd.windows:
                    self.clock.window_offset += rnd.windows[self.replica]
            else:
                self.clock.restart()
        elif applied and rnd.units:
            if self.on_sync is not None:
                self.on_sync(rnd.comm)
            c.num_syncs += 1
            c.last_sync_step = c.global_step
            if rnd.step_counts is not None:
                self.progress.record_sync(rnd.step_counts.tolist(), rnd.windows or [])
            if not (rnd.delayed and self.reset_at_launch):
                c.steps_since_sync = 0  # (non-blocking: reset at the launch)
                self.clock.restart()
            self.armed_counts = None
        elif not rnd.units and not c.steps_since_sync:
            self.clock.restart()  # joined: this replica's window starts now
        if record is None and (rnd.skipped or not applied):
            return
        rnd.staleness = max(0, c.next_index - 1 - rnd.index)
        rnd.replicas = len(rnd.members) if rnd.members else self.reduction.num_replicas
        entry = rnd.log_entry(c.global_step, self.clock.take_wait(),
                              fragment=self.log_fragments)
        if record is not None:
            entry.update(record)
            c.next_index = rnd.index + 1
        self.sync_log.append(entry)

    def call_before_sync(self, units: list[int]) -> None:
        """The ``before_sync`` hook, with :attr:`starting` set to the round's units."""
        if self.before_sync is not None:
            self.starting = units
            try:
                self.before_sync(self.counters.next_index)
            finally:
                self.starting = None

    def start(self, step_counts: torch.Tensor | None, units: list[int],
              fragment: int = 0) -> None:
        """Open a round and make it the running one (its units wait in :meth:`advance`)."""
        self.call_before_sync(units)
        self.running = self.open_round(step_counts, units, fragment)

    def start_pending(self) -> None:
        """The training forward begins: the armed round starts, or the round due for
        merge becomes the running one."""
        if self.armed:
            self.armed = False
            self.start(self.armed_counts, self.fragments[self.armed_fragment],
                       self.armed_fragment)
        else:
            self.running, self.merge_next = self.merge_next, None

    def advance(self, u: int) -> None:
        """Queue the running round's units up to ``prefetch_depth`` past unit ``u``, then
        wait for (and, if delayed, merge) every unit of the round up to ``u``."""
        rnd = self.running
        assert rnd is not None
        upto = rnd.position(u)
        last = min(len(rnd.units), upto + self.config.prefetch_depth)
        while len(rnd.submitted) < last:
            rnd.submitted.append(self.comm.submit(self.reduction.unit_job, rnd,
                                                  len(rnd.submitted), stats=rnd.comm,
                                                  cause="rounds"))
        while rnd.waited < upto:
            t0 = time.perf_counter()
            with record_function("editrain::sync::wait"):
                rnd.submitted[rnd.waited].result()  # re-raises a failed job's exception
            waited = time.perf_counter() - t0
            rnd.wait_s += waited
            self.counters.total_wait_s += waited
            if rnd.delayed:
                unit = self.units[rnd.units[rnd.waited]]
                if rnd.skipped and not unit.eager_replicas:
                    unit.launch = None  # nothing was reduced: the local model stays
                else:
                    unit.merge(self.config.merge, self.config.merge_alpha)
            rnd.waited += 1
        if rnd.waited == len(rnd.units):
            self.running = None
            self.close_round(rnd)

    def drain(self) -> None:
        """Complete the running round, if any (every unit waited for and merged)."""
        if self.running is not None:
            self.advance(len(self.units) - 1)

    def wait_inflight(self) -> None:
        """Wait for the jobs of every delayed round (no merge: that stays on schedule)."""
        for rnd in self.inflight + ([self.merge_next] if self.merge_next else []):
            rnd.wait()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The slots' part of the engine's plain state."""
        return {
            "inflight": [r.state_dict() for r in self.inflight],
            "merge_next": None if self.merge_next is None else self.merge_next.state_dict(),
            "pending": self.armed,
            "pending_fragment": self.armed_fragment,
            "pending_counts": (None if self.armed_counts is None
                               else self.armed_counts.tolist()),
        }

    def load_state_dict(self, sd: Mapping[str, Any], elastic: bool) -> None:
        """Inverse of :meth:`state_dict`; ``elastic``: every slot empty (rounds in flight
        are not carried across topologies)."""
        self.inflight, self.merge_next = [], None
        if elastic:
            self.armed, self.armed_counts = False, None
            for unit in self.units:
                unit.launch = None
            return
        self.armed = bool(sd["pending"])
        self.armed_fragment = int(sd.get("pending_fragment", 0))
        self.inflight = [SyncRound.from_state(r) for r in sd.get("inflight", [])]
        if sd.get("merge_next") is not None:
            self.merge_next = SyncRound.from_state(sd["merge_next"])
        counts = sd["pending_counts"]
        self.armed_counts = (None if counts is None
                             else torch.tensor(counts, dtype=torch.float64))
