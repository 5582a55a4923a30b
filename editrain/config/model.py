"""The configured model's shape: its LlamaConfig, attention heads and sync units, no weights.

Validation needs these facts before any process starts (``train.seq_len`` against the
model's maximum, ``dist.tp_size`` against its heads, ``sync.fragments`` against its sync
units); the trainer and the benchmarks build the model from :func:`model_config`.

The shape and the tokenizer are read without torch (``editrain data`` checks a whole
configuration and never imports it); only what builds a model on the meta device
(:func:`meta_model`, :func:`sync_units`) or reads a Hugging Face config file imports the
model code, inside the function.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from editrain.config.schema import Config, ModelSection
from editrain.errors import ConfigError, as_config_error
from editrain.models.hf_dir import hf_int, read_config, special_tokens, tokenizer_file
from editrain.models.hf_llama import is_llama_config, llama_config_from_hf
from editrain.models.llama_config import LlamaConfig, preset_config
from editrain.paths import shown


def init_llama(cfg: Config) -> bool:
    """Whether ``model.init_from`` names a ``LlamaForCausalLM`` directory (which trains as
    editrain's own Llama)."""
    return section_init_llama(cfg.model)


def section_init_llama(model: ModelSection) -> bool:
    """:func:`init_llama` of a ``[model]`` section alone (the planner has no whole
    configuration)."""
    init = getattr(model, "init_from", None)  # duck-typed configurations lack it
    if init is None:
        return False
    with as_config_error():  # a directory without a config.json, a field that is no number
        return is_llama_config(read_config(init))


def hf_source(cfg: Config) -> str | None:
    """The Hugging Face config the model is built from through transformers:
    ``model.hf_config``, or a ``model.init_from`` directory of another architecture than
    Llama; None for editrain's own Llama."""
    return section_hf_source(cfg.model)


def section_hf_source(model: ModelSection) -> str | None:
    """:func:`hf_source` of a ``[model]`` section alone."""
    if getattr(model, "hf_config", None) is not None:
        return model.hf_config
    init = getattr(model, "init_from", None)
    if init is not None and not section_init_llama(model):
        return init
    return None


def hf_option(cfg: Config) -> str:
    """The option :func:`hf_source` took the file from (``model.hf_config`` or
    ``model.init_from``): every message about the file names the one the user set."""
    return section_hf_option(cfg.model)


def section_hf_option(model: ModelSection) -> str:
    """:func:`hf_option` of a ``[model]`` section alone."""
    return "model.hf_config" if getattr(model, "hf_config", None) is not None else \
        "model.init_from"


def builds_on_meta(cfg: Config) -> bool:
    """Whether the job's model starts on the meta device: editrain's Llama whose every
    weight comes from elsewhere, a ``model.init_from`` directory or the checkpoint
    ``--resume`` names. Its ranks then build no whole model in host memory: each
    materialises its shards only, which those weights fill
    (:func:`editrain.build.materialise`)."""
    return (hf_source(cfg) is None
            and (getattr(cfg.model, "init_from", None) is not None or bool(cfg.resume)))


def model_config(cfg: Config, vocab_size: int | None = None) -> LlamaConfig:
    """The model's :class:`~editrain.models.LlamaConfig` from the preset and its overrides,
    or from a Llama ``model.init_from`` directory's ``config.json`` (then ``vocab_size`` is
    the file's: the tokenizer's is checked against it before launch).

    Raises:
        ConfigError: ``model: ...`` when the overrides make an impossible shape;
            ``model.init_from: ...`` when the directory's config cannot be the Llama's.
    """
    if getattr(cfg.model, "init_from", None) is not None:
        return section_model_config(cfg.model)
    return section_model_config(cfg.model, vocab_size or cfg.data.vocab_size)


def section_model_config(model: ModelSection, vocab_size: int | None = None) -> LlamaConfig:
    """:func:`model_config` of a ``[model]`` section alone: the preset with its overrides
    and ``vocab_size`` (None: the preset's own), or a Llama ``model.init_from``
    directory's ``config.json`` (its own vocabulary; ``vocab_size`` is not used).

    Raises:
        ConfigError: as :func:`model_config`.
    """
    if getattr(model, "init_from", None) is not None:
        with as_config_error():
            data = read_config(model.init_from)
            config = Path(model.init_from).expanduser() / "config.json"
            return llama_config_from_hf(data, f"model.init_from: {shown(config)}")
    overrides = model.overrides()
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    with as_config_error(prefix="model: "):  # a combination: heads that do not divide dim
        try:
            return preset_config(model.preset, **overrides)
        except ConfigError as e:  # one field's type or range, named by it: model.FIELD
            raise ConfigError(f"model.{e}") from None


def heads(cfg: Config) -> tuple[int, int]:
    """(query heads, key/value heads) of the configured model."""
    source = hf_source(cfg)
    if source is not None:
        from editrain.models.hf import read_hf_config

        data = read_hf_config(source, hf_option(cfg))
        q = hf_int(data, "heads") or 1
        return q, hf_int(data, "kv_heads") or q
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
    from editrain.sync.setup import find_root_params, unit_modules

    model = meta_model(cfg)
    modules = unit_modules(model, model.blocks(), cfg.sync.split_root)
    root = find_root_params(model, [m for _, m in modules])
    return (["root"] if root else []) + [n for n, _ in modules]


def meta_model(cfg: Config) -> Any:
    """The configured model on the meta device: its parameters' names and shapes, no
    memory, no weights."""
    import torch

    from editrain.models import Llama
    from editrain.models.hf import HFCausalLM

    source = hf_source(cfg)
    if source is not None:
        return HFCausalLM(meta_hf_model(source, hf_option(cfg)))
    with torch.device("meta"):
        return Llama(model_config(cfg))


def meta_hf_model(source: str, option: str) -> Any:
    """The ``transformers`` model a Hugging Face ``config.json`` (or a model directory
    holding one) describes, on the meta device, not yet wrapped by
    :class:`~editrain.models.hf.HFCausalLM`: validation tells transformers' refusal of the
    file apart from the adapter's (no transformer blocks where it looks for them).
    ``option``: where ``source`` came from (:func:`hf_option`), for messages."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM  # optional dependency

    from editrain.models.hf import read_hf_config

    data = dict(read_hf_config(source, option))
    hf_config = AutoConfig.for_model(data.pop("model_type"), **data)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config)


def tokenizer_source(cfg: Config) -> tuple[str | None, str | None, str | None]:
    """The tokenizer of the run: ``(tokenizer.json, model directory, end-of-text token)``.

    ``data.tokenizer`` is a ``tokenizer.json`` or a model directory holding one; unset, a
    ``model.init_from`` directory's tokenizer is used where it has one. A directory's
    ``tokenizer_config.json`` (or ``special_tokens_map.json``) names the end-of-text token;
    otherwise it is found among the usual names. ``(None, None, None)``: a BPE is trained.
    """
    path = cfg.data.tokenizer
    init = getattr(cfg.model, "init_from", None)
    if path is None and init is not None and tokenizer_file(init) is not None:
        path = init
    if path is None:
        return None, None, None
    found = tokenizer_file(path)
    if found is None:
        return str(path), None, None
    with as_config_error():  # a special token named by something other than its text
        return str(found), str(path), special_tokens(path).get("eos")
