"""A rank's model, sharded into sync units, and its sync engine, built from a configuration.

The order is the trainer's: :func:`build_model` (the same seed on every rank, so every
replica starts from the same weights), :func:`shard_model` (FSDP2 per block and root on the
``shard`` sub-mesh), then :func:`build_engine` (the inner optimizer,
:mod:`editrain.optim.inner`, sums gradient norms over the engine's ``replica_group``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from editrain.api import parallelize
from editrain.config import model_config
from editrain.config.model import builds_on_meta, hf_option, hf_source
from editrain.models import Llama
from editrain.models.llama import fill_rope
from editrain.sync import StepScheduleTrigger, SyncEngine
from editrain.topology import MeshInfo


def build_model(cfg: Any, vocab_size: int, device: torch.device) -> nn.Module:
    """The model ``cfg.model`` names, seeded with ``train.seed``, on ``device``: a Hugging
    Face model from ``model.hf_config`` (or a ``model.init_from`` directory of another
    architecture), else the compact Llama of ``model.preset`` (or of a Llama
    ``model.init_from`` directory: on the meta device, see :func:`builds_on_meta`).
    ``model.init_from``'s weights are loaded later, into the sharded model
    (:func:`editrain.hf_checkpoint.load_hf_weights`)."""
    seed = cfg.train.seed
    if builds_on_meta(cfg):
        with torch.device("meta"):
            return Llama(model_config(cfg, vocab_size=vocab_size), seed=seed)
    source = hf_source(cfg)
    if source is not None:
        from editrain.models.hf import HFCausalLM

        return HFCausalLM.from_config_file(source, tokenizer_vocab_size=vocab_size,
                                           seed=seed, option=hf_option(cfg)).to(device)
    return Llama(model_config(cfg, vocab_size=vocab_size), seed=seed).to(device)


def materialise(cfg: Any, model: nn.Module, device: torch.device) -> None:
    """The sharded model (or stage) ready for its first step: one still on the meta device
    (:func:`~editrain.config.model.builds_on_meta`) gets this rank's shards on ``device``,
    zeros until a resume loads the checkpoint over them (zeros, not whatever the memory
    held: the same on every rank), and its RoPE tables; then ``model.init_from``'s
    weights, at the start of a run, each rank reading its own slices (collective)."""
    from editrain.hf_checkpoint import load_hf_weights

    if builds_on_meta(cfg):
        model.to_empty(device=device)
        with torch.no_grad():
            for t in (*model.parameters(), *model.buffers()):
                t.zero_()
        fill_rope(model)
    if cfg.model.init_from is not None and not cfg.resume:
        load_hf_weights(model, cfg.model.init_from)


def shard_model(cfg: Any, model: nn.Module, info: MeshInfo) -> list[nn.Module]:
    """FSDP2 on the ``shard`` sub-mesh: one unit per block, the embeddings and output head
    (``sync.split_root``) and the root; returns the units' modules (the engine's blocks)."""
    return parallelize(model, info, model.blocks(), cfg.train.precision,
                       split_root=cfg.sync.split_root)


def build_engine(cfg: Any, model: nn.Module, info: MeshInfo, blocks: Sequence[nn.Module], *,
                 link_delay: Callable[[int], float] | None = None,
                 before_sync: Callable[[int], None] | None = None,
                 cross_replica: Any = None) -> SyncEngine:
    """The sync engine of ``cfg.sync`` over ``model``'s units.

    Args:
        cfg: the run's configuration (``sync``, ``sim.step_schedule``, ``train``,
            ``dist.comm_backend``).
        model, info, blocks: the sharded model, the mesh and the units' modules.
        link_delay: the simulated cross-replica link (:attr:`editrain.sim.Simulation.link`).
        before_sync: called with the sync index before each sync (fault injection).
        cross_replica: the fault-tolerant mode's cross-replica group.
    """
    steps = cfg.sim.step_schedule
    engine = SyncEngine(model, info.mesh, cfg.sync, blocks=blocks, link_delay=link_delay,
                        before_sync=before_sync,
                        trigger=StepScheduleTrigger(steps) if steps else None,
                        seed=cfg.train.seed, comm_backend=cfg.dist.comm_backend,
                        cross_replica=cross_replica)
    if cfg.sync.use_async:
        # The engine knows the budget: with the time trigger a replica also enters the
        # rendezvous once the cluster has probably used it up. (A forced step schedule
        # stays deterministic: the run ends at the first sync that reaches it.)
        engine.set_budget(cfg.train.steps)
    return engine
