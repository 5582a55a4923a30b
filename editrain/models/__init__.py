"""Model definitions for editrain.

The shape (:class:`LlamaConfig`, the presets) is imported at once and has no torch; the
model and its loss are imported on first use (:mod:`editrain.lazy`), so that a command
which only checks a configuration (``editrain data``) never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from editrain.lazy import lazy_exports
from editrain.models.llama_config import PRESETS, LlamaConfig, preset_config

_EXPORTS = {
    "Llama": "editrain.models.llama",
    "causal_lm_loss": "editrain.models.llama",
    "num_parameters": "editrain.models.llama",
}

__all__ = [
    "PRESETS",
    "Llama",
    "LlamaConfig",
    "causal_lm_loss",
    "num_parameters",
    "preset_config",
]

if TYPE_CHECKING:  # static analysers and IDEs see the real names
    from editrain.models.llama import Llama, causal_lm_loss, num_parameters


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
