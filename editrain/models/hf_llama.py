"""editrain's Llama and Hugging Face's ``LlamaForCausalLM``: parameter names and configs.

Both models use the same rotary convention: channel ``i`` of a head is rotated together with
channel ``i + E/2`` ("rotate half", :func:`editrain.models.llama.apply_rope` and
transformers' ``rotate_half``), the query and key rows of a head are laid out alike, so the
map is a renaming only: no row of ``q_proj`` or ``k_proj`` is permuted, and a weight crosses
it unchanged (tests/test_hf_io.py checks the logits of both models on the same weights).
A checkpoint in Meta's original layout (interleaved pairs) would need a permutation; a
``save_pretrained`` directory never is in that layout.
"""

from __future__ import annotations

import re
from typing import Any

from editrain.models.hf_fields import (
    HF_COUNT_MAX,
    HF_LAYERS_MAX,
    check_hf_nulls,
    hf_count,
    hf_flag,
    hf_object,
    hf_positive,
    nulls_read_past_default,
)
from editrain.models.llama_config import ROPE_SCALING_KEYS, LlamaConfig, check_rope_scaling
from editrain.safe_io import quote

__all__ = [
    "LLAMA_ARCHITECTURE",
    "LLAMA_REQUIRED",
    "from_hf_name",
    "is_llama_config",
    "llama_config_from_hf",
    "llama_config_to_hf",
    "to_hf_name",
]

LLAMA_ARCHITECTURE = "LlamaForCausalLM"
"""The Hugging Face class whose checkpoints editrain's own Llama reads and writes."""
_INTEGER, _NUMBER, _FLAG = "an integer", "a number", "true or false"
LLAMA_REQUIRED = {
    "vocab_size": _INTEGER, "hidden_size": _INTEGER, "intermediate_size": _INTEGER,
    "num_hidden_layers": _INTEGER, "num_attention_heads": _INTEGER,
    "max_position_embeddings": _INTEGER, "initializer_range": _NUMBER, "rms_norm_eps": _NUMBER,
    "tie_word_embeddings": _FLAG, "attention_bias": _FLAG, "mlp_bias": _FLAG,
    "use_cache": _FLAG,
}
"""The fields transformers' ``LlamaConfig`` types as a number or a flag without None and
refuses a None in (what :func:`editrain.models.hf.required_fields` reads from the class; a
test checks they are the same; ``chunk_size_feed_forward`` and ``is_encoder_decoder``,
typed so by ``PretrainedConfig``, take a None): editrain's own reader works without transformers, and refuses a ``null`` in
them as the class does, so that one file means one thing to both (a null
``max_position_embeddings`` is no default 2048 here when transformers refuses it)."""

# editrain name inside a block -> Hugging Face name inside ``model.layers.<i>``.
_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_BLOCK_BACK = {hf: own for own, hf in _BLOCK.items()}
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_TOP_BACK = {hf: own for own, hf in _TOP.items()}
_OWN_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _rename(name: str, top: dict[str, str], layer: re.Pattern[str], block: dict[str, str],
            form: str, refusal: str) -> str:
    if name in top:
        return top[name]
    m = layer.fullmatch(name)
    if m is None or m.group(2) not in block:
        raise KeyError(refusal.format(name))
    return form.format(m.group(1), block[m.group(2)])


def to_hf_name(name: str) -> str:
    """The ``LlamaForCausalLM`` name of one of editrain's Llama parameters.

    Args:
        name: a parameter name of :class:`editrain.models.Llama` (also of a pipeline stage
            of it, which keeps the model's names), e.g. ``layers.3.attention.wq.weight``.

    Raises:
        KeyError: not a parameter name of the Llama.
    """
    return _rename(name, _TOP, _OWN_LAYER, _BLOCK, "model.layers.{}.{}",
                   "not a parameter of editrain's Llama: {!r}")


def from_hf_name(name: str) -> str:
    """editrain's Llama name of a ``LlamaForCausalLM`` parameter (the inverse of
    :func:`to_hf_name`).

    Raises:
        KeyError: a name the Llama has no parameter for (e.g. a bias).
    """
    return _rename(name, _TOP_BACK, _HF_LAYER, _BLOCK_BACK, "layers.{}.{}",
                   "no parameter of editrain's Llama is named {!r} in Hugging Face")


def is_llama_config(data: dict[str, Any]) -> bool:
    """Whether a ``config.json``'s contents describe a ``LlamaForCausalLM``."""
    archs = data.get("architectures") or [LLAMA_ARCHITECTURE]
    # a list by transformers' convention; any other value is no Llama's (transformers
    # then judges the file), never a traceback here
    return data.get("model_type") == "llama" and archs == [LLAMA_ARCHITECTURE]


def _rope_theta(data: dict[str, Any], params: dict[str, Any], where: str) -> float:
    # transformers 5 keeps it in rope_parameters, 4.x at the top level.
    theta = hf_positive(params, "rope_theta", f"{where}: rope_parameters")
    return theta or hf_positive(data, "rope_theta", where) or 10000.0


def _rope_params(data: dict[str, Any], where: str) -> dict[str, Any]:
    """``rope_parameters`` (transformers 5), else ``rope_scaling`` (4.x), else ``{}``."""
    return (hf_object(data, "rope_parameters", where)
            or hf_object(data, "rope_scaling", where))


