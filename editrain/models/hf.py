"""Hugging Face adapter: train a ``transformers`` causal LM from a ``config.json``.

The model is built from scratch with ``AutoModelForCausalLM.from_config`` (no weights are
downloaded) and wrapped so that it looks like editrain's own Llama to the trainer:
``model(tokens)`` returns logits ``[B, T, V]`` and ``model.blocks()`` lists the transformer
blocks (found by :func:`editrain.units.find_blocks`, e.g. ``model.model.layers``).

``transformers`` is an optional dependency: ``pip install 'editrain[hf]'``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from editrain.models.hf_dir import check_hf_numbers, hf_key
from editrain.models.hf_fields import check_hf_nulls, nulls_read_past_default
from editrain.paths import shown
from editrain.safe_io import read_json_value
from editrain.units import BLOCK_PATHS, find_blocks

INSTALL_HINT = "pip install 'editrain[hf]' (or pip install transformers)"
HF_CONFIG = "model.hf_config"
"""The option a ``config.json`` comes from unless told otherwise: the Python API's calls
(:meth:`HFCausalLM.from_config_file`) take a file as ``model.hf_config`` does. Callers that
read a ``model.init_from`` directory's say so (``option``), so that every message names
the option the user set."""


def transformers_available() -> bool:
    """Whether the ``transformers`` package can be imported (without importing it)."""
    return importlib.util.find_spec("transformers") is not None


def config_path(path: str | Path, option: str = HF_CONFIG) -> Path:
    """The ``config.json`` named by ``path`` (the file itself, or a directory holding one).

    Args:
        path: a JSON file or a model directory.
        option: where ``path`` came from, for the message (``model.init_from``...).

    Raises:
        FileNotFoundError: neither exists.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"{option}: file not found: {shown(p)}")
    return p


def read_hf_config(path: str | Path, option: str = HF_CONFIG) -> dict[str, Any]:
    """The raw contents of a Hugging Face ``config.json`` (plain JSON, no transformers import).

    Args:
        path: the file, or a directory holding ``config.json``.
        option: where ``path`` came from (``model.hf_config``, ``model.init_from``): every
            message starts with it, then the file.

    Raises:
        FileNotFoundError: the file is missing.
        ValueError: it is not a JSON object with a ``model_type``, or a number editrain
            reads from it is not one (:func:`~editrain.models.hf_dir.check_hf_numbers`).
    """
    p = config_path(path, option)
    try:
        text = p.read_bytes()
    except OSError as e:
        raise ValueError(f"{option}: {shown(p)}: cannot read it ({e.strerror})") from None
    data = read_json_value(text, f"{option}: {shown(p)}", error=ValueError)
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise ValueError(f"{option}: {shown(p)} has no \"model_type\" (e.g. \"llama\"); it must "
                         "be a Hugging Face config.json")
    check_hf_numbers(data, f"{option}: {shown(p)}")
    return data


NUMBER_TYPES = {"int": "an integer", "float": "a number", "bool": "true or false"}
"""The annotations of a transformers config field that hold a number or a flag, and what
a message says each allows."""


@functools.cache
def required_fields(model_type: str) -> tuple[str, dict[str, str]] | None:
    """``(class name, {field: what it allows})`` of the fields the transformers config class
    of ``model_type`` types as a number or a flag without None (``num_hidden_layers: int``,
    not ``sliding_window: int | None``) and refuses a None in, with the other names its
    ``attribute_map`` gives them (GPT-2's ``hidden_size`` for ``n_embd``: a null there
    lands in the field the model is built from); None where transformers has no such
    model type (its own refusal follows, naming it).

    Read from the class's dataclass fields, so that every architecture is judged by its
    own class, not by a list of ours: ``head_dim`` is optional for a Llama, required for a
    Gemma. The typing alone says too much: fields the class inherits from
    ``PretrainedConfig`` are typed ``int`` or ``bool`` (``chunk_size_feed_forward``,
    ``is_encoder_decoder``) yet transformers 5.24 takes their None and builds the model,
    so a field counts only where building the class with it None fails
    (:func:`_refuses_null`). Cached: one class is asked once per process."""
    from transformers import CONFIG_MAPPING  # optional dependency, checked by callers

    if model_type not in CONFIG_MAPPING:
        return None
    cls = CONFIG_MAPPING[model_type]
    if not dataclasses.is_dataclass(cls):
        return None
    required = {}
    for field in dataclasses.fields(cls):
        allowed = _number_without_null(field.type)
        if allowed is not None and _refuses_null(cls, field.name):
            required[field.name] = allowed
    for alias, name in (getattr(cls, "attribute_map", None) or {}).items():
        if name in required:
            required[alias] = required[name]
    return cls.__name__, required


