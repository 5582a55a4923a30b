"""Sync-unit discovery: find the list of transformer blocks of a model.

EDiT syncs a model unit by unit: one unit per transformer block plus the *root* unit (every
parameter outside the blocks: embeddings, final norm, LM head). FSDP2 shards along the same
units. This module finds the blocks by looking at well-known attribute paths; it never
guesses from parameter names. When the model is of a shape it does not know, pass the
blocks explicitly (a list of modules, or the dotted path of the attribute that holds them).
A ``DistributedDataParallel`` wrapper is looked through: its blocks are its ``.module``'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import nn
from torch.nn.parallel import DistributedDataParallel

BLOCK_PATHS: tuple[str, ...] = (
    "layers",                # editrain's Llama, torchtitan models
    "model.layers",          # Hugging Face causal LMs (Llama, Mistral, Qwen2, Gemma, Phi-3...)
    "transformer.h",         # Hugging Face GPT-2, GPT-J, Falcon, BLOOM, nanoGPT
    "model.decoder.layers",  # Hugging Face OPT
    "gpt_neox.layers",       # Hugging Face GPT-NeoX, Pythia
    "transformer.blocks",    # MPT
)
"""Attribute paths searched in this order by :func:`find_blocks`, after ``model.blocks()``."""


def unwrap_ddp(model: nn.Module) -> nn.Module:
    """The module a ``DistributedDataParallel`` wrapper holds (``model.module``), or
    ``model`` itself when it is not one: the module whose attributes name the blocks and
    whose parameter names (without DDP's ``module.`` prefix) the engine's state uses."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def _resolve_path(model: nn.Module, path: str) -> object | None:
    """The object at dotted attribute ``path`` below ``model``, or None if any step is missing."""
    node: object = model
    for part in path.split("."):
        node = getattr(node, part, None)
        if node is None:
            return None
    return node


def _as_block_list(found: object) -> list[nn.Module] | None:
    """``found`` as a non-empty list of modules, or None if it is not one."""
    if isinstance(found, nn.Module) and not isinstance(found, nn.ModuleList | nn.Sequential):
        return None
    if not isinstance(found, Iterable) or isinstance(found, str | bytes):
        return None
    items = list(found)
    if not items or not all(isinstance(b, nn.Module) for b in items):
        return None
    return items


def _check_explicit(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """Validate blocks a user passed: modules of ``model``, distinct, non-overlapping."""
    owned = {id(m) for m in model.modules()}
    seen: set[int] = set()
    for i, b in enumerate(blocks):
        if not isinstance(b, nn.Module):
            raise TypeError(f"blocks[{i}] is a {type(b).__name__}, not an nn.Module")
        if id(b) not in owned:
            raise ValueError(f"blocks[{i}] ({type(b).__name__}) is not a submodule of the model")
        if id(b) in seen:
            raise ValueError(f"blocks[{i}] ({type(b).__name__}) is listed twice")
        if b is model:
            raise ValueError("the model itself cannot be a block: it is the root unit")
        seen.add(id(b))
    inner = {id(m) for b in blocks for m in b.modules() if m is not b}
    for i, b in enumerate(blocks):
        if id(b) in inner:
            raise ValueError(f"blocks[{i}] ({type(b).__name__}) is nested inside another block; "
                             "blocks must not overlap")
    return blocks


def find_blocks(
    model: nn.Module,
    blocks: Sequence[nn.Module] | str | None = None,
) -> list[nn.Module]:
    """The transformer blocks of ``model`` in forward order (the sync and sharding units).

    Looked for, in order: ``blocks`` when given; ``model.blocks()`` when the model has such a
    method (editrain's Llama and the Hugging Face adapter); then every path of
    :data:`BLOCK_PATHS` (``model.layers``, ``model.model.layers``, ``model.transformer.h``,
    ...). The first that holds a non-empty list of modules wins.

    Args:
        model: the root module (before or after ``fully_shard``), or a
            ``DistributedDataParallel`` wrapper: the search then runs on its ``.module``.
        blocks: an explicit list of block modules, or the dotted attribute path of the
            container that holds them (e.g. ``"backbone.stages"``); None to search.

    Returns:
        A new list of the block modules.

    Raises:
        ValueError: no blocks were found (the message names every path that was tried),
            or explicit blocks that are not distinct, non-overlapping submodules.
    """
    model = unwrap_ddp(model)
    if isinstance(blocks, str):
        found = _as_block_list(_resolve_path(model, blocks))
        if found is None:
            raise ValueError(
                f"blocks={blocks!r}: {type(model).__name__}.{blocks} is not a non-empty list "
                "of modules (nn.ModuleList, nn.Sequential or a list)"
            )
        return _check_explicit(model, found)
    if blocks is not None:
        found = list(blocks)
        if not found:
            raise ValueError("blocks is empty: EDiT needs at least one block (sync unit)")
        return _check_explicit(model, found)
    method = getattr(model, "blocks", None)
    if callable(method) and not isinstance(method, nn.Module):
        found = _as_block_list(method())
        if found is not None:
            return found
    for path in BLOCK_PATHS:
        found = _as_block_list(_resolve_path(model, path))
        if found is not None:
            return found
    tried = ["model.blocks()"] + [f"model.{p}" for p in BLOCK_PATHS]
    raise ValueError(
        f"cannot find the transformer blocks of {type(model).__name__}: looked for "
        f"{', '.join(tried)}; pass them explicitly, e.g. blocks=model.my_layers (a list of "
        "modules) or blocks='my_layers' (the attribute path)"
    )


__all__ = ["BLOCK_PATHS", "find_blocks", "unwrap_ddp"]