def _required(data: dict[str, Any], key: str, where: str, most: int = HF_COUNT_MAX) -> int:
    """A count the Llama's shape cannot do without (:func:`hf_count`)."""
    count = hf_count(data, key, where, most=most)
    if count is None:  # absent: a null one is refused first (LLAMA_REQUIRED)
        raise ValueError(f"{where}: no {key} field (an integer from 1 to {most:,})")
    return count


def llama_config_from_hf(data: dict[str, Any], where: str = "config.json") -> LlamaConfig:
    """The :class:`LlamaConfig` of a ``LlamaForCausalLM`` ``config.json``.

    Only what editrain's Llama computes is accepted: SiLU, no attention or MLP bias, plain
    RoPE or Llama 3's scaling of it (``rope_type = "llama3"``), ``head_dim = hidden_size /
    num_attention_heads``. Every number is read by the strict rules of
    :mod:`editrain.models.hf_fields` (``true`` is no layer count, ``2.5`` no width, ``"4"``
    no head count, ``1e400`` no epsilon); a field absent or ``null`` takes transformers'
    default for a Llama (``num_key_value_heads``: ``num_attention_heads``), except where
    ``LlamaConfig`` refuses a null (:data:`LLAMA_REQUIRED`) or reads it past its default
    (:func:`~editrain.models.hf_fields.nulls_read_past_default`: ``is_causal``, a
    ``rope_theta`` that ``rope_parameters`` does not give): refused as transformers would.

    Args:
        data: the file's contents.
        where: the file or option, for messages.

    Raises:
        ValueError: one line naming ``where`` and the field editrain's Llama cannot follow.
    """
    def bad(field: str, why: str) -> ValueError:
        return ValueError(f"{where}: {field} {why}; editrain's Llama cannot load it")

    check_hf_nulls(data, where, {**LLAMA_REQUIRED, **nulls_read_past_default(data)},
                   "LlamaConfig")
    act = data.get("hidden_act", "silu")
    if act != "silu":
        raise bad("hidden_act", f"is {quote(act)}, not {quote('silu')}")
    for flag in ("attention_bias", "mlp_bias"):
        if hf_flag(data, flag, where):
            raise bad(flag, "is true")
    params = _rope_params(data, where)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise bad("rope_parameters", f"has rope_type {quote(rope_type)} (only the default "
                  "RoPE and llama3's scaling of it)")
    scaling = None
    if rope_type == "llama3":
        for key in ROPE_SCALING_KEYS:  # each by the strict reader, the set as Llama 3's
            if hf_positive(params, key, f"{where}: rope_parameters") is None:
                raise bad(f"rope_parameters.{key}", "is null or not given (llama3's RoPE "
                          "scaling needs it)")
        try:
            scaling = check_rope_scaling({k: params.get(k) for k in ROPE_SCALING_KEYS})
        except ValueError as e:
            raise ValueError(f"{where}: rope_parameters (llama3): {e}") from None
    heads = _required(data, "num_attention_heads", where)
    shape = dict(vocab_size=_required(data, "vocab_size", where),
                 dim=_required(data, "hidden_size", where),
                 n_layers=_required(data, "num_hidden_layers", where, most=HF_LAYERS_MAX),
                 n_heads=heads,
                 n_kv_heads=hf_count(data, "num_key_value_heads", where) or heads,
                 ffn_hidden=_required(data, "intermediate_size", where),
                 max_seq_len=hf_count(data, "max_position_embeddings", where) or 2048)
    try:
        cfg = LlamaConfig(
            **shape, rope_theta=_rope_theta(data, params, where), rope_scaling=scaling,
            norm_eps=hf_positive(data, "rms_norm_eps", where) or 1e-6,
            tie_embeddings=bool(hf_flag(data, "tie_word_embeddings", where)),
            init_std=hf_positive(data, "initializer_range", where) or 0.02)
    except ValueError as e:  # a combination: heads that do not divide the width
        raise ValueError(f"{where}: {e}") from None
    head_dim = hf_count(data, "head_dim", where)
    if head_dim is not None and head_dim != cfg.head_dim:
        raise bad("head_dim", f"is {head_dim}, not hidden_size / num_attention_heads = "
                  f"{cfg.head_dim}")
    return cfg


def llama_config_to_hf(cfg: LlamaConfig, **extra: Any) -> dict[str, Any]:
    """A ``config.json`` for ``LlamaForCausalLM`` with the architecture of ``cfg`` (the
    inverse of :func:`llama_config_from_hf` on the fields both have).

    Args:
        cfg: the Llama's configuration.
        **extra: further fields (e.g. ``bos_token_id``, ``eos_token_id``).
    """
    data: dict[str, Any] = {
        "architectures": [LLAMA_ARCHITECTURE],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        # transformers 4 reads the scaling from rope_scaling, 5 from rope_parameters
        **({"rope_parameters": {"rope_type": "llama3", "rope_theta": cfg.rope_theta,
                                **cfg.rope_scaling},
            "rope_scaling": {"rope_type": "llama3", **cfg.rope_scaling}}
           if cfg.rope_scaling else {}),
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    data.update(extra)
    return data
