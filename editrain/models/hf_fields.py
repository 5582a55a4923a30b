"""The numbers of a Hugging Face ``config.json``, each read by one strict rule.

A model directory, a ``model.hf_config`` file, a checkpoint's description of its model are
data a user hands over: a count must be a JSON integer in range (``true``, ``2.5``, ``2.0``,
``"4"``, ``[4]``, ``-1``, ``10**30`` are refused, never coerced by ``int()``), a real number
positive and finite (``1e400``, which JSON readers make infinite, is refused), a flag
``true`` or ``false``; ``null`` is the field not given, except where the model's
transformers config class requires a value (:func:`check_hf_nulls`: a ``null``
``num_hidden_layers`` is no default, it is a config transformers refuses). Every
refusal is one line naming the option, the file, the field, the value and what is allowed,
raised as the file is read, before anything is built from it. No torch here: ``editrain
data`` checks a configuration without importing it.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from editrain.safe_io import quote

__all__ = ["HF_COUNT_MAX", "HF_FLAG_KEYS", "HF_KEYS", "HF_LAYERS_MAX", "HF_POSITIVE_KEYS",
           "NULL_READ_PAST_DEFAULT", "NullReadPastDefault", "check_hf_nulls", "check_hf_numbers",
           "hf_count", "hf_flag", "hf_int", "hf_key", "hf_object", "hf_positive",
           "nulls_read_past_default"]

HF_KEYS = {"layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
           "hidden": ("hidden_size", "n_embd", "d_model"),
           "vocab": ("vocab_size",),
           "heads": ("num_attention_heads", "n_head", "num_heads", "n_heads"),
           "kv_heads": ("num_key_value_heads", "num_kv_heads", "n_head_kv", "n_kv_heads"),
           "positions": ("max_position_embeddings", "n_positions", "max_seq_len",
                         "max_sequence_length", "n_ctx")}
"""The names transformers' configs give the layer count, the width, the vocabulary, the
query and key/value heads and the longest sequence (GPT-2's ``n_layer``, ``n_head``,
``n_positions``...: what a config class's ``attribute_map`` maps the standard names to;
``n_layers`` and ``n_heads``: editrain's Llama, as a checkpoint's marker writes it)."""


HF_COUNT_MAX = 2**31 - 1
"""The largest count (width, vocabulary, heads, positions) a model's config may give: a
tensor of such sizes stays within torch's 64-bit element counts (the largest real values,
vocabularies of about 10**6 and windows of about 10**7, are far below), so that a hostile
``10**30`` is refused here, not by an overflow deep inside a build."""
HF_LAYERS_MAX = 10**5
"""The most layers a model's config may give: transformers builds a model layer by layer,
about a millisecond each even on the meta device, so a ``config.json`` without weights to
compare with (``model.hf_config``) claiming ``10**30`` would never finish validating (the
deepest models have about 10**2; :data:`editrain.plan.inputs.MAX_LAYERS` is the same)."""
HF_POSITIVE_KEYS = ("rope_theta", "rms_norm_eps", "initializer_range")
"""The real-valued fields editrain's Llama reads from a ``config.json`` (``rope_theta``
also inside ``rope_parameters``): positive and finite, where given."""
HF_FLAG_KEYS = ("tie_word_embeddings", "attention_bias", "mlp_bias")
"""The true/false fields editrain reads from a ``config.json``, where given."""
_NOT_GIVEN = "or null (not given)"


class NullReadPastDefault(NamedTuple):
    """A key a config class does not declare, whose null transformers' modeling code reads
    past its own default."""

    allowed: str
    """What the key holds (``"an integer"``, ``"a number"``, ``"true or false"``)."""
    model_types: tuple[str, ...] | None
    """The model types whose code reads it so; None: every model type."""
    rope_entry: str | None = None
    """The ``rope_parameters`` entry taken from the key where ``rope_parameters`` (or a
    transformers 4 file's ``rope_scaling``) does not give it; where it does, the key is
    never read and its null is harmless."""


_ROPE_MODELS = ("falcon", "gemma", "gemma2", "granite", "llama", "mistral", "mixtral", "olmo2",
                "phi", "phi3", "qwen2", "qwen2_moe", "qwen3", "stablelm", "starcoder2")
NULL_READ_PAST_DEFAULT = {
    "is_causal": NullReadPastDefault("true or false", None),
    "head_dim": NullReadPastDefault("an integer", ("falcon", "granite", "olmo2", "phi", "phi3",
                                                   "qwen2", "qwen2_moe")),
    "rope_theta": NullReadPastDefault("a number", _ROPE_MODELS, "rope_theta"),
    "partial_rotary_factor": NullReadPastDefault("a number", ("phi", "phi3", "stablelm"),
                                                 "partial_rotary_factor"),
    "rotary_pct": NullReadPastDefault("a number", ("gpt_neox",), "partial_rotary_factor"),
    "rotary_emb_base": NullReadPastDefault("a number", ("gpt_neox",), "rope_theta"),
}
"""The keys (in a ``config.json``, undeclared by the model's config class, so kept as an
attribute, null included) whose null transformers 5.24 reads past its own default, by
model type. A key the class does not declare reaches the modeling code as an attribute:
``getattr(config, "head_dim", None) or hidden_size // heads`` reads a None as the default,
but ``getattr(config, "head_dim", hidden_size // heads)`` (a Qwen2's attention) returns the
None itself, which ends in ``None ** x``; ``not getattr(config, "is_causal", True)`` (the
mask of every family, ``masking_utils``) reads a None as "not causal", attention that sees
the future; a RoPE base or fraction taken from the key where ``rope_parameters`` does not
give it becomes None. A null read as the default (a GPT-2's ``head_dim``, a Llama's
``partial_rotary_factor``, ``attention_bias`` where the class does not declare it) is kept.
tests/test_hostile_hf_numbers.py checks the table against tiny models of each family."""


def hf_count(data: dict[str, Any], key: str, where: str, least: int = 1,
             most: int = HF_COUNT_MAX) -> int | None:
    """``data[key]`` as a count: None where the field is absent or null; else it must be a
    JSON integer from ``least`` to ``most``. A bool is no count (``true`` is not 1), and
    neither is a float, not even ``2.0`` (transformers' own configs refuse it too) or a
    string (``"4"``): a count is never coerced.

    Raises:
        ValueError: ``"WHERE: KEY is VALUE; expected an integer from LEAST to MOST, or
            null (not given)"``.
    """
    value = data.get(key)
    if value is None:
        return None
    if type(value) is not int or not least <= value <= most:
        raise ValueError(f"{where}: {key} is {quote(value)}; expected an integer from "
                         f"{least} to {most:,}, {_NOT_GIVEN}")
    return value


def hf_positive(data: dict[str, Any], key: str, where: str) -> float | None:
    """``data[key]`` as a positive finite number (a JSON integer or fraction, never a
    bool or a string; ``1e400``, which JSON readers make infinite, is refused), or None
    where the field is absent or null.

    Raises:
        ValueError: one line naming ``where``, ``key``, the value and what is allowed.
    """
    value = data.get(key)
    if value is None:
        return None
    if type(value) not in (int, float) or not 0 < value < math.inf:
        raise ValueError(f"{where}: {key} is {quote(value)}; expected a positive finite "
                         f"number, {_NOT_GIVEN}")
    return float(value)


def hf_flag(data: dict[str, Any], key: str, where: str) -> bool | None:
    """``data[key]`` as ``true`` or ``false`` (``0``, ``1`` or ``"false"`` is no flag), or
    None where the field is absent or null.

    Raises:
        ValueError: one line naming ``where``, ``key``, the value and what is allowed.
    """
    value = data.get(key)
    if value is None or type(value) is bool:
        return value
    raise ValueError(f"{where}: {key} is {quote(value)}; expected true or false, {_NOT_GIVEN}")


def hf_object(data: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    """``data[key]`` as a JSON object, ``{}`` where the field is absent or null.

    Raises:
        ValueError: one line naming ``where``, ``key``, the value and what is allowed.
    """
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{where}: {key} is {quote(value)}; expected a JSON object, "
                         f"{_NOT_GIVEN}")
    return value


def check_hf_numbers(data: dict[str, Any], where: str) -> None:
    """Every number of a ``config.json`` (or a checkpoint's description of its model) that
    editrain reads, checked by one rule before anything is built from it: each spelling
    of :data:`HF_KEYS`, ``intermediate_size`` and ``head_dim`` by :func:`hf_count` (layers
    up to :data:`HF_LAYERS_MAX`), :data:`HF_POSITIVE_KEYS` by :func:`hf_positive`,
    :data:`HF_FLAG_KEYS` by :func:`hf_flag`, and ``rope_parameters`` / ``rope_scaling``
    must be objects.

    Raises:
        ValueError: one line naming ``where`` (the option and the file), the field, its
            value and what is allowed.
    """
    for kind, keys in HF_KEYS.items():
        for key in keys:
            hf_count(data, key, where, most=HF_LAYERS_MAX if kind == "layers" else HF_COUNT_MAX)
    for key in ("intermediate_size", "head_dim"):
        hf_count(data, key, where)
    for key in HF_POSITIVE_KEYS:
        hf_positive(data, key, where)
    for key in HF_FLAG_KEYS:
        hf_flag(data, key, where)
    for key in ("rope_parameters", "rope_scaling"):
        hf_positive(hf_object(data, key, where), "rope_theta", f"{where}: {key}")


def check_hf_nulls(data: dict[str, Any], where: str, required: dict[str, str],
                   owner: str) -> None:
    """Refuse a ``null`` where the model's transformers config class requires a value.

    transformers' config classes are strict dataclasses: a field absent from the file
    takes the class's default, but a ``null`` one is passed as None, which a field typed
    ``int`` refuses (``Qwen2Config``'s ``num_hidden_layers``), only once the model is
    built, in transformers' own words. Fields the class types as optional
    (``sliding_window``, ``num_key_value_heads``, ``rope_parameters``) keep their ``null``.

    Args:
        data: the file's contents.
        where: the option and the file, for the message.
        required: the fields (and the names the class's ``attribute_map`` gives them) the
            class requires a number or flag for, each with what it is typed as
            (``"an integer"``, ``"a number"``, ``"true or false"``).
        owner: the class's name, for the message.

    Raises:
        ValueError: ``"WHERE: KEY is null, which OWNER does not take; expected ..."``, in
            the words of :func:`hf_count` / :func:`hf_positive` / :func:`hf_flag` for the
            fields editrain reads, in the class's type otherwise.
    """
    for key, typed in required.items():
        if key in data and data[key] is None:
            raise ValueError(f"{where}: {key} is null, which {owner} does not take; "
                             f"expected {_allowed(key, typed)}")


def nulls_read_past_default(data: dict[str, Any]) -> dict[str, str]:
    """The null keys of ``data`` (a ``config.json``'s contents, with its ``model_type``)
    that :data:`NULL_READ_PAST_DEFAULT` says transformers reads past its default for that
    model type, each with what it holds (the ``required`` of :func:`check_hf_nulls`)."""
    rope = data.get("rope_scaling") or data.get("rope_parameters")  # transformers' order
    rope = rope if isinstance(rope, dict) else {}
    found = {}
    for key, read in NULL_READ_PAST_DEFAULT.items():
        if key not in data or data[key] is not None:
            continue
        if read.model_types is not None and data.get("model_type") not in read.model_types:
            continue
        if read.rope_entry is not None and rope.get(read.rope_entry) is not None:
            continue
        found[key] = read.allowed
    return found


def _allowed(key: str, typed: str) -> str:
    """What :func:`check_hf_numbers` allows in ``key`` (its null aside), or ``typed``."""
    if key in HF_KEYS["layers"]:
        return f"an integer from 1 to {HF_LAYERS_MAX:,}"
    if key in ("intermediate_size", "head_dim") or any(key in keys for keys in HF_KEYS.values()):
        return f"an integer from 1 to {HF_COUNT_MAX:,}"
    if key in HF_POSITIVE_KEYS:
        return "a positive finite number"
    if key in HF_FLAG_KEYS:
        return "true or false"
    return typed


def hf_key(data: dict[str, Any], kind: str) -> str | None:
    """The first of ``HF_KEYS[kind]`` that ``data`` gives (a value other than null), or
    None."""
    return next((key for key in HF_KEYS[kind] if data.get(key) is not None), None)


def hf_int(data: dict[str, Any], kind: str, where: str = "config.json") -> int:
    """The count of ``kind`` (:data:`HF_KEYS`) that ``data`` gives, checked by
    :func:`hf_count`, else 0 (the config does not say).

    Raises:
        ValueError: the field :func:`hf_key` finds is no count (names ``where``).
    """
    key = hf_key(data, kind)
    if key is None:
        return 0
    return hf_count(data, key, where,
                    most=HF_LAYERS_MAX if kind == "layers" else HF_COUNT_MAX) or 0
