"""editrain: EDiT / A-EDiT local-SGD training for large language models on FSDP2.

The library API, for your own model and training loop (see ``docs/api.md``)::

    import editrain

    info = editrain.init_mesh(shard_size=8)                # ("sync", "shard") DeviceMesh
    editrain.parallelize(model, info)                      # FSDP2: one unit per block + root
    with editrain.edit(model, info, editrain.SyncConfig(method="edit")) as engine:
        ...  # forward, backward, engine.after_backward(), opt.step(), engine.step()
        engine.finish(force=True)                          # every replica ends on the global model
    editrain.shutdown()                                    # every rank, after the engine closed

The names below are imported on first use, so ``import editrain`` stays cheap (the command
line imports only what it needs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from editrain.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "EDiT": "editrain.sync.edit",
    "GTAConfig": "editrain.sync.config",
    "LocalSGDConfig": "editrain.api",
    "MeshInfo": "editrain.topology",
    "OuterOptimizerConfig": "editrain.api",
    "StatefulPostLocalSGDOptimizer": "editrain.ddp",
    "SyncConfig": "editrain.sync.config",
    "SyncEngine": "editrain.sync.edit",
    "edit": "editrain.api",
    "engine_state_dict": "editrain.api",
    "engine_state_template": "editrain.api",
    "find_blocks": "editrain.units",
    "init_mesh": "editrain.topology",
    "load_engine_state_dict": "editrain.api",
    "parallelize": "editrain.api",
    "shutdown": "editrain.topology",
    "sync_config_from_reference": "editrain.api",
}

__all__ = [
    "EDiT",
    "GTAConfig",
    "LocalSGDConfig",
    "MeshInfo",
    "OuterOptimizerConfig",
    "StatefulPostLocalSGDOptimizer",
    "SyncConfig",
    "SyncEngine",
    "__version__",
    "edit",
    "engine_state_dict",
    "engine_state_template",
    "find_blocks",
    "init_mesh",
    "load_engine_state_dict",
    "parallelize",
    "shutdown",
    "sync_config_from_reference",
]

if TYPE_CHECKING:  # static analysers and IDEs see the real names
    from editrain.api import (
        LocalSGDConfig,
        OuterOptimizerConfig,
        edit,
        engine_state_dict,
        engine_state_template,
        load_engine_state_dict,
        parallelize,
        sync_config_from_reference,
    )
    from editrain.ddp import StatefulPostLocalSGDOptimizer
    from editrain.sync.config import GTAConfig, SyncConfig
    from editrain.sync.edit import EDiT, SyncEngine
    from editrain.topology import MeshInfo, init_mesh, shutdown
    from editrain.units import find_blocks


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
