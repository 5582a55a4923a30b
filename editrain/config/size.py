"""The model's size before anything is built: a model that cannot fit is refused at once.

A shape option (``--model.n_layers 100000000``, a ``config.json`` whose
``num_hidden_layers`` was edited) used to pass every check and start the workers, which
then spent minutes building modules, or failed with the allocator's message from inside a
rank. Every rank builds the whole model in fp32 in host memory before sharding it
(:func:`editrain.build.build_model`, whatever ``dist.device`` is; a Llama whose weights
come from ``model.init_from`` or ``--resume`` materialises only its shards), so a model
whose weights alone exceed this machine's memory can never train here: :func:`check_fits`
refuses it before any process starts, naming the option that set the shape.

The counts are lower bounds that hold for every model editrain can build, computed from
the configuration alone (no torch, no model, no weights read):

- editrain's Llama (a preset, its overrides, or a Llama ``model.init_from`` directory):
  exactly, from :class:`~editrain.models.LlamaConfig` (:func:`llama_parameters`), with
  the vocabulary at its smallest when the tokenizer is not known yet;
- a Hugging Face config built through transformers (``model.hf_config``, a
  ``model.init_from`` directory of another architecture): its input embedding
  (``vocab_size x hidden_size``) and, per layer, one linear map that reads the residual
  stream (``hidden_size`` inputs), the least any decoder layer holds.

:func:`check_weights_match` compares a model description's layer count (a
``model.init_from`` directory's or a sampled one's ``config.json``, a checkpoint's marker
for ``sample`` and ``export``) with the layers its weights hold, before any model is built
from it, even on the meta device: a description that claims more layers than its weights
is refused in one line.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from editrain.errors import ConfigError, as_config_error
from editrain.models.hf_dir import check_hf_numbers, hf_int, hf_key

MIN_VOCAB = 257
"""The smallest vocabulary a run can have (a byte-level BPE: 256 bytes and end of text)."""
FP32 = 4
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
"""Where a container's memory limit is (cgroup v2, then v1)."""
def llama_parameters(mcfg: Any) -> int:
    """The parameters of editrain's Llama of ``mcfg`` (a ``LlamaConfig``), exactly: per
    block the query and output projections, the key and value projections (grouped
    heads), the SwiGLU's three maps and two norms; the embedding, the final norm and an
    untied output head."""
    dim, hd = mcfg.dim, mcfg.head_dim
    block = (2 * dim * mcfg.n_heads * hd + 2 * dim * mcfg.n_kv_heads * hd
             + 3 * dim * mcfg.ffn_hidden + 2 * dim)
    embedding = mcfg.vocab_size * dim
    return (mcfg.n_layers * block + embedding + dim
            + (0 if mcfg.tie_embeddings else embedding))


def hf_layers(data: dict[str, Any], where: str = "config.json") -> int:
    """The layer count of a Hugging Face ``config.json`` (0 when it does not say).

    Raises:
        ValueError: its layer count is no count (:func:`~editrain.models.hf_dir.hf_int`;
            names ``where``).
    """
    return hf_int(data, "layers", where)


def hf_parameters_at_least(data: dict[str, Any]) -> int:
    """A lower bound on the parameters of the model of a Hugging Face ``config.json``: its
    input embedding and one ``hidden_size``-input linear map per layer (0 for what the
    file does not say)."""
    hidden = hf_int(data, "hidden")
    return hidden * (hf_int(data, "vocab") + hf_int(data, "layers"))


def least_parameters(cfg: Any) -> tuple[int, str, int, int]:
    """``(parameters at least, the option that set the shape, RoPE table bytes, positions)``
    of the configured model (see the module's docstring)."""
    from editrain.config.model import hf_option, hf_source, model_config

    source = hf_source(cfg)
    if source is not None:
        from editrain.models.hf import read_hf_config

        option = hf_option(cfg)
        return hf_parameters_at_least(read_hf_config(source, option)), option, 0, 0
    if cfg.model.init_from is not None:
        mcfg, option = model_config(cfg), "model.init_from"
    else:
        mcfg = model_config(cfg, vocab_size=MIN_VOCAB)
        given = sorted(cfg.model.overrides())
        option = ", ".join(f"model.{k}" for k in given) if given else "model.preset"
    # RoPE's cosine and sine tables, fp32, max_seq_len x head_dim / 2 values each at least.
    rope = FP32 * mcfg.max_seq_len * mcfg.head_dim
    return llama_parameters(mcfg), option, rope, mcfg.max_seq_len


def host_memory() -> int | None:
    """This machine's memory in bytes, or a container's limit where it is lower (None when
    neither can be read)."""
    names = getattr(os, "sysconf_names", {})
    total = (os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
             if "SC_PAGE_SIZE" in names and "SC_PHYS_PAGES" in names else None)
    for path in CGROUP_LIMITS:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limit = int(text)
            total = limit if total is None else min(total, limit)
        break
    return total if total and total > 0 else None


