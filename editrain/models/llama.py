"""A compact Llama-style decoder-only transformer (architecture only).

The model follows the Llama recipe: pre-norm residual blocks with RMSNorm,
rotary position embeddings (RoPE), grouped-query attention (GQA) and a SwiGLU
feed-forward network. Nothing in this file knows about distributed training;
sharding wrappers are applied from the outside, using ``Llama.blocks()`` as the
unit of wrapping.

Shape legend used in comments throughout this file:
    B  batch size
    T  time (sequence length)
    D  model dimension (``dim``)
    H  number of query heads (``n_heads``)
    K  number of key/value heads (``n_kv_heads``)
    E  head dimension (``dim // n_heads``)
    V  vocabulary size
    F  feed-forward hidden size (``ffn_hidden``)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# The shape lives in a module without torch (the configuration checks it); it stays
# importable from here, with the model it describes.
from editrain.models.llama_config import PRESETS, LlamaConfig, preset_config

__all__ = [
    "PRESETS",
    "Attention",
    "FeedForward",
    "KVCache",
    "Llama",
    "LlamaConfig",
    "RMSNorm",
    "TransformerBlock",
    "apply_rope",
    "causal_lm_loss",
    "fill_rope",
    "num_parameters",
    "precompute_rope",
    "preset_config",
]


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned per-channel gain.

    Args:
        dim: Size of the last (normalised) dimension.
        eps: Added to the mean square before the square root.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        """Set the gain back to ones."""
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        """Normalise ``x`` over its last dimension.

        Args:
            x: Input of shape ``[..., dim]`` in any floating dtype.

        Returns:
            Tensor of the same shape and dtype as ``x``.
        """
        # The mean of squares over D overflows/loses precision in bf16/fp16,
        # so the statistic and the scaling are computed in fp32.
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


def precompute_rope(
    head_dim: int,
    max_seq_len: int,
    theta: float = 10000.0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    scaling: dict[str, float] | None = None,
) -> tuple[Tensor, Tensor]:
    """Precompute the RoPE cosine and sine tables ("rotate half" layout).

    Channel ``i`` and channel ``i + E/2`` form one rotation pair with angular
    frequency ``f_i = theta ** (-2i / E)``. Llama 3's ``scaling`` (its long-context
    recipe) keeps the frequencies whose wavelength ``2 pi / f`` is below
    ``original_max_position_embeddings / high_freq_factor``, divides those whose
    wavelength is above ``original_max_position_embeddings / low_freq_factor`` by
    ``factor``, and blends the two linearly in between, with the weight
    ``s = (original_max_position_embeddings / wavelength - low_freq_factor) /
    (high_freq_factor - low_freq_factor)`` on the kept frequency.

    Args:
        head_dim: Per-head width E (must be even).
        max_seq_len: Number of positions to precompute.
        theta: Base of the frequency schedule.
        dtype: Dtype of the returned tables.
        device: Device of the returned tables.
        scaling: Llama 3's RoPE scaling (:class:`LlamaConfig`'s ``rope_scaling``), or
            None.

    Returns:
        ``(cos, sin)``, each of shape ``[max_seq_len, head_dim]``.

    Raises:
        ValueError: If ``head_dim`` is odd.
    """
    if head_dim % 2 != 0:
        raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
    # Angles are formed in fp64 so that long positions times small frequencies
    # keep full precision before rounding to the requested dtype.
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    )
    if scaling is not None:
        old_len, low, high = (scaling["original_max_position_embeddings"],
                              scaling["low_freq_factor"], scaling["high_freq_factor"])
        wavelen = 2 * math.pi / inv_freq
        blend = (old_len / wavelen - low) / (high - low)  # in [0, 1] where it is used
        scaled = blend * inv_freq + (1 - blend) * inv_freq / scaling["factor"]
        inv_freq = torch.where(wavelen < old_len / high, inv_freq,
                               torch.where(wavelen > old_len / low,
                                           inv_freq / scaling["factor"], scaled))
    pos = torch.arange(max_seq_len, dtype=torch.float64, device=device)
    angles = torch.outer(pos, inv_freq)  # [T, E/2]
    angles = torch.cat([angles, angles], dim=-1)  # [T, E]: both halves of a pair share an angle
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    # (x1, x2) -> (-x2, x1) pairs channel i with channel i + E/2, which is a
    # 90 degree rotation of every pair; combined with cos/sin it rotates by
    # the position-dependent angle.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate query or key heads by their position's RoPE angle.

    Args:
        x: Heads of shape ``[B, H, T, E]`` (any number of heads).
        cos: Cosine table of shape ``[T, E]`` (already sliced to T).
        sin: Sine table of shape ``[T, E]`` (already sliced to T).

    Returns:
        Rotated tensor with the shape and dtype of ``x``.
    """
    cos = cos.to(x.dtype)
    sin = sin.to(x.dtype)
    return x * cos + _rotate_half(x) * sin