def _refuses_null(cls: type, name: str) -> bool:
    """Whether the transformers config class ``cls`` refuses ``name=None`` (as a
    ``config.json``'s ``null`` reaches it). A class that cannot be built from its defaults
    alone cannot be asked: its typing is taken at its word."""
    try:
        cls()
    except Exception:  # noqa: BLE001 - any failure: the question cannot be asked
        return True
    try:
        cls(**{name: None})
    except Exception:  # noqa: BLE001 - transformers' refusal (a validation or type error)
        return True
    return False


def _number_without_null(annotation: Any) -> str | None:
    """What a field typed ``annotation`` allows where it is a number or a flag that admits
    no None (``int``, ``float | int``), else None. transformers writes most annotations
    as text (``"int | None"``), some as types: both are read as the text of a union."""
    text = annotation.__name__ if isinstance(annotation, type) else str(annotation)
    parts = [part.strip() for part in text.split("|")]
    if any(part in ("None", "NoneType", "Any", "typing.Any") or part.startswith(
            ("Optional", "typing.Optional")) for part in parts):
        return None
    kinds = [NUMBER_TYPES[part] for part in parts if part in NUMBER_TYPES]
    return " or ".join(dict.fromkeys(kinds)) if kinds else None


def check_required_fields(data: dict[str, Any], where: str) -> None:
    """Refuse a ``null`` where the file's transformers config class requires a number or a
    flag (:func:`~editrain.models.hf_fields.check_hf_nulls`, the fields of
    :func:`required_fields`), or where its modeling code reads a key the class does not
    declare past its default (:func:`~editrain.models.hf_fields.nulls_read_past_default`:
    a Qwen2's ``head_dim``, every family's ``is_causal``), before transformers builds
    anything from it.

    Args:
        data: the ``config.json``'s contents (with its ``model_type``).
        where: the option and the file, for the message.

    Raises:
        ValueError: one line naming ``where``, the field and what is allowed.
    """
    found = required_fields(data["model_type"])
    if found is not None:
        owner, required = found
        check_hf_nulls(data, where, {**required, **nulls_read_past_default(data)}, owner)


def check_hf_config(path: str | Path, seq_len: int | None = None,
                    option: str = HF_CONFIG) -> None:
    """Validate ``model.hf_config`` before any process starts (cheap: transformers is only
    looked up, not imported).

    Args:
        path: the ``config.json`` (or a directory holding one).
        seq_len: the training sequence length, checked against the model's longest
            sequence (``max_position_embeddings``, GPT-2's ``n_positions``...).
        option: where ``path`` came from (``model.hf_config``, ``model.init_from``).

    Raises:
        FileNotFoundError: the file is missing.
        ValueError: bad JSON, no ``model_type``, a too-long ``seq_len``, or ``transformers``
            is not installed.
    """
    data = read_hf_config(path, option)
    if not transformers_available():
        raise ValueError(f"{option} needs the transformers package: {INSTALL_HINT}")
    key = hf_key(data, "positions")
    if seq_len is not None and key is not None and seq_len > data[key]:
        # a pretrained model's positions are what it learned: only a new model may have more
        how = "raise it there or lower" if option == HF_CONFIG else "lower"
        raise ValueError(f"train.seq_len: {seq_len} exceeds {key} = {data[key]} of {option} "
                         f"{shown(path)} ({how} train.seq_len)")


