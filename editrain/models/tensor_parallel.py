"""Tensor parallelism for the built-in Llama (and Llama-family Hugging Face models).

The Megatron split of a transformer block over a ``tp`` mesh dimension, with PyTorch's
``parallelize_module``:

* attention: ``wq``, ``wk``, ``wv`` column-wise (each rank computes ``H / T`` query heads and
  ``K / T`` key/value heads), ``wo`` row-wise (partial sums all-reduced);
* feed-forward: ``w1`` and ``w3`` column-wise, ``w2`` row-wise.

Activations between blocks, the norms, the embeddings and the output head stay replicated
over ``tp`` (no sequence parallelism): one all-reduce after attention and one after the
feed-forward per block, forward and backward. The attention reshapes by the *local* head
count (``view(..., -1, head_dim)``), so the same module runs split or whole.

Hugging Face Llama-family layers (``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``)
get the same plan; a model whose blocks have neither layout is refused with the names found.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

LAYOUTS: dict[str, dict[str, str]] = {
    "editrain": {"attention.wq": "col", "attention.wk": "col", "attention.wv": "col",
                 "attention.wo": "row", "feed_forward.w1": "col", "feed_forward.w3": "col",
                 "feed_forward.w2": "row"},
    "hf-llama": {"self_attn.q_proj": "col", "self_attn.k_proj": "col",
                 "self_attn.v_proj": "col", "self_attn.o_proj": "row",
                 "mlp.gate_proj": "col", "mlp.up_proj": "col", "mlp.down_proj": "row"},
}
"""Per block layout: sub-module path -> column-wise or row-wise."""
HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
                  "granite")
"""Hugging Face architectures split by the ``hf-llama`` layout, checked against the whole
model (the same step-0 validation loss): their attention reshapes by the local head count
and norms nothing across heads. Others with the same layer names do not run split (OLMo 2
norms the queries across all heads; StableLM reshapes by the whole model's head count)."""


def _layout_of(block: nn.Module) -> dict[str, str]:
    names = {n for n, _ in block.named_modules()}
    for layout in LAYOUTS.values():
        if set(layout) <= names:
            return layout
    linear = sorted(n for n, m in block.named_modules() if isinstance(m, nn.Linear))
    raise ValueError(
        f"tensor parallelism: {type(block).__name__} has neither editrain's Llama layout "
        f"nor Hugging Face Llama's (its linear layers: {', '.join(linear) or 'none'}); "
        f"apply your own plan with torch.distributed.tensor.parallel.parallelize_module")


def _heads(block: nn.Module) -> tuple[int, int] | None:
    """(query heads, key/value heads) of a block's attention, if it says."""
    for path in ("attention", "self_attn"):
        attn = getattr(block, path, None)
        if attn is None:
            continue
        cfg = getattr(attn, "config", None)
        q = getattr(attn, "n_heads", None) or getattr(cfg, "num_attention_heads", None)
        kv = (getattr(attn, "n_kv_heads", None) or getattr(cfg, "num_key_value_heads", None)
              or q)
        if q:
            return int(q), int(kv)
    return None


def check_tensor_parallel(blocks: Sequence[nn.Module], tp_size: int) -> None:
    """The heads (and the plan's layout) split evenly over ``tp_size`` ranks."""
    for block in blocks:
        _layout_of(block)
        heads = _heads(block)
        if heads and (heads[0] % tp_size or heads[1] % tp_size):
            raise ValueError(f"dist.tp_size={tp_size} must divide the query heads ({heads[0]}) "
                             f"and the key/value heads ({heads[1]})")


def tensor_parallel(blocks: Sequence[nn.Module], tp_mesh: DeviceMesh) -> None:
    """Split every block over ``tp_mesh`` (1-D) in place (see the module docstring)."""
    tp_size = tp_mesh.size()
    check_tensor_parallel(blocks, tp_size)
    for block in blocks:
        plan = {path: ColwiseParallel() if kind == "col" else RowwiseParallel()
                for path, kind in _layout_of(block).items()}
        parallelize_module(block, tp_mesh, plan)