class KVCache:
    """The keys and values of the positions a model has already seen, per block, so that
    decoding one more token runs one position through the model instead of the whole
    sequence (``editrain sample``). Training never uses one.

    Args:
        n_layers: the model's number of blocks.
    """

    def __init__(self, n_layers: int) -> None:
        self.keys: list[Tensor | None] = [None] * n_layers
        self.values: list[Tensor | None] = [None] * n_layers
        self.length = 0
        """Positions held (every block holds as many once a forward has finished)."""

    def extend(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append block ``layer``'s new keys and values ``[B, K, T, E]``; returns all of
        them, the earlier positions first."""
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


class Attention(nn.Module):
    """Causal multi-head attention with grouped-query key/value heads and RoPE.

    Args:
        config: Model configuration (uses dim, n_heads, n_kv_heads).
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        d, e = config.dim, config.head_dim
        self.wq = nn.Linear(d, self.n_heads * e, bias=False)
        self.wk = nn.Linear(d, self.n_kv_heads * e, bias=False)
        self.wv = nn.Linear(d, self.n_kv_heads * e, bias=False)
        self.wo = nn.Linear(self.n_heads * e, d, bias=False)

    def _repeat_kv(self, x: Tensor) -> Tensor:
        # [B, K, T, E] -> [B, H, T, E] with query head h reading kv head
        # h // (H // K) (same grouping as repeat_interleave). expand+reshape is
        # used instead of SDPA's enable_gqa so older torch versions and every
        # backend see a plain multi-head attention call.
        rep = self.n_heads // self.n_kv_heads
        if rep == 1:
            return x
        b, k, t, e = x.shape
        return x[:, :, None].expand(b, k, rep, t, e).reshape(b, k * rep, t, e)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor,
                cache: tuple[KVCache, int] | None = None) -> Tensor:
        """Apply causal self-attention.

        Args:
            x: Input of shape ``[B, T, D]``.
            cos: RoPE cosine table ``[T, E]`` (of these T positions).
            sin: RoPE sine table ``[T, E]``.
            cache: ``(cache, block index)``: the keys and values of the earlier positions,
                which ``x`` follows (decoding); this call's are appended to it.

        Returns:
            Output of shape ``[B, T, D]``.
        """
        b, t, _ = x.shape
        # Heads by the projections' widths: under tensor parallelism a rank holds H / T
        # query and K / T key/value heads (editrain.models.tensor_parallel).
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # [B, H, T, E]
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # [B, K, T, E]
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)  # [B, K, T, E]
        # RoPE is applied before repeating k so the rotation runs on K heads, not H.
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache[0].extend(cache[1], k, v)  # [B, K, P + T, E]
        k = self._repeat_kv(k)
        v = self._repeat_kv(v)
        past = k.shape[2] - t
        if past == 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, E]
        else:  # query i is position past + i: it sees every key up to there
            seen = torch.ones(t, past + t, dtype=torch.bool, device=x.device).tril(past)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=seen)
        out = out.transpose(1, 2).reshape(b, t, -1)  # [B, T, H*E]
        return self.wo(out)


