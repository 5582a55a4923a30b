"""What a schedule sees of the engine: its counters and a few verbs (:class:`EngineView`).

Schedules (:mod:`editrain.sync.schedules`, :mod:`editrain.sync.ft_round`) decide when
rounds start and merge; the engine (:class:`editrain.sync.edit.SyncEngine`) holds the
round slots and runs them. The view is the whole contract between the two: a schedule
reads and counts through :class:`Counters`, reads the configuration, trigger, clock and
progress, and acts only through the verbs listed here, never through the engine's own
attributes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from editrain.sync.clock import SyncClock
    from editrain.sync.comm import CommPath
    from editrain.sync.config import SyncConfig
    from editrain.sync.global_model import GlobalModel
    from editrain.sync.outer import SyncUnit
    from editrain.sync.progress import Progress
    from editrain.sync.reduction import Reduction
    from editrain.sync.round import SyncRound
    from editrain.sync.triggers import SyncTrigger


_SAVED = ("global_step", "steps_since_sync", "num_syncs", "num_skipped_syncs",
          "num_syncs_forced", "next_index")
"""The counters a checkpoint keeps (this rank's plain state, under these keys)."""


@dataclass
class Counters:
    """The engine's counters; the engine and its schedule share this one object."""

    global_step: int = 0
    steps_since_sync: int = 0
    """Inner steps of this replica since its last sync (the trigger's input)."""
    num_syncs: int = 0
    num_skipped_syncs: int = 0
    """A-EDiT rounds skipped: too few steps in total."""
    num_syncs_forced: int = 0
    """Syncs run by ``finish(force=True)`` although no trigger was due."""
    next_index: int = 0
    """The index of the next round (it seeds GTA's random choices)."""
    last_sync_step: int = -1
    """Global step of the last sync (a non-blocking sync point)."""
    total_wait_s: float = 0.0
    """Seconds the caller's thread waited for sync jobs, since the start (metrics)."""

    def state_dict(self) -> dict[str, int]:
        """The counters a checkpoint keeps."""
        return {k: getattr(self, k) for k in _SAVED}

    def load_state_dict(self, sd: dict[str, Any], elastic: bool) -> None:
        """Inverse of :meth:`state_dict` but for the step count, which an elastic A-EDiT
        resume recomputes (the caller sets it); ``elastic``: the local phase restarts (no
        steps since the sync, rounds in flight dropped)."""
        self.num_syncs = int(sd["num_syncs"])
        self.num_skipped_syncs = int(sd["num_skipped_syncs"])
        self.num_syncs_forced = int(sd["num_syncs_forced"])
        self.next_index = self.num_syncs if elastic else int(sd.get("next_index",
                                                                     self.num_syncs))
        self.steps_since_sync = 0 if elastic else int(sd["steps_since_sync"])
        self.global_step = int(sd["global_step"])


@dataclass(frozen=True)
class EngineView:
    """The engine as a schedule sees it: the parts it reads and the verbs it may call."""

    config: SyncConfig
    units: Sequence[SyncUnit]
    fragments: Sequence[list[int]]
    """Fragment ``f``'s units (every unit without streaming fragments)."""
    replica: int
    num_replicas: int
    device: torch.device
    counters: Counters
    trigger: SyncTrigger
    clock: SyncClock
    progress: Progress
    comm: CommPath
    reduction: Reduction
    replica_group: dist.ProcessGroup | None
    """The main thread's group over this replica's ranks (None: one rank)."""
    arm: Callable[[torch.Tensor | None, int], None]
    """Arm a round of a fragment (with A-EDiT's step counts): layer-wise in the next forward."""
    run_now: Callable[..., None]
    """``(counts, units=None, fragment=0)``: run a round now, at the step boundary."""
    launch: Callable[..., SyncRound]
    """``(units, fragment, apply_at, rendezvous=None)``: start a delayed round."""
    merge_now: Callable[[SyncRound], None]
    merge_in_next_forward: Callable[[SyncRound], None]
    settle: Callable[[], bool]
    """Merge the due round and run the armed one now; whether an armed round ran."""
    oldest_inflight: Callable[[], SyncRound | None]
    """The delayed round launched first and not yet merged (None: none in flight)."""
    pop_inflight: Callable[[], SyncRound | None]
    """Take :attr:`oldest_inflight` out of the engine's slots (the caller merges it)."""
    armed: Callable[[], bool]
    armed_counts: Callable[[], list[float] | None]
    """A-EDiT: every replica's steps in the window of the armed round."""
    open_round: Callable[..., SyncRound]
    close_round: Callable[..., None]
    anchors: GlobalModel
    """The units' anchors as one model (a healing replica's share of the global state)."""
