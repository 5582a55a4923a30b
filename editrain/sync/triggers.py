"""When a replica wants to sync: every H inner steps (EDiT) or every T seconds (A-EDiT).

A trigger is asked once per inner step, after the step, with this replica's counters. Its
answer must be identical on every rank of one replica (the engine agrees on the elapsed time
before asking), and every replica must eventually say yes, because the sync is a collective.
"""

from __future__ import annotations

from typing import Protocol


class SyncTrigger(Protocol):
    """Decides, at a step boundary, whether this replica enters the next sync."""

    def due(self, replica: int, steps_since_sync: int, elapsed_s: float) -> bool:
        """Whether to sync now.

        Args:
            replica: this rank's replica index.
            steps_since_sync: inner steps since the last sync (or since the end of warm-up).
            elapsed_s: wall time since the clocks last started, agreed within the replica.
        """
        ...


class IntervalTrigger:
    """EDiT / DiLoCo / Post-Local SGD: every ``interval`` inner steps.

    Args:
        interval: H, inner steps between syncs.
    """

    needs_clock = False

    def __init__(self, interval: int) -> None:
        if interval < 1:
            raise ValueError(f"sync.local_sgd_sync_interval must be >= 1, got {interval}")
        self.interval = interval

    def due(self, replica: int, steps_since_sync: int, elapsed_s: float) -> bool:
        return steps_since_sync >= self.interval


class TimeTrigger:
    """A-EDiT: once ``seconds`` of wall time have elapsed since the clocks started.

    Args:
        seconds: ``local_sgd_sync_time``.
    """

    needs_clock = True

    def __init__(self, seconds: float) -> None:
        if seconds <= 0:
            raise ValueError(f"sync.local_sgd_sync_time must be > 0, got {seconds}")
        self.seconds = seconds

    def due(self, replica: int, steps_since_sync: int, elapsed_s: float) -> bool:
        return elapsed_s >= self.seconds


class StepScheduleTrigger:
    """A deterministic stand-in for the time trigger: replica ``r`` syncs after
    ``steps[r]`` inner steps. Used to test A-EDiT's unequal-step arithmetic exactly.

    Args:
        steps: inner steps per sync window, one entry per replica.
    """

    needs_clock = False

    def __init__(self, steps: list[int]) -> None:
        if not steps or min(steps) < 1:
            raise ValueError(f"step schedule must be positive integers, got {steps}")
        self.steps = list(steps)

    def due(self, replica: int, steps_since_sync: int, elapsed_s: float) -> bool:
        return steps_since_sync >= self.steps[replica % len(self.steps)]


class FragmentSchedule:
    """Streaming: which fragments launch their sync after local inner step ``k``.

    Fragment ``f`` of ``P`` launches when ``k >= 1`` and ``k mod H == ((f + 1) * H // P) mod
    H``: the fragments take turns, ``H / P`` steps apart, and each syncs every ``H`` steps
    (with ``P = 1``: after ``k = H, 2H, ...``, like :class:`IntervalTrigger`).

    Args:
        interval: H.
        fragments: P, at most H.
    """

    def __init__(self, interval: int, fragments: int) -> None:
        if not 1 <= fragments <= interval:
            raise ValueError(f"sync.fragments must be in [1, local_sgd_sync_interval = "
                             f"{interval}], got {fragments}")
        self.interval = interval
        self.offsets = [((f + 1) * interval // fragments) % interval for f in range(fragments)]

    def launches(self, k: int) -> list[int]:
        """Fragments that launch after local step ``k`` (1-based), in fragment order."""
        if k < 1:
            return []
        return [f for f, off in enumerate(self.offsets) if k % self.interval == off]