def check_vocab(hf_vocab_size: int, tokenizer_vocab_size: int, path: str | Path = "",
                option: str = HF_CONFIG) -> None:
    """The model's embedding table must cover every token id the tokenizer can produce.

    Args:
        hf_vocab_size: ``vocab_size`` of the Hugging Face config.
        tokenizer_vocab_size: the tokenizer's vocabulary size.
        path: the config file, for the message.
        option: where the config came from, for the message.

    Raises:
        ValueError: the model's vocabulary is smaller than the tokenizer's.
    """
    if hf_vocab_size < tokenizer_vocab_size:
        raise ValueError(
            f"{option}: vocab_size {hf_vocab_size} in {shown(path) if path else 'the config'} "
            f"is smaller than the tokenizer's vocabulary ({tokenizer_vocab_size}); set "
            f"vocab_size to at "
            f"least {tokenizer_vocab_size}, or lower data.vocab_size"
        )


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM seen through editrain's model interface.

    Args:
        hf_model: a ``transformers`` model whose output has ``.logits`` (any
            ``AutoModelForCausalLM`` model). Its parameters keep their Hugging Face names
            under the ``hf.`` prefix.
    """

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        self.hf = hf_model
        self._blocks = find_blocks(hf_model)

    @classmethod
    def checked(cls, hf_model: nn.Module, where: str) -> HFCausalLM:
        """The adapter around ``hf_model``, or why editrain cannot train (or sample) it.

        Args:
            hf_model: the model transformers built from a config.
            where: the option (or command) and file it came from
                (``model.hf_config: PATH``, ``sample: DIR``).

        Raises:
            ValueError: one line starting with ``where``: the model keeps its layers in
                none of :data:`~editrain.units.BLOCK_PATHS` (Mamba, BERT), where the
                command line, unlike the Python API, cannot name them.
        """
        try:
            return cls(hf_model)
        except ValueError:
            paths = ", ".join(BLOCK_PATHS[1:])  # the first, "layers", is editrain's Llama's
            raise ValueError(
                f"{where} describes a {type(hf_model).__name__}, whose layers are in none of "
                f"the places editrain looks for a causal LM's transformer blocks ({paths}); "
                f"editrain trains the architectures laid out that way (Llama, Qwen2, "
                f"Mistral, Gemma, Phi-3, GPT-2, OPT, Falcon, GPT-NeoX...), syncing block by "
                f"block") from None

    @property
    def config(self) -> Any:
        """The wrapped model's ``transformers`` config."""
        return self.hf.config

    def blocks(self) -> list[nn.Module]:
        """The transformer blocks in forward order (e.g. ``hf.model.layers``)."""
        return list(self._blocks)

    def forward(self, tokens: Tensor) -> Tensor:
        """Next-token logits.

        Args:
            tokens: token ids ``[B, T]`` (int64).

        Returns:
            Logits ``[B, T, V]`` (V is the config's ``vocab_size``).
        """
        # No KV cache: this is training, a cache only costs memory.
        return self.hf(input_ids=tokens, use_cache=False).logits

    @classmethod
    def from_config_file(cls, path: str | Path, tokenizer_vocab_size: int | None = None,
                         seed: int = 0, option: str = HF_CONFIG) -> HFCausalLM:
        """Build a freshly initialised model from a ``config.json`` (identical on every rank).

        Args:
            path: the config file (or a directory holding ``config.json``).
            tokenizer_vocab_size: when given, checked against the config's ``vocab_size``.
            seed: seed of the initial weights; the global RNG state is left untouched.
            option: where ``path`` came from (``model.init_from``...), named by every
                message.

        Raises:
            ImportError: ``transformers`` is not installed.
            ValueError: a bad config, or a vocabulary smaller than the tokenizer's.
        """
        return cls.from_config_dict(read_hf_config(path, option), tokenizer_vocab_size, seed,
                                    path, option)

    @classmethod
    def from_config_dict(cls, data: dict[str, Any], tokenizer_vocab_size: int | None = None,
                         seed: int = 0, path: str | Path = "",
                         option: str = HF_CONFIG) -> HFCausalLM:
        """:meth:`from_config_file` of a ``config.json``'s contents (``option`` and ``path``
        name it in messages)."""
        try:
            from transformers import AutoConfig, AutoModelForCausalLM
        except ImportError as e:
            raise ImportError(f"{option} needs the transformers package: "
                              f"{INSTALL_HINT}") from e
        check_required_fields(data, f"{option}: {shown(path) if path else 'the config'}")
        data = dict(data)
        data.pop("transformers_version", None)
        model_type = data.pop("model_type")
        hf_config = AutoConfig.for_model(model_type, **data)
        if tokenizer_vocab_size is not None:
            check_vocab(int(hf_config.vocab_size), tokenizer_vocab_size, path, option)
        # Every replica must start from the same weights: seed a private RNG fork.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            hf_model = AutoModelForCausalLM.from_config(hf_config)
        # Parameters (and so anchors) stay fp32; bf16 compute comes from FSDP2's policy.
        return cls.checked(hf_model.float(),
                           f"{option}: {shown(path) if path else 'the config'}")


__all__ = [
    "HFCausalLM",
    "HF_CONFIG",
    "INSTALL_HINT",
    "check_hf_config",
    "check_required_fields",
    "check_vocab",
    "config_path",
    "read_hf_config",
    "required_fields",
    "transformers_available",
]
