"""The method: layer-wise local SGD (EDiT / A-EDiT) and its baselines, on top of FSDP2.

Usable with any training loop and any model with a list of blocks; imports nothing from
``editrain.train``, ``editrain.cli`` or ``editrain.data``.
"""

from editrain.sync.config import METHODS, GTAConfig, SyncConfig
from editrain.sync.edit import EDiT, SyncEngine
from editrain.sync.setup import find_root_params
from editrain.sync.triggers import IntervalTrigger, StepScheduleTrigger, SyncTrigger, TimeTrigger

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
