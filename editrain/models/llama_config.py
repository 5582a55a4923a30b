"""The Llama model's shape: :class:`LlamaConfig`, the named presets and :func:`preset_config`.

No torch here: the configuration checks a model's shape (``train.seq_len`` against its
maximum) in commands that never build one (``editrain data``). :mod:`editrain.models.llama`
builds the model from these.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from editrain.errors import plain_count, plain_scalar, require, spelled

ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                     "original_max_position_embeddings")
"""The fields of Llama 3's RoPE scaling (``rope_type = "llama3"`` in a ``config.json``)."""


def check_rope_scaling(scaling: object) -> dict[str, float]:
    """Llama 3's RoPE scaling as :class:`LlamaConfig` keeps it: exactly
    :data:`ROPE_SCALING_KEYS`, positive numbers, ``high_freq_factor > low_freq_factor``.

    Raises:
        ValueError: naming ``rope_scaling`` and what is wrong.
    """
    if not isinstance(scaling, dict) or set(scaling) != set(ROPE_SCALING_KEYS):
        raise ValueError(f"rope_scaling must hold exactly {', '.join(ROPE_SCALING_KEYS)}, got "
                         f"{spelled(sorted(scaling) if isinstance(scaling, dict) else scaling)}")
    out = {}
    for key in ROPE_SCALING_KEYS:
        value = scaling[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"rope_scaling.{key} must be a positive number, got {spelled(value)}")
        out[key] = float(value)
    length = out["original_max_position_embeddings"]
    if length != int(length):
        raise ValueError("rope_scaling.original_max_position_embeddings must be a whole "
                         f"number of positions, got {length}")
    out["original_max_position_embeddings"] = int(length)
    if not out["high_freq_factor"] > out["low_freq_factor"]:
        raise ValueError("rope_scaling.high_freq_factor must exceed low_freq_factor, got "
                         f"{out['high_freq_factor']} and {out['low_freq_factor']}")
    return out


# kw_only lets the fields appear in their natural order (vocab first) while
# the architecture-defining fields stay required; there is no sensible
# default width or depth, so forcing callers to pick one (or a preset) avoids
# silently training a model nobody asked for.
@dataclass(kw_only=True)
class LlamaConfig:
    """Hyper-parameters that fully determine a Llama model's architecture.

    Args:
        vocab_size: Number of token ids the embedding and output layers cover.
        dim: Model (residual stream) width.
        n_layers: Number of transformer blocks.
        n_heads: Number of query heads; must divide ``dim``.
        n_kv_heads: Number of key/value heads for grouped-query attention;
            must divide ``n_heads``.
        ffn_hidden: Hidden width of the SwiGLU feed-forward network.
        max_seq_len: Longest sequence the model accepts (RoPE table length).
        rope_theta: Base of the RoPE frequency schedule.
        rope_scaling: Llama 3's scaling of the RoPE frequencies (``factor``,
            ``low_freq_factor``, ``high_freq_factor``,
            ``original_max_position_embeddings``; see
            :func:`editrain.models.llama.precompute_rope`), or None: plain RoPE.
        norm_eps: Epsilon added inside the RMSNorm square root.
        tie_embeddings: Reuse the token embedding matrix as output projection.
        init_std: Standard deviation of the normal weight initialisation.

    Raises:
        ValueError: If any field is out of range or the head layout is invalid.
    """

    vocab_size: int = 8192
    """Vocabulary size (number of distinct token ids)."""
    dim: int
    """Model width D; must be divisible by n_heads."""
    n_layers: int
    """Number of transformer blocks."""
    n_heads: int
    """Number of query attention heads."""
    n_kv_heads: int
    """Number of key/value heads (grouped-query attention); must divide n_heads."""
    ffn_hidden: int
    """Hidden size of the SwiGLU feed-forward network."""
    max_seq_len: int
    """Maximum sequence length the model accepts."""
    rope_theta: float = 10000.0
    """Base frequency of the rotary position embedding."""
    rope_scaling: dict[str, float] | None = None
    """Llama 3's scaling of the RoPE frequencies, or None (plain RoPE)."""
    norm_eps: float = 1e-5
    """Epsilon used by RMSNorm for numerical stability."""
    tie_embeddings: bool = True
    """Share the token embedding matrix with the output projection."""
    init_std: float = 0.02
    """Standard deviation of the normal weight initialisation."""

    def __post_init__(self) -> None:
        # Each field's type and range by the one check of every option (errors.plain_scalar:
        # numpy scalars, as a shape computed with numpy gives them, are stored as plain
        # numbers; True is no width, 64.0 no count), worded "FIELD: must be >= 1, got 0".
        # A ConfigError names one field; the combinations below raise a plain ValueError.
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden",
                     "max_seq_len"):
            setattr(self, name, plain_count(getattr(self, name), name))
        for name in ("rope_theta", "norm_eps", "init_std"):
            value = plain_scalar(getattr(self, name), float, name)
            require(value > 0, name, f"must be > 0, got {value}")
            setattr(self, name, value)
        if self.rope_scaling is not None:
            self.rope_scaling = check_rope_scaling(self.rope_scaling)
        self.tie_embeddings = plain_scalar(self.tie_embeddings, bool, "tie_embeddings")
        if self.dim % self.n_heads != 0:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"head_dim = dim // n_heads = {self.head_dim} must be even for RoPE; "
                f"change dim ({self.dim}) or n_heads ({self.n_heads})"
            )

    @property
    def head_dim(self) -> int:
        """Per-head width E = dim // n_heads."""
        return self.dim // self.n_heads


