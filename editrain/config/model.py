"""The configured model's shape: its LlamaConfig, attention heads and sync units, no weights.

Validation needs these facts before any process starts (``train.seq_len`` against the
model's maximum, ``dist.tp_size`` against its heads, ``sync.fragments`` against its sync
units); the trainer and the benchmarks build the model from :func:`model_config`.
"""

from __future__ import annotations

from typing import Any

import torch

from editrain.config.schema import Config
from editrain.errors import as_config_error
from editrain.models import Llama, LlamaConfig, preset_config
from editrain.models.hf import HFCausalLM, read_hf_config
from editrain.sync.setup import find_root_params, unit_modules


def model_config(cfg: Config, vocab_size: int | None = None) -> LlamaConfig:
    """The model's :class:`~editrain.models.LlamaConfig` from the preset and its overrides.

    Raises:
        ConfigError: ``model: ...`` when the overrides make an impossible shape.
    """
    with as_config_error(prefix="model: "):
        return preset_config(cfg.model.preset, vocab_size=vocab_size or cfg.data.vocab_size,
                             **cfg.model.overrides())


def heads(cfg: Config) -> tuple[int, int]:
    """(query heads, key/value heads) of the configured model."""
    if cfg.model.hf_config is not None:
        data = read_hf_config(cfg.model.hf_config)
        q = int(data.get("num_attention_heads") or 1)
        return q, int(data.get("num_key_value_heads") or q)
    mcfg = model_config(cfg)
    return mcfg.n_heads, mcfg.n_kv_heads or mcfg.n_heads


def sync_units(cfg: Config) -> list[str]:
    """The names of the model's sync units, as the sync engine counts them: the root (when
    it holds parameters), every transformer block and, with ``sync.split_root``, the
    embeddings and an untied output head. The model is built on the meta device (no
    memory, no weights) and counted with the engine's own functions.

    Args:
        cfg: a configuration whose model section is valid.

    Returns:
        One name per unit, in the engine's order ("root", "block0", ...).
    """
    model: Any
    with torch.device("meta"):
        if cfg.model.hf_config is not None:
            from transformers import AutoConfig, AutoModelForCausalLM  # optional dependency

            data = dict(read_hf_config(cfg.model.hf_config))
            hf_config = AutoConfig.for_model(data.pop("model_type"), **data)
            model = HFCausalLM(AutoModelForCausalLM.from_config(hf_config))
        else:
            model = Llama(model_config(cfg))
    modules = unit_modules(model, model.blocks(), cfg.sync.split_root)
    root = find_root_params(model, [m for _, m in modules])
    return (["root"] if root else []) + [n for n, _ in modules]
