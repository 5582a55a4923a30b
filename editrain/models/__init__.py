"""Model definitions for editrain."""

from editrain.models.llama import (
    PRESETS,
    Llama,
    LlamaConfig,
    causal_lm_loss,
    num_parameters,
    preset_config,
)

__all__ = [
    "PRESETS",
    "Llama",
    "LlamaConfig",
    "causal_lm_loss",
    "num_parameters",
    "preset_config",
]
