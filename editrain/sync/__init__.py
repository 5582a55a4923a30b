"""The method: layer-wise local SGD (EDiT / A-EDiT) and its baselines, on top of FSDP2.

Usable with any training loop and any model with a list of blocks; imports nothing from
``editrain.train``, ``editrain.cli`` or ``editrain.data``.

The names below are imported on first use (:mod:`editrain.lazy`): the configuration
imports :mod:`editrain.sync.config`, and a command that only loads one (``editrain data``)
must not pay for the engine's torch and ``torch.distributed`` imports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from editrain.lazy import lazy_exports

_EXPORTS = {
    "EDiT": "editrain.sync.edit",
    "GTAConfig": "editrain.sync.config",
    "IntervalTrigger": "editrain.sync.triggers",
    "METHODS": "editrain.sync.config",
    "StepScheduleTrigger": "editrain.sync.triggers",
    "SyncConfig": "editrain.sync.config",
    "SyncEngine": "editrain.sync.edit",
    "SyncTrigger": "editrain.sync.triggers",
    "TimeTrigger": "editrain.sync.triggers",
    "find_root_params": "editrain.sync.setup",
}

__all__ = [
    "EDiT",
    "GTAConfig",
    "IntervalTrigger",
    "METHODS",
    "StepScheduleTrigger",
    "SyncConfig",
    "SyncEngine",
    "SyncTrigger",
    "TimeTrigger",
    "find_root_params",
]

if TYPE_CHECKING:  # static analysers and IDEs see the real names
    from editrain.sync.config import METHODS, GTAConfig, SyncConfig
    from editrain.sync.edit import EDiT, SyncEngine
    from editrain.sync.setup import find_root_params
    from editrain.sync.triggers import (
        IntervalTrigger,
        StepScheduleTrigger,
        SyncTrigger,
        TimeTrigger,
    )


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
