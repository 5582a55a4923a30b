"""A-EDiT's progress: how far the cluster is through its budget, and when to stop.

Replicas run at their own pace, so progress is counted in *replica-steps* (inner steps of
one replica) and reported in synchronous-step equivalents (replica-steps of all replicas
divided by ``R``). It is known exactly at each sync, whose rendezvous gathers every
replica's steps since the last sync and the length of its window; in between, a replica
estimates it from its own steps not synced yet (non-blocking: those of the round in flight
too, until its merge brings the gathered counts), scaled by its share of all steps in the
last window. The learning rate and the tokens logged follow that estimate, so it never goes
back (:meth:`Progress.position`): a replica faster than in the last window overshoots, and
holds its position until the exact count its sync brings catches up.

Every quantity a decision depends on is either gathered (identical on every rank) or the
elapsed time agreed within the replica, so the ranks of a replica always decide alike.

Progress is measured in the synchronous steps of the *reference topology*, the one the run
started on (``R_ref`` replicas of ``S_ref`` ranks): one replica-step of the current
topology (``S`` ranks) is ``S / (R_ref * S_ref)`` of such a step, since the tokens of a
replica-step grow with its ranks. An elastic resume onto another topology therefore keeps
the token budget and the place in the learning-rate schedule (:meth:`Progress.rescale`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Progress:
    """Replica-steps known at the last sync, the last window, and the budget.

    Args:
        num_replicas: ``R``.
        budget: total progress to reach, in synchronous-step equivalents (the trainer's
            ``train.steps``); None: no budget (the loop decides when to stop).
    """

    num_replicas: int
    shard_size: int = 1
    reference: tuple[int, int] | None = None
    """``(R_ref, S_ref)``: the topology the budget is counted in (default: this one)."""
    budget: float | None = None
    synced_replica_steps: float = 0.0
    """Replica-steps of all replicas up to the last sync (exact)."""
    last_window_counts: list[float] | None = None
    """Each replica's steps in the last sync's window (gathered)."""
    last_window_s: float = 0.0
    """Length of the last window: the longest of the replicas' agreed elapsed times
    (gathered, so identical on every rank)."""
    floor: float = 0.0
    """The furthest :meth:`position` this replica reported (identical on its ranks: it is
    made of gathered counts and the replica's own steps)."""

    @property
    def spent(self) -> bool:
        """Whether a sync has reached the budget (decided from gathered counts: agreed).
        Derived, not stored: a resume whose ``train.steps`` is larger than the saving run's
        trains on from a checkpoint of the sync that spent the old budget."""
        return self.budget is not None and self.synced_replica_steps * self.unit >= self.budget

    @property
    def synced(self) -> float:
        """Exact progress up to the last sync (identical on every rank): what a checkpoint
        records, since the estimates of replicas at different steps differ."""
        return self.synced_replica_steps * self.unit

    @property
    def unit(self) -> float:
        """Synchronous steps of the reference topology per replica-step."""
        r, s = self.reference or (self.num_replicas, self.shard_size)
        return self.shard_size / (r * s)

    def rescale(self, old: tuple[int, int]) -> None:
        """An elastic resume from topology ``old = (R, S)``: the replica-steps done become
        replica-steps of this topology with the same tokens; the reference stays."""
        self.reference = self.reference or tuple(old)
        self.synced_replica_steps *= old[1] / self.shard_size
        self.floor = 0.0  # the saving replicas' positions differed: restart from the count

    def start(self, global_step: int) -> None:
        """The local phase starts with every replica at ``global_step``."""
        self.synced_replica_steps = float(global_step * self.num_replicas)

    def estimate(self, replica: int, unsynced_steps: int) -> float:
        """Progress now, as seen from ``replica`` with ``unsynced_steps`` of its own steps
        that no sync counted yet: exact at a sync, estimated between (may go back at the
        next sync; :meth:`position` does not)."""
        counts = self.last_window_counts
        mine = counts[replica] if counts and replica < len(counts) else 0.0
        scale = sum(counts) / mine if counts and mine > 0 else float(self.num_replicas)
        return (self.synced_replica_steps + unsynced_steps * scale) * self.unit

    def position(self, replica: int, unsynced_steps: int) -> float:
        """The progress this replica trains at (its learning rate, its tokens): the
        furthest of its :meth:`estimate` so far, so that the schedule never runs backwards
        when a sync's exact count falls short of the estimate before it."""
        self.floor = max(self.floor, self.estimate(replica, unsynced_steps))
        return self.floor

    def at_sync(self, counts: list[float]) -> float:
        """Exact progress once a sync with these gathered step counts is done."""
        return (self.synced_replica_steps + sum(counts)) * self.unit

    def reached_by(self, counts: list[float]) -> bool:
        """Whether a sync with these gathered step counts reaches the budget (agreed: the
        counts are gathered). That sync ends the run, so it is never skipped for too few
        steps: a skipped last round would train on past the budget until the steps since
        the last sync reached ``sync.min_total_global_steps``."""
        return self.budget is not None and self.at_sync(counts) >= self.budget

    def record_sync(self, counts: list[float], windows_s: list[float]) -> None:
        """Account for a finished sync (identical arguments on every rank)."""
        self.synced_replica_steps += float(sum(counts))
        self.last_window_counts = [float(c) for c in counts]
        self.last_window_s = float(max(windows_s)) if windows_s else 0.0

    def budget_due(self, elapsed_s: float, steps_since_sync: int) -> bool:
        """Whether the cluster has probably used up the budget ``elapsed_s`` seconds into
        the window (the replica's agreed elapsed time): then it enters the rendezvous even
        before its time trigger, and the sync that follows decides exactly."""
        if self.budget is None:
            return False
        if self.last_window_counts and self.last_window_s > 0:
            rate = sum(self.last_window_counts) / self.last_window_s
            estimate = self.synced_replica_steps + rate * elapsed_s
        else:
            estimate = self.synced_replica_steps + steps_since_sync * self.num_replicas
        return estimate * self.unit >= self.budget

    def state_dict(self) -> dict[str, Any]:
        """Plain data."""
        return {"synced_replica_steps": self.synced_replica_steps,
                "last_window_counts": self.last_window_counts,
                "last_window_s": self.last_window_s, "spent": self.spent,
                "progress_floor": self.floor,
                "reference_topology": list(self.reference) if self.reference else None}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict` (``spent`` is saved for readers of the state; it
        is measured against this run's budget, which may differ from the saving run's)."""
        self.synced_replica_steps = float(sd["synced_replica_steps"])
        self.last_window_counts = sd.get("last_window_counts")
        self.last_window_s = float(sd.get("last_window_s", 0.0))
        self.floor = float(sd.get("progress_floor", 0.0))  # (older states: none)
        ref = sd.get("reference_topology")
        self.reference = tuple(ref) if ref else None
