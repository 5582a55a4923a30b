"""The engine's plain state: what one rank keeps as JSON in a checkpoint, and its restore.

:class:`editrain.sync.state.StateLayout` stores it under the rank's key; this module says
what it holds (counters, round slots, clock, A-EDiT's progress, anomaly detectors, the RNG
seed, the losses since the last round) and how an elastic resume restarts the local phase
from it (no armed round, rounds in flight dropped, clocks restarted; A-EDiT's progress
converted to the new topology).
"""

from __future__ import annotations

from typing import Any

from editrain.sync.clock import SyncClock
from editrain.sync.config import SyncConfig
from editrain.sync.losses import LossTracker
from editrain.sync.progress import Progress
from editrain.sync.reduction import Reduction
from editrain.sync.rounds import Rounds
from editrain.sync.state import saved_replicas_and_shards
from editrain.sync.view import Counters


class PlainState:
    """This rank's plain state, gathered from the engine's parts (and given back to them).

    Args:
        config: the resolved sync configuration (A-EDiT's elastic conversion).
        counters, rounds, clock, progress, reduction, losses: the engine's parts that own
            plain state (the reduction owns the detectors and the RNG seed).
        num_replicas: replicas of the running job.
    """

    def __init__(self, config: SyncConfig, counters: Counters, rounds: Rounds,
                 clock: SyncClock, progress: Progress, reduction: Reduction,
                 losses: LossTracker, num_replicas: int) -> None:
        self.config, self.counters, self.rounds, self.clock = config, counters, rounds, clock
        self.progress, self.reduction, self.losses = progress, reduction, losses
        self.num_replicas = num_replicas

    def state_dict(self) -> dict[str, Any]:
        """Counters, round slots, clock, progress, detectors and RNG seed (JSON-able)."""
        detectors = self.reduction.detectors
        return {
            **self.counters.state_dict(),
            **self.rounds.state_dict(),
            **self.clock.state_dict(),
            **self.progress.state_dict(),
            "detectors": detectors.state_dict() if detectors is not None else None,
            "rng": {"seed": self.reduction.seed},
            "loss": self.losses.state_dict(),
        }

    def load_state_dict(self, sd: dict[str, Any], elastic: bool) -> None:
        """Inverse of :meth:`state_dict`; ``elastic``: the state of another topology (rank
        0's, or the first saved rank of this pipeline stage)."""
        self.counters.load_state_dict(sd, elastic)
        self.rounds.load_state_dict(sd, elastic)
        self.progress.load_state_dict(sd)
        self.reduction.seed = int(sd["rng"]["seed"])
        if elastic:
            # A-EDiT replicas were at different steps: the replica-steps done are converted
            # to this topology at equal tokens, and every replica restarts at their mean (the
            # budget and the schedule stay counted in the run's first topology). Every other
            # method keeps the (common) step count. The local phase restarts.
            if self.config.use_async:
                self.progress.rescale(saved_replicas_and_shards(sd["topology"]))
                self.counters.global_step = int(round(self.progress.synced_replica_steps
                                                      / self.num_replicas))
            self.clock.restart_all()
            self.progress.last_window_counts, self.progress.last_window_s = None, 0.0
        else:
            self.clock.load_state_dict(sd)
            self.losses.load_state_dict(sd.get("loss"))
        detectors = self.reduction.detectors
        if detectors is not None and sd["detectors"] is not None:
            detectors.load_state_dict(sd["detectors"], allow_resize=True)
