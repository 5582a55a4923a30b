"""Rank functions of tests/test_hf_io.py, which ranks import without transformers."""

from __future__ import annotations

from pathlib import Path

import torch

from editrain.config import Config
from editrain.models.hf_dir import hf_parameters

MESHES = [
    ("llama_sharded", 2, 1, 1),  # 2 replicas x 2 FSDP shards
    ("llama", 1, 2, 1),  # 2 replicas x 1 shard x 2 tp
    ("llama", 1, 1, 2),  # 2 replicas x 2 pipeline stages
    ("qwen", 2, 1, 1),  # Qwen2 through the adapter, under its own names: the same meshes
    ("qwen", 1, 2, 1),
    ("qwen", 1, 1, 2),
]
"""(directory, shard_size, tp_size, pp_size) of each case, on 4 ranks, in one spawn (a rank
that builds a transformers model imports transformers, about 10 CPU seconds per rank: once
for the three Qwen2 cases)."""


def load_worker(rank: int, world: int, paths: dict[str, str], x: torch.Tensor) -> list:
    """Each case of :data:`MESHES` in one spawn of 4 ranks (a new mesh over the same
    process group each time): starting the processes is most of the time."""
    return [_load_case(paths[name], shard, tp, pp, x) for name, shard, tp, pp in MESHES]


def _load_case(path: str, shard: int, tp: int, pp: int, x: torch.Tensor) -> dict:
    from torch.distributed.tensor import DTensor

    from editrain.build import build_model, materialise, shard_model
    from editrain.pipeline import build_stage
    from editrain.topology import init_mesh

    cfg = Config()
    cfg.model.init_from = path
    cfg.dist.shard_size, cfg.dist.tp_size, cfg.dist.pp_size = shard, tp, pp
    info = init_mesh(shard, tp_size=tp, pp_size=pp)
    model = build_model(cfg, 300, torch.device("cpu"))
    # editrain's Llama starts on the meta device (no whole model in host memory), a model
    # through the adapter on the host
    assert {p.is_meta for p in model.parameters()} == {Path(path).name.startswith("llama")}
    if pp > 1:
        model = build_stage(model, info.stage, pp)
    shard_model(cfg, model, info)
    materialise(cfg, model, torch.device("cpu"))  # the trainer's: from the meta device
    out: dict = {"weights": {}, "local": 0}
    for name, p in hf_parameters(model).items():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        out["weights"][name] = full.detach().clone()
        out["local"] += (p.to_local() if isinstance(p, DTensor) else p).numel()
    with torch.no_grad():
        logits = model(x) if pp == 1 else _through_the_stages(model, info.stage, pp, x)
    if logits is not None:
        out["logits"] = logits.full_tensor() if isinstance(logits, DTensor) else logits
    return out


def _through_the_stages(stage: torch.nn.Module, index: int, pp: int,
                        x: torch.Tensor) -> torch.Tensor | None:
    """The logits of a replica's pipeline, on its last stage's ranks (None elsewhere): each
    stage's output handed to the next stage's rank (the global rank after it, with one
    shard and no tp) through an all-gather, one boundary at a time."""
    import torch.distributed as dist

    h = stage(x) if index == 0 else None
    for boundary in range(pp - 1):
        outs: list = [None] * dist.get_world_size()
        dist.all_gather_object(outs, h if index == boundary else None)
        if index == boundary + 1:
            h = stage(outs[dist.get_rank() - 1])
    return h if index == pp - 1 else None
