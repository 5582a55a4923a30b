"""What the sync engine is built from: its units, the layout checks, its private groups.

A sync *unit* is a group of parameters synced as one (docs/algorithm.md section 1): the
root module's own parameters, every block, and every other separately sharded module. The
checks here refuse layouts the layer-wise sync cannot serve, before any collective runs.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from editrain.errors import spelled
from editrain.sync.config import COMM_BACKENDS, SyncConfig
from editrain.sync.outer import SyncUnit, copies_in_replica, resolve_optimizer_class
from editrain.sync.triggers import IntervalTrigger, SyncTrigger, TimeTrigger
from editrain.topology import SHARD_DIM, Topology


def root_leaf_units(model: nn.Module, blocks: Sequence[nn.Module]) -> list[nn.Module]:
    """The ``nn.Embedding`` and ``nn.Linear`` modules outside ``blocks`` whose parameters
    no other module shares, in ``model.modules()`` order: what
    ``editrain.parallelize(split_root=True)`` shards as units of their own (and the
    engine syncs as units of their own in an unsharded model). Tied embeddings stay in
    the root: a model whose ``config`` says ``tie_embeddings`` or ``tie_word_embeddings``
    (editrain's Llama, Hugging Face models) may read the embedding matrix outside the
    embedding's own forward, where FSDP2 has resharded it."""
    config = getattr(model, "config", None)
    tied = bool(getattr(config, "tie_embeddings", False)
                or getattr(config, "tie_word_embeddings", False))
    in_blocks = {id(m) for b in blocks for m in b.modules()}
    users: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            users[id(p)] = users.get(id(p), 0) + 1
    out = []
    for m in model.modules():
        if id(m) in in_blocks or not isinstance(m, (nn.Embedding, nn.Linear)):
            continue
        if tied and isinstance(m, nn.Embedding):
            continue
        params = list(m.parameters(recurse=False))
        if params and all(users[id(p)] == 1 for p in params):
            out.append(m)
    return out


def unit_modules(model: nn.Module, blocks: Sequence[nn.Module], split_root: bool = True
                 ) -> list[tuple[str, nn.Module]]:
    """The modules that are sync units besides the root, in ``model.modules()`` order:
    every block, and every FSDP2 unit outside the blocks that contains no block (e.g. the
    embeddings and output head sharded on their own; see ``docs/streaming.md``). In an
    unsharded model (nothing is an FSDP2 unit) with ``split_root``, the modules
    :func:`root_leaf_units` names, so that the units match the sharded layout's."""
    in_blocks = {id(m) for b in blocks for m in b.modules()}
    # A pipeline stage (editrain.pipeline.LlamaStage) names its blocks by their index in
    # the whole model, so unit names (and the checkpoint keys made of them) are global:
    # ``block_ids`` (an interleaved stage's blocks are not contiguous), else an offset.
    ids = getattr(model, "block_ids", None)
    if ids is None or len(ids) != len(blocks):
        offset = int(getattr(model, "block_offset", 0))
        ids = [offset + i for i in range(len(blocks))]
    block_ids = {id(b): int(i) for b, i in zip(blocks, ids, strict=True)}
    extra: list[nn.Module] = []
    if not isinstance(model, FSDPModule) and split_root:
        extra = root_leaf_units(model, blocks)
    for m in model.modules():
        if m is model or id(m) in in_blocks or not isinstance(m, FSDPModule):
            continue
        if any(id(x) in block_ids for x in m.modules()):
            continue  # a container of blocks (e.g. an inner model) is not a unit
        if any(m in set(e.modules()) for e in extra):
            continue  # nested inside another unit
        extra.append(m)
    names = {id(m): n for n, m in model.named_modules()}
    chosen = {id(m) for m in extra} | set(block_ids)
    out = []
    for m in model.modules():
        if id(m) in block_ids:
            out.append((f"block{block_ids[id(m)]}", m))
        elif id(m) in chosen:
            out.append((names[id(m)], m))
    return out



def comm_group_backend(choice: str) -> str | None:
    """The backend of the engine's private groups for ``comm_backend`` (None: the default
    process group's)."""
    if choice not in COMM_BACKENDS:
        raise ValueError(f"comm_backend: allowed {', '.join(COMM_BACKENDS)}; got {spelled(choice)}")
    if choice == "default":
        return None
    return "gloo" if choice == "auto" else choice


def check_sharding(model: nn.Module, blocks: Sequence[nn.Module], shard_size: int) -> None:
    """The layout the layer-wise sync relies on: either every block *and* the root are FSDP2
    units of their own (``fully_shard`` on each block, then on the root), or nothing is
    sharded: a replica is one process, or each of its ranks holds a full copy of plain
    (non-DTensor) parameters, kept identical by the caller (e.g. ``DistributedDataParallel``
    over the replica's group).

    Raises:
        ValueError: naming the offending block(s) and how to shard them.
    """
    root_sharded = isinstance(model, FSDPModule)
    names = {id(m): n for n, m in model.named_modules()}
    plain = [f"{i} ({names.get(id(b), '?')})" for i, b in enumerate(blocks)
             if not isinstance(b, FSDPModule)]
    how = ("call fully_shard(block, mesh=shard_mesh) on every block, then "
           "fully_shard(model, mesh=shard_mesh) on the root (editrain.parallelize does both)")
    if root_sharded and plain:
        raise ValueError(f"block(s) {', '.join(plain)} are not FSDP2 units of their own: the "
                         f"layer-wise sync needs one unit per block; {how}")
    if not root_sharded and len(plain) < len(blocks):
        raise ValueError(f"the blocks are FSDP2 units but the root module is not: {how}")
    if not root_sharded and shard_size > 1 and any(isinstance(p, DTensor)
                                                   for p in model.parameters()):
        raise ValueError(f"a replica has {shard_size} ranks and the model has DTensor "
                         f"parameters but is not sharded by FSDP2: {how}")


def check_replica_wrapper(model: nn.Module, replica_ranks: Sequence[int]) -> None:
    """A ``DistributedDataParallel`` wrapper must average gradients over this rank's replica
    (``mesh.get_group("shard")``) and nothing wider: over the world it would keep every
    replica in step, and the local phase would not be local.

    Raises:
        ValueError: the wrapper's process group is not the replica's ranks.
    """
    if not isinstance(model, DistributedDataParallel):
        return
    ranks = sorted(dist.get_process_group_ranks(model.process_group))
    if ranks != sorted(replica_ranks):
        raise ValueError(
            f"the DistributedDataParallel wrapper averages gradients over ranks {ranks}, "
            f"but this rank's replica is ranks {sorted(replica_ranks)}: wrap the model over "
            "the replica's own group, DistributedDataParallel(model, "
            "process_group=mesh.get_group('shard')) (info.shard_mesh.get_group())")


_LIVE_ENGINES: weakref.WeakKeyDictionary[nn.Module, weakref.ref[Any]] = (
    weakref.WeakKeyDictionary())
"""Module -> the engine whose forward hooks it carries (weak both ways: a model and its
engine are collected as if this table did not exist)."""


def check_no_live_engine(modules: Sequence[nn.Module]) -> None:
    """Refuse a second engine on modules that a live (not closed) engine already hooks.

    Both engines' hooks would run in every forward and each engine, stepped, would run its
    own syncs and outer steps on the same parameters: wrong results, no error. A closed
    engine has removed its hooks, so its model may get a new engine (a notebook cell run
    again after ``engine.close()``).

    Raises:
        RuntimeError: one of ``modules`` (the root or a block) has a live engine.
    """
    for module in modules:
        ref = _LIVE_ENGINES.get(module)
        engine = None if ref is None else ref()
        if engine is not None and not engine.closed:
            raise RuntimeError(
                f"editrain.edit(): {type(module).__name__} already has a live sync engine "
                "on it; close that engine first (engine.close(), or let its `with` block "
                "end), then build the new one")


def claim_modules(modules: Sequence[nn.Module], engine: Any) -> None:
    """Record ``engine`` as the live engine of ``modules`` (see :func:`check_no_live_engine`)."""
    for module in modules:
        _LIVE_ENGINES[module] = weakref.ref(engine)


def find_root_params(model: nn.Module, blocks: Sequence[nn.Module]) -> list[nn.Parameter]:
    """Parameters of ``model`` that belong to none of ``blocks`` (the root unit)."""
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    seen: set[int] = set()
    out = []
    for p in model.parameters():
        if id(p) not in in_blocks and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def default_trigger(cfg: SyncConfig) -> SyncTrigger:
    """The method's trigger: every ``T`` seconds (A-EDiT) or every ``H`` inner steps."""
    if cfg.use_async:
        return TimeTrigger(cfg.local_sgd_sync_time)
    assert cfg.local_sgd_sync_interval is not None
    return IntervalTrigger(cfg.local_sgd_sync_interval)


def check_fault_tolerant(cfg: SyncConfig, replicas_in_world: int) -> None:
    """The fault-tolerant mode's limits: one replica per job, blocking local-SGD rounds."""
    problems = []
    if replicas_in_world != 1:
        problems.append(f"the mesh must be this replica's own (1 replica, got "
                        f"{replicas_in_world})")
    if not cfg.is_local_sgd:
        problems.append(f"sync.method={cfg.method} is synchronous (needs every replica "
                        f"at every step)")
    elif cfg.local_sgd_warmup_steps:
        problems.append("sync.local_sgd_warmup_steps must be 0 (warm-up averages gradients "
                        "at every step)")
    if cfg.merge == "eager":
        problems.append("sync.merge = 'eager' is not supported yet (per-replica outer state "
                        "would have to travel with a heal)")
    elif cfg.use_async and cfg.overlap_steps > 0:
        problems.append("non-blocking A-EDiT (sync.overlap_steps > 0) is not supported yet")
    elif cfg.streaming and cfg.is_local_sgd and cfg.local_sgd_sync_interval:
        gap = cfg.local_sgd_sync_interval // cfg.fragments
        if cfg.overlap_steps > gap:
            problems.append(f"sync.overlap_steps must be <= local_sgd_sync_interval // "
                            f"fragments = {gap} (one round in flight at a time), got "
                            f"{cfg.overlap_steps}")
    if problems:
        raise ValueError("dist.fault_tolerance=torchft: " + "; ".join(problems))


def reshard(module: nn.Module) -> None:
    """Free FSDP2's gathered parameters of ``module`` (a no-op for plain modules)."""
    if isinstance(module, FSDPModule):
        module.reshard()


@dataclass
class Units:
    """The engine's units and the modules whose forward pre-hooks drive a layer-wise sync."""

    units: list[SyncUnit]
    """In forward order: the root first (when it holds parameters), then the modules."""
    modules: list[tuple[str, nn.Module]]
    """The non-root units' modules, in the order of :attr:`units` after the root."""
    first_module_unit: int
    """Index in :attr:`units` of ``modules[0]`` (1 with a root unit, else 0)."""


def build_units(model: nn.Module, blocks: Sequence[nn.Module], cfg: SyncConfig, topo: Topology,
                rank: int, gather: Callable[[torch.Tensor], torch.Tensor]) -> Units:
    """Check the layout, then one :class:`SyncUnit` per unit of ``model`` (the unwrapped
    module) with the outer optimizer of ``cfg``. ``gather`` is the replica's all-gather,
    used when every rank of a replica holds a full copy (the DDP path): each rank then
    syncs a ``1/S`` slice of every unit and the replica all-gathers the slices."""
    check_sharding(model, blocks, topo.shard_size)
    if topo.tp_size > 1 and topo.shard_size > 1 and not isinstance(model, FSDPModule):
        raise ValueError(f"tensor parallelism (tp_size={topo.tp_size}) with "
                         f"{topo.shard_size} shards per replica needs FSDP2 over "
                         "'shard' (editrain.parallelize); the DDP path takes tp_size 1")
    outer_cls = resolve_optimizer_class(cfg.outer_optim_class)
    modules = unit_modules(model, blocks, cfg.split_root)
    root = find_root_params(model, [m for _, m in modules])
    # The root is a unit when it holds parameters (with split_root it may hold none).
    entries = ([("root", root)] if root else []) + [(n, list(m.parameters()))
                                                     for n, m in modules]
    feedback = cfg.comm_dtype != "fp32" and cfg.error_feedback
    part = None
    if topo.shard_size > 1 and not isinstance(model, FSDPModule):
        part = (topo.shard_of(rank), topo.shard_size)
    # Under tensor parallelism a replica's ranks hold some pieces twice or more (norms,
    # embeddings, row-wise biases on every tp peer): statistics count them once. Only the
    # ranks of this rank's pipeline stage hold its units.
    size = topo.stage_size
    units = [
        SyncUnit(i, n, ps, outer_cls, cfg.outer_optim_kwargs or {}, cfg.cpu_offload,
                 error_feedback=feedback, part=part, gather=gather if part else None,
                 copies=None if part else [copies_in_replica(p, size) for p in ps],
                 eager_replicas=topo.num_replicas if cfg.merge == "eager" else 0)
        for i, (n, ps) in enumerate(entries)
    ]
    if cfg.fragments > len(units):
        raise ValueError(f"sync.fragments: must be <= the number of sync units "
                         f"({len(units)}: {', '.join(n for n, _ in entries)}), got "
                         f"{cfg.fragments}")
    return Units(units, modules, 1 if root else 0)


@dataclass
class Groups:
    """The engine's process groups besides the mesh's."""

    sync: dist.ProcessGroup | None
    """Private copy of this rank's sync group (communication thread); None with 1 replica."""
    replica: dist.ProcessGroup | None
    """Private group over the ranks that hold this rank's units (communication thread:
    statistics, clipping): the whole replica, or with pipeline stages this rank's stage
    of it (``S x T`` ranks)."""
    replica_main: dist.ProcessGroup | None
    """The main thread's group over this rank's whole replica, every stage (the mesh's
    shard group without tensor or pipeline parallelism)."""
    agree: dist.ProcessGroup | None = None
    """With pipeline stages only: a private group over the whole replica, every stage
    (communication thread: what every rank of a replica must decide alike, e.g. A-EDiT's
    elapsed time). None otherwise: :attr:`replica` is then the whole replica."""
    own: list[dist.ProcessGroup] = field(default_factory=list)
    """The groups above that the engine created (not the mesh's), which it destroys when it
    closes (:meth:`editrain.sync.edit.SyncEngine.close`)."""


def private_groups(topo: Topology, mesh: DeviceMesh, backend: str | None) -> Groups:
    """The communication thread's private copies of this rank's sync group and replica
    group. The main thread owns the mesh's groups (FSDP2 on the shard group; the caller's
    own collectives on the world group, which the mesh may reuse as its sync group), and a
    delayed sync's collectives run while the main thread trains: two threads must never
    share a process group. Every rank creates every group, in the same order.

    With pipeline stages the replica's ranks hold different units: statistics are summed
    over the stage's ranks (:attr:`Groups.replica`), and what every rank of the replica
    must decide alike is agreed over all of its stages (:attr:`Groups.agree`,
    :attr:`Groups.replica_main`)."""
    sync_group = None
    if topo.num_replicas > 1:
        sync_group, _ = dist.new_subgroups_by_enumeration(
            [topo.sync_ranks(i) for i in range(topo.replica_size)], backend=backend)
    replica_group = None
    stage_ranks = [topo.stage_ranks(r, p) for r in range(topo.num_replicas)
                   for p in range(topo.pp_size)]
    if topo.stage_size > 1:
        replica_group, _ = dist.new_subgroups_by_enumeration(stage_ranks, backend=backend)
    replica_ranks = [topo.replica_ranks(r) for r in range(topo.num_replicas)]
    agree = None
    if topo.pp_size > 1:
        agree, _ = dist.new_subgroups_by_enumeration(replica_ranks, backend=backend)
    main = None
    if topo.tp_size > 1 or topo.pp_size > 1:
        main, _ = dist.new_subgroups_by_enumeration(replica_ranks)
    elif topo.shard_size > 1:
        main = mesh.get_group(SHARD_DIM)
    own = [g for g in (sync_group, replica_group, agree) if g is not None]
    if topo.tp_size > 1 or topo.pp_size > 1:
        own += [main] if main is not None else []
    return Groups(sync_group, replica_group, main, agree, own)


def release_groups(groups: Groups) -> None:
    """Destroy the engine's own process groups, after every rank has reached this point
    (a barrier on the default group), and before the default group is destroyed by whoever
    created it. Left to the interpreter's exit instead, gloo's teardown of a group whose
    peers are already gone aborts the process now and then ("terminate called without an
    active exception", SIGABRT: a finished job reported as failed). Every rank calls it.
    """
    if not dist.is_initialized():
        return
    dist.barrier()
    for g in groups.own:
        dist.destroy_process_group(g)
    groups.own.clear()