# Named shapes. "tiny" and "small" are for CPU tests/demos; the rest follow
# common Llama shapes at the sizes used in the EDiT paper (350M, 1B, 3B, 7B).
# Parameter counts (embeddings included):
#   tiny  ~0.60M at vocab 8192 (tied embeddings alone are 8192*64 = 524k)
#   small ~5.0M  at vocab 8192
#   350m  ~341M, 1b ~1.10B, 3b ~3.02B, 7b ~6.74B at vocab 32000
PRESETS: dict[str, dict] = {
    "tiny": dict(
        vocab_size=8192,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=128,
        max_seq_len=256,
    ),
    "small": dict(
        vocab_size=8192,
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        ffn_hidden=688,
        max_seq_len=512,
    ),
    "350m": dict(
        vocab_size=32000,
        dim=1024,
        n_layers=24,
        n_heads=16,
        n_kv_heads=16,
        ffn_hidden=2816,
        max_seq_len=4096,
        tie_embeddings=True,
    ),
    "1b": dict(
        vocab_size=32000,
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=8192,
        max_seq_len=4096,
        tie_embeddings=False,
    ),
    "3b": dict(
        vocab_size=32000,
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        ffn_hidden=8192,
        max_seq_len=4096,
        tie_embeddings=False,
    ),
    "7b": dict(
        vocab_size=32000,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=32,
        ffn_hidden=11008,
        max_seq_len=4096,
        tie_embeddings=False,
    ),
}


def preset_config(name: str, **overrides) -> LlamaConfig:
    """Build a ``LlamaConfig`` from a named preset, optionally overriding fields.

    Args:
        name: Key of ``PRESETS`` (e.g. ``"tiny"``, ``"small"``, ``"1b"``).
        **overrides: Config fields to replace, e.g. ``vocab_size=32000``.

    Returns:
        The validated configuration.

    Raises:
        ValueError: If ``name`` is not a known preset, an override names an
            unknown field, or the resulting config is invalid.
    """
    if name not in PRESETS:
        known = ", ".join(sorted(PRESETS))
        raise ValueError(f"unknown preset {spelled(name)}; known presets: {known}")
    valid = {f.name for f in dataclasses.fields(LlamaConfig)}
    unknown = sorted(set(overrides) - valid)
    if unknown:
        # A ValueError (not the dataclass TypeError) keeps CLI error handling
        # uniform: every bad model option surfaces the same way.
        raise ValueError(f"unknown LlamaConfig field(s) {unknown}; valid fields: {sorted(valid)}")
    return LlamaConfig(**{**PRESETS[name], **overrides})