class FeedForward(nn.Module):
    """SwiGLU feed-forward network: ``w2(silu(w1 x) * w3 x)``.

    Args:
        dim: Input/output width D.
        hidden: Hidden width F.
    """

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the gated MLP.

        Args:
            x: Input of shape ``[..., D]``.

        Returns:
            Output of shape ``[..., D]``.
        """
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: attention then SwiGLU, each behind an RMSNorm.

    Args:
        config: Model configuration.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config.dim, config.ffn_hidden)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor,
                cache: tuple[KVCache, int] | None = None) -> Tensor:
        """Run one block.

        Args:
            x: Residual stream ``[B, T, D]``.
            cos: RoPE cosine table already sliced to ``[T, E]``.
            sin: RoPE sine table already sliced to ``[T, E]``.
            cache: see :meth:`Attention.forward`.

        Returns:
            Updated residual stream ``[B, T, D]``.
        """
        h = x + self.attention(self.attention_norm(x), cos, sin, cache)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Decoder-only Llama language model.

    Args:
        config: Model configuration.
        seed: If given, ``init_weights(seed)`` makes the initial weights
            deterministic; otherwise the global torch RNG is used.
    """

    def __init__(self, config: LlamaConfig, seed: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        # With tied embeddings there is deliberately no output module: the
        # logits are computed from tok_embeddings.weight directly, so a
        # parameter never appears under two module paths (which trips up
        # FSDP sharding and state-dict round trips).
        self.output: nn.Linear | None = (
            None if config.tie_embeddings else nn.Linear(config.dim, config.vocab_size, bias=False)
        )
        # Non-persistent: the tables are a pure function of the config, so
        # they stay out of checkpoints; kept in fp32 for angle precision.
        cos, sin = precompute_rope(config.head_dim, config.max_seq_len, config.rope_theta,
                                   scaling=config.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights(seed)

    def blocks(self) -> list[nn.Module]:
        """Return the transformer blocks in forward order.

        Returns:
            A new list holding each ``TransformerBlock``.
        """
        return list(self.layers)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """(Re-)initialise every parameter and recompute the RoPE tables.

        Linear and embedding weights get ``normal(0, init_std)``; the residual
        output projections (``attention.wo`` and ``feed_forward.w2``) are scaled
        by ``1 / sqrt(2 * n_layers)`` so the residual stream variance does not
        grow with depth; RMSNorm gains are set to one. Safe to call after
        ``to_empty()`` on a model built on the meta device. Parameters on the
        meta device are skipped.

        Args:
            seed: Seed for a private generator per device, making the result
                independent of the global RNG state. ``None`` uses the global
                torch RNG. The same seed gives identical weights on the same
                device type; CPU and CUDA streams differ.
        """
        cfg = self.config
        generators: dict[torch.device, torch.Generator] = {}

        def gen_for(t: Tensor) -> torch.Generator | None:
            if seed is None:
                return None
            if t.device not in generators:
                g = torch.Generator(device=t.device)
                g.manual_seed(seed)
                generators[t.device] = g
            return generators[t.device]

        def normal(w: Tensor, std: float) -> None:
            if w.is_meta:
                return
            w.normal_(mean=0.0, std=std, generator=gen_for(w))

        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        # A fixed traversal order (embedding, blocks in order, output) makes
        # the generator stream, and therefore the weights, reproducible.
        normal(self.tok_embeddings.weight, cfg.init_std)
        for block in self.layers:
            attn, ffn = block.attention, block.feed_forward
            normal(attn.wq.weight, cfg.init_std)
            normal(attn.wk.weight, cfg.init_std)
            normal(attn.wv.weight, cfg.init_std)
            normal(attn.wo.weight, out_std)
            normal(ffn.w1.weight, cfg.init_std)
            normal(ffn.w3.weight, cfg.init_std)
            normal(ffn.w2.weight, out_std)
            block.attention_norm.reset_parameters()
            block.ffn_norm.reset_parameters()
        self.norm.reset_parameters()
        if self.output is not None:
            normal(self.output.weight, cfg.init_std)
        fill_rope(self)

    def forward(self, tokens: Tensor, cache: KVCache | None = None) -> Tensor:
        """Compute next-token logits.

        Args:
            tokens: Token ids of shape ``[B, T]`` (int64), ``T <= max_seq_len``.
            cache: decoding: ``tokens`` follow the positions the cache holds (a new
                :class:`KVCache` holds none), whose keys and values are not computed
                again; this call's are added to it.

        Returns:
            Logits of shape ``[B, T, V]`` in the model's compute dtype.

        Raises:
            ValueError: If ``tokens`` is not 2-D or the positions exceed ``max_seq_len``.
        """
        if tokens.dim() != 2:
            raise ValueError(f"tokens must have shape [B, T], got {tuple(tokens.shape)}")
        start = 0 if cache is None else cache.length
        t = start + tokens.shape[1]
        if t > self.config.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len ({self.config.max_seq_len})")
        h = self.tok_embeddings(tokens)  # [B, T, D]
        cos, sin = self.rope_cos[start:t], self.rope_sin[start:t]  # [T, E]
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, None if cache is None else (cache, i))
        if cache is not None:
            cache.length = t
        h = self.norm(h)
        if self.output is None:
            return F.linear(h, self.tok_embeddings.weight)  # [B, T, V]
        return self.output(h)  # [B, T, V]


def fill_rope(module: nn.Module, device: torch.device | str | None = None) -> None:
    """(Re)compute the RoPE tables of a Llama, or of a pipeline stage of one (they are
    buffers left out of checkpoints: a model materialised from the meta device with
    ``to_empty`` holds garbage there until this runs): in place on their device, or, for
    tables still on the meta device, new ones on ``device`` (none given: they stay)."""
    meta = module.rope_cos.is_meta
    device = device if meta else module.rope_cos.device
    if device is None or torch.device(device).type == "meta":
        return
    cfg = module.config
    cos, sin = precompute_rope(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, device=device,
                               scaling=cfg.rope_scaling)
    if meta:  # the parameters were assigned (load_state_dict(assign=True)); these follow
        module.register_buffer("rope_cos", cos, persistent=False)
        module.register_buffer("rope_sin", sin, persistent=False)
        return
    with torch.no_grad():
        module.rope_cos.copy_(cos)
        module.rope_sin.copy_(sin)


def num_parameters(model: nn.Module) -> int:
    """Count the unique parameters of a module.

    A parameter registered under several names is counted once. For DTensor
    (sharded) parameters ``numel()`` already reports the global size.

    Args:
        model: Any module.

    Returns:
        Total number of scalar parameters.
    """
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
    return total


def causal_lm_loss(logits: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    """Mean next-token cross-entropy, computed in fp32.

    No shifting happens here: ``targets[b, t]`` must already be the token that
    follows ``tokens[b, t]``.

    Args:
        logits: Model output of shape ``[B, T, V]`` (any floating dtype).
        targets: Target ids of shape ``[B, T]``.
        ignore_index: Target value excluded from the mean (padding).

    Returns:
        Scalar fp32 loss.
    """
    v = logits.shape[-1]
    # fp32 log-softmax: bf16 logits over a large vocabulary lose enough
    # precision in the normaliser to visibly bias the loss.
    return F.cross_entropy(
        logits.reshape(-1, v).float(), targets.reshape(-1), ignore_index=ignore_index
    )