def _size(n: float) -> str:
    """``24.0 GiB`` style, up to EiB."""
    for unit in ("EiB", "PiB", "TiB", "GiB", "MiB", "KiB"):
        scale = 2.0 ** (10 * ("KMGTPE".index(unit[0]) + 1))
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _count(n: int) -> str:
    """``1.3e+15`` for a huge count, ``5,012,480`` otherwise."""
    return f"{n:.2g}" if n >= 10**12 else f"{n:,}"


def check_fits(cfg: Any, local_ranks: int, memory: int | None = None) -> None:
    """Refuse a model that cannot fit this machine's memory.

    At least: every rank builds the whole model in fp32 on the host before sharding it (so
    one rank's build needs ``4 x parameters`` plus the RoPE tables; a Llama whose weights
    come from ``model.init_from`` or ``--resume`` builds on the meta device and
    materialises only its shards: ``4 x parameters / (shard x tp x pp)``), and on a CPU
    device
    the ``local_ranks`` ranks then hold their shards of the weights and gradients (``8 x
    parameters / (dist.shard_size x dist.tp_size x dist.pp_size)`` each).

    Args:
        cfg: the configuration.
        local_ranks: the ranks this machine runs.
        memory: the machine's memory in bytes (default: :func:`host_memory`; no check
            when it is unknown).

    Raises:
        ConfigError: the model does not fit, naming the option that set its shape.
    """
    memory = host_memory() if memory is None else memory
    if memory is None:
        return
    from editrain.config.model import builds_on_meta

    params, option, rope, positions = least_parameters(cfg)
    d = cfg.dist
    split = d.shard_size * d.tp_size * d.pp_size
    meta = builds_on_meta(cfg)  # then a rank materialises its shards only
    need = FP32 * params // (split if meta else 1) + rope
    if d.device == "cpu" or (d.device == "auto" and _no_gpu()):
        per_rank = 2 * FP32 * params / split
        need = max(need, math.ceil(local_ranks * per_rank))
    if need > memory:
        build = ("every rank materialises its shards in fp32" if meta else
                 "every rank builds the whole model in fp32 before sharding it")
        what = f"the model has at least {_count(params)} parameters"
        if rope > FP32 * params:
            what += f" and RoPE tables of {_size(rope)} for {positions:,} positions"
            option = "model.max_seq_len" if cfg.model.max_seq_len else option
        raise ConfigError(
            f"{option}: {what}; training it here needs at least {_size(need)} of host "
            f"memory ({build}; on a "
            f"CPU device {local_ranks} local rank{'s' if local_ranks != 1 else ''} then hold "
            f"their shards and gradients), "
            f"more than this machine's {_size(memory)}; choose a smaller shape")


def _no_gpu() -> bool:
    """Whether ``dist.device = auto`` surely resolves to the CPU here, decided without
    importing torch (the launcher starts the workers' fork server before it imports
    torch): no device is visible (``CUDA_VISIBLE_DEVICES`` empty or -1), or the machine has
    no NVIDIA or ROCm device node. Where unsure it says False: the check is then only less
    strict."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return True
    dev = Path("/dev")
    return not (any(dev.glob("nvidia[0-9]*")) or (dev / "kfd").exists())


def weight_layers(names: Any) -> int:
    """The layers a set of tensor names holds: the most distinct indices under one prefix
    (``model.layers.0.``, ``transformer.h.11.``: the first numeric part of a name)."""
    seen: dict[str, set[str]] = {}
    for name in names:
        parts = name.split(".")
        for k, part in enumerate(parts):
            if part.isdigit():
                seen.setdefault(".".join(parts[:k]), set()).add(part)
                break
    return max((len(v) for v in seen.values()), default=0)


def check_weights_match(data: dict[str, Any], names: Any, source: str,
                        option: str = "model.init_from") -> None:
    """Refuse a model description (a ``config.json``, a checkpoint's marker) with more
    layers than the weights beside it hold, before a model is built from it (a build takes
    about a millisecond a layer even on the meta device, so 10**9 layers would not end;
    the tensors' shapes are compared once the model is built on the meta device).

    Args:
        data: the description (Hugging Face names, or editrain's Llama's ``n_layers``).
        names: the names of the tensors the weights hold.
        source: the file ``data`` was read from, for the message, as
            :func:`editrain.paths.shown` spells it.
        option: the option or command the message names.

    Raises:
        ConfigError: naming ``option``, the file's field and both counts; or a number of
            the description that is none
            (:func:`~editrain.models.hf_fields.check_hf_numbers`).
    """
    with as_config_error():  # a checkpoint's marker: its numbers are read here first
        check_hf_numbers(data, f"{option}: {source}")
        layers = hf_layers(data, f"{option}: {source}")
    held = weight_layers(names)
    if layers > held:
        key = hf_key(data, "layers")
        raise ConfigError(
            f"{option}: {source} has {key} = {_count(layers)}, but its weights hold {held} "
            f"layers; the file does not belong to these weights")


__all__ = ["check_fits", "check_weights_match", "hf_layers", "hf_parameters_at_least", "host_memory",
           "least_parameters", "llama_parameters", "weight_layers"]
