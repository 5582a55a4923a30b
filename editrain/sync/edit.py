"""The sync engine: local SGD with layer-wise sync in the forward pass, on top of FSDP2.

One engine, :class:`SyncEngine`, serves every method (sync, post_local_sgd, diloco, edit,
aedit; see :mod:`editrain.sync.methods`); ``EDiT`` is its original name, kept as an alias.
The user's loop stays plain::

    engine = SyncEngine(model, mesh, SyncConfig(method="edit"), blocks=model.layers)
    for batch in data:
        loss_fn(model(batch)).backward()
        engine.after_backward()        # warm-up: average gradients over the sync group too
        optimizer.step(); optimizer.zero_grad()
        engine.step()                  # counts steps; arms (or runs) the next sync
    engine.finish()                    # runs a sync that is still pending

How a layer-wise sync runs (``edit`` / ``aedit``): after ``H`` inner steps the engine arms a
sync. The next training forward enters the root unit's forward pre-hook, which queues the
statistics job and the first ``1 + prefetch_depth`` unit jobs on the communication thread
and waits for the root unit. Each block's pre-hook queues the unit ``prefetch_depth`` ahead
and waits only for its own unit. The hooks are registered *after* ``fully_shard`` with
``prepend=True``, so they run before FSDP2 all-gathers the unit: the all-gather already sees
the new global parameters. DiLoCo and Post-Local SGD run the very same jobs, all at once, at
the step boundary.

Streaming (``overlap_steps``, ``fragments``, ``comm_dtype``; formulas in
``docs/streaming.md``): the units are split into fragments that take turns; a fragment's
*round* either runs in the next forward as above (``overlap_steps = 0``) or is launched at a
step boundary (parameters snapshotted, every job queued at once) and merged into the live
parameters ``overlap_steps`` inner steps later, in the forward pre-hooks again. Quantised
pseudo-gradients are gathered and summed in fp32, with error feedback.

The engine owns all of its state: ``state_dict()`` / ``load_state_dict()`` give and take it
as a DCP-ready tree whose layout lives in :mod:`editrain.sync.state`.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.profiler import record_function
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from editrain.sync import quant
from editrain.sync.comm import CommPath, CommStats, LinkDelay
from editrain.sync.config import SyncConfig
from editrain.sync.ft_round import FaultTolerantSync
from editrain.sync.outer import SyncUnit, copies_in_replica, local_view, resolve_optimizer_class
from editrain.sync.penalty import DetectorBank, clip_coefficient, compute_weights, finite_mask
from editrain.sync.progress import Progress
from editrain.sync.reducers import build_reducer
from editrain.sync.state import StateLayout
from editrain.sync.triggers import FragmentSchedule, IntervalTrigger, SyncTrigger, TimeTrigger
from editrain.topology import SHARD_DIM, topology_of
from editrain.units import unwrap_ddp

BeforeSyncHook = Callable[[int], None]
"""Called on every rank, in the main thread, just before sync number ``n`` starts."""


@dataclass
class SyncRound:
    """Book-keeping of one sync (of one fragment's units) in flight."""

    index: int
    step_counts: torch.Tensor | None
    units: list[int]
    """The round's units, in forward order."""
    fragment: int = 0
    delayed: bool = False
    """Launched at a step boundary and merged ``overlap_steps`` steps later."""
    launch_step: int = 0
    apply_at: int = 0
    """Delayed rounds: the global step after which the merge is due."""
    submitted: list[Future] = field(default_factory=list)
    stats: Future | None = None
    waited: int = 0
    """Positions of ``units`` waited for (and, if delayed, merged)."""
    wait_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)
    comm: CommStats = field(default_factory=CommStats)
    windows: list[float] | None = None
    """A-EDiT: every replica's agreed elapsed time when it entered the rendezvous."""
    rendezvous: Future | None = None
    """Non-blocking A-EDiT: the job gathering the step counts (the round's first job)."""
    skipped: bool = False
    """Non-blocking A-EDiT: too few steps in total; nothing is reduced or merged."""
    my_steps: int = 0
    """Non-blocking A-EDiT: this replica's steps up to its snapshot."""
    work_s: float = 0.0
    """Wall time of the round's jobs on the communication thread."""
    # Filled by the statistics job (identical on every rank).
    norms: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    outlier: torch.Tensor | None = None
    z: torch.Tensor | None = None
    clip: list[float] = field(default_factory=list)
    # The fault-tolerant mode (sync/ft_round.py).
    members: list[int] | None = None
    """Replica ids of the quorum, in the order of its collectives."""
    contributes: list[bool] | None = None
    """Per member: whether it sends a pseudo-gradient (a healed replica does not)."""
    quorum: Any = None
    """The fault-tolerant mode, delayed rounds: the quorum it was launched in."""
    quorum_wait_s: float = 0.0
    tentative: dict[int, torch.Tensor | None] | None = None
    """Reduced pseudo-gradients by position, applied only once the round commits (None:
    nobody was trusted for that unit)."""

    def position(self, u: int) -> int:
        """Number of the round's units with index ``<= u``."""
        return bisect.bisect_right(self.units, u)


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
    block_ids = {id(b): i for i, b in enumerate(blocks)}
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


COMM_BACKENDS = ("auto", "gloo", "nccl", "default")


def comm_group_backend(choice: str) -> str | None:
    """The backend of the engine's private groups for ``comm_backend`` (None: the default
    process group's)."""
    if choice not in COMM_BACKENDS:
        raise ValueError(f"comm_backend: allowed {', '.join(COMM_BACKENDS)}; got {choice!r}")
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


class SyncEngine:
    """Local-SGD engine (EDiT, A-EDiT, DiLoCo, Post-Local SGD, synchronous) for FSDP2 models.

    Construct it *after* ``fully_shard`` has been applied to every block and to the root
    module, with the same initial parameters on every replica.

    Args:
        model: the root module (it must be a unit of its own under FSDP2), or an unsharded
            module whose full copy every rank of a replica holds, e.g. one wrapped in
            ``DistributedDataParallel`` over the replica's group (each rank then syncs a
            ``1/S`` slice of every unit and the replica all-gathers it).
        mesh: the ``("sync", "shard")`` DeviceMesh (see :func:`editrain.init_mesh`).
        config: the method and its options (``None`` fields take the method's defaults).
        blocks: the model's blocks in forward order (one sync unit each).
        link_delay: optional simulated cost of a cross-replica message (see ``editrain.sim``).
        trigger: override of the sync trigger (tests use a fixed step schedule).
        before_sync: optional hook called just before each sync (fault injection).
        comm_backend: backend of the engine's private process groups (the communication
            thread's cross-replica and statistics collectives): "auto" (gloo: on CUDA the
            tensors are staged through pinned host memory, so the thread never shares NCCL
            with FSDP2's collectives on the main thread; see ``docs/architecture.md``),
            "gloo", or "nccl" (faster on fast links; NCCL then runs two threads'
            collectives concurrently, which is only safe where the GPU can run both
            kernels at once), or "default" (the default process group's backend).
        seed: seeds the random sparsification of the GTA reducer (saved with the state:
            the engine's only randomness is derived from it, the sync index, the unit and the
            rank).
        clock: seconds of a monotonic clock for A-EDiT's time trigger and budget (default
            ``time.perf_counter``; tests inject their own). Metrics use real time.
        cross_replica: the fault-tolerant mode: a :class:`editrain.sync.ft.TorchftGroup`
            through which every cross-replica collective goes (``mesh`` is then this
            replica's own ``(1, S)`` mesh); syncs run as all-or-nothing rounds over the
            replicas present (:mod:`editrain.sync.ft_round`).
    """

    def __init__(
        self,
        model: nn.Module,
        mesh: DeviceMesh,
        config: SyncConfig,
        blocks: Sequence[nn.Module],
        *,
        link_delay: LinkDelay | None = None,
        trigger: SyncTrigger | None = None,
        before_sync: BeforeSyncHook | None = None,
        seed: int = 0,
        clock: Callable[[], float] | None = None,
        comm_backend: str = "auto",
        cross_replica: Any = None,
    ) -> None:
        self.config = cfg = config.resolve()
        self.model = model
        self.mesh = mesh
        self.topo = topology_of(mesh)
        self.rank = dist.get_rank()
        self.replica = self.topo.replica_of(self.rank)
        self.num_replicas = self.topo.num_replicas
        if cross_replica is not None:
            check_fault_tolerant(cfg, self.topo.num_replicas)
            self.replica, self.num_replicas = cross_replica.replica, cross_replica.replicas
        self.seed = seed
        self.before_sync = before_sync
        self.clock = clock or time.perf_counter
        blocks = list(blocks)
        if not blocks:
            raise ValueError("the sync engine needs at least one block (sync unit) in `blocks`")

        # Units in forward order: the root first (its all-gather happens first), then every
        # block and every other separately sharded module (embeddings, output head).
        check_replica_wrapper(model, self.topo.replica_ranks(self.replica))
        model = unwrap_ddp(model)  # hooks, units and state names: the wrapped module's
        check_sharding(model, blocks, self.topo.shard_size)
        if self.topo.tp_size > 1 and self.topo.shard_size > 1 and not isinstance(model,
                                                                                  FSDPModule):
            raise ValueError(f"tensor parallelism (tp_size={self.topo.tp_size}) with "
                             f"{self.topo.shard_size} shards per replica needs FSDP2 over "
                             "'shard' (editrain.parallelize); the DDP path takes tp_size 1")
        outer_cls = resolve_optimizer_class(cfg.outer_optim_class)
        modules = unit_modules(model, blocks, cfg.split_root)
        root = find_root_params(model, [m for _, m in modules])
        # The root is a unit when it holds parameters (with split_root it may hold none).
        entries = ([("root", root)] if root else []) + [(n, list(m.parameters()))
                                                         for n, m in modules]
        self._first_module_unit = 1 if root else 0
        feedback = cfg.comm_dtype != "fp32" and cfg.error_feedback
        # Full copies on the S ranks of a replica (DDP): each rank syncs a 1/S slice of every
        # unit, and the replica all-gathers the slices on the communication thread.
        part = None
        if self.topo.shard_size > 1 and not isinstance(model, FSDPModule):
            part = (self.topo.shard_of(self.rank), self.topo.shard_size)
        gather = (lambda t: self.comm.call(self.comm.all_gather_shard, t)) if part else None
        # Under tensor parallelism a replica's ranks hold some pieces twice or more (norms,
        # embeddings, row-wise biases on every tp peer): statistics count them once.
        size = self.topo.replica_size
        self.units = [
            SyncUnit(i, n, ps, outer_cls, cfg.outer_optim_kwargs or {}, cfg.cpu_offload,
                     error_feedback=feedback, part=part, gather=gather,
                     copies=None if part else [copies_in_replica(p, size) for p in ps])
            for i, (n, ps) in enumerate(entries)
        ]
        names = [n for n, _ in entries]
        self.device = next((u.device for u in self.units if u.params), self.units[0].device)
        if cfg.fragments > len(self.units):
            raise ValueError(f"sync.fragments: must be <= the number of sync units "
                             f"({len(self.units)}: {', '.join(names)}), got {cfg.fragments}")
        self.fragments = [list(range(f, len(self.units), cfg.fragments))
                          for f in range(cfg.fragments)]
        """Fragment ``f``'s units: every ``P``-th unit from ``f`` (strided over depth)."""
        self.schedule = (FragmentSchedule(cfg.local_sgd_sync_interval, cfg.fragments)
                         if cfg.streaming and not cfg.use_async else None)
        self.nonblocking = cfg.use_async and cfg.overlap_steps > 0
        """A-EDiT's non-blocking sync: the rendezvous and the reduction run behind
        ``overlap_steps`` inner steps, then the round is merged (``docs/streaming.md``)."""
        self._layout = StateLayout(self.units, model, self.rank, self.topo.shape)

        # Process groups of the communication thread: private copies of this rank's sync
        # group and shard group. The main thread owns the mesh's groups (FSDP2 on the shard
        # group; the caller's own collectives, e.g. a loss all-reduce, on the world group,
        # which the mesh may reuse as its sync group), and a delayed sync's collectives run
        # while the main thread trains: two threads must never share a process group.
        backend = comm_group_backend(comm_backend)
        # The "shard group" of the engine is the whole replica (S x T ranks with tensor
        # parallelism): every statistic is summed over it.
        sync_group = None
        if self.topo.num_replicas > 1:
            sync_group, _ = dist.new_subgroups_by_enumeration(
                [self.topo.sync_ranks(i) for i in range(self.topo.replica_size)],
                backend=backend
            )
        shard_group = None
        replica_groups = [self.topo.replica_ranks(r) for r in range(self.topo.num_replicas)]
        if self.topo.replica_size > 1:
            shard_group, _ = dist.new_subgroups_by_enumeration(replica_groups, backend=backend)
        self._replica_group = None
        """The main thread's group over this replica's ranks (the mesh's shard group
        without tensor parallelism)."""
        if self.topo.tp_size > 1:
            self._replica_group, _ = dist.new_subgroups_by_enumeration(replica_groups)
        elif self.topo.shard_size > 1:
            self._replica_group = self.mesh.get_group(SHARD_DIM)
        self.comm = CommPath(sync_group, shard_group, self.device, link_delay,
                             stage_on_host=backend == "gloo" and self.device.type != "cpu",
                             cross=cross_replica)

        self.reducer = build_reducer(cfg.gta.reducer, **_gta_kwargs(cfg))
        self.detectors = (
            DetectorBank(len(self.units), self.num_replicas, cfg.ewma_alpha,
                         cfg.ewma_warmup_steps, cfg.ewma_threshold)
            if cfg.skip_anomaly else None
        )
        if trigger is not None:
            self.trigger = trigger
        elif cfg.use_async:
            self.trigger = TimeTrigger(cfg.local_sgd_sync_time)
        else:
            assert cfg.local_sgd_sync_interval is not None
            self.trigger = IntervalTrigger(cfg.local_sgd_sync_interval)
        self._needs_clock = bool(getattr(self.trigger, "needs_clock", False))
        self.merge_when_done = self.nonblocking and self._needs_clock
        """Non-blocking A-EDiT on the wall clock: a round is merged at the first step
        boundary, ``overlap_steps`` or more after its launch, at which it is complete on
        every rank of the replica (never waited for); the clock restarts there. With a
        deterministic trigger (a fixed step schedule) it is merged exactly
        ``overlap_steps`` steps after its launch, waiting if need be."""

        # Counters (all saved by state_dict()).
        self.global_step = 0
        self.steps_since_sync = 0
        self.num_syncs = 0
        self.num_skipped_syncs = 0
        self.num_syncs_forced = 0
        self.total_wait_s = 0.0
        """Seconds the caller's thread waited for sync jobs, since the start (metrics)."""
        self.total_grad_sync_s = 0.0
        """Seconds spent averaging gradients across replicas (warm-up / sync method)."""
        self.progress = Progress(self.num_replicas, self.topo.shard_size)
        """A-EDiT's progress and budget (:mod:`editrain.sync.progress`)."""
        self._pending_windows: list[float] | None = None
        self._pending_counts: torch.Tensor | None = None
        self._pending = False
        self._pending_fragment = 0
        self._clock_start = self.clock()
        self._launch_clock = self._clock_start
        self._window_offset = 0.0
        """Non-blocking A-EDiT, merge when done: seconds from the last launch to the merge
        (agreed within the replica), which the next window's length includes."""
        self._round: SyncRound | None = None
        """The round whose units the current forward waits for (or that runs blocking)."""
        self._inflight: list[SyncRound] = []
        """Delayed rounds launched and not yet merged, in launch order."""
        self._merge_next: SyncRound | None = None
        """A delayed round due: merged unit by unit in the next training forward."""
        self._next_index = 0
        self._last_sync_step = -1
        self._starting: list[int] | None = None
        self._sync_log: list[dict[str, Any]] = []
        self._rendezvous_wait_s = 0.0
        self._rendezvous_comm = CommStats()
        """A-EDiT: traffic of the rendezvous, counted with the sync that follows it."""

        self.ft = None if cross_replica is None else FaultTolerantSync(self, cross_replica)
        """The fault-tolerant rounds (None in the plain mode)."""

        self._handles = [model.register_forward_pre_hook(self._root_pre_hook, prepend=True)]
        for u, (_, module) in enumerate(modules, start=self._first_module_unit):
            self._handles.append(
                module.register_forward_pre_hook(self._make_block_hook(u), prepend=True)
            )
        _reshard(model)  # anchors must be taken from the shards, not a gathered copy
        if cfg.is_local_sgd and cfg.local_sgd_warmup_steps == 0:
            self._create_anchors()

    # ================================================================== public loop API
    def __enter__(self) -> SyncEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # A-EDiT's book-keeping, kept under its former names.
    @property
    def synced_replica_steps(self) -> float:
        """Replica-steps of all replicas up to the last sync."""
        return self.progress.synced_replica_steps

    @property
    def last_window_counts(self) -> list[float] | None:
        """Each replica's steps in the last sync's window."""
        return self.progress.last_window_counts

    @property
    def last_window_s(self) -> float:
        """Length of the last window (gathered: identical on every rank)."""
        return self.progress.last_window_s

    def set_budget(self, steps: float | None) -> None:
        """A-EDiT: the run's budget in synchronous-step equivalents (``train.steps``). With
        the time trigger, a replica then also enters the rendezvous once the cluster has
        probably used it up; :attr:`budget_spent` says when a sync has reached it."""
        self.progress.budget = steps

    @property
    def budget_spent(self) -> bool:
        """Whether a finished sync reached the budget (agreed: from gathered counts)."""
        return self.progress.spent

    @property
    def tokens_scale(self) -> float:
        """Ranks whose per-rank tokens make one synchronous step of progress (``R * S`` of
        the topology the budget is counted in; see :mod:`editrain.sync.progress`)."""
        r, s = self.progress.reference or (self.num_replicas, self.topo.shard_size)
        return float(r * s)

    @property
    def progress_steps(self) -> float:
        """Progress in synchronous-step equivalents: the step count for every method but
        A-EDiT, whose replicas run at their own pace (exact at syncs, estimated between)."""
        if not self.config.use_async or self.in_warmup:
            return float(self.global_step)
        return self.progress.estimate(self.replica, self.steps_since_sync)

    def sync_point(self) -> float | None:
        """Progress if this step boundary is a sync point (identical on every rank), else
        None. Evaluations, checkpoints and the end of an A-EDiT run belong there, so every
        replica takes them at the same place with the same (global) model. Streaming runs
        are in lock-step but never all hold one model: every step is a point (they
        evaluate the anchors)."""
        cfg = self.config
        if self.nonblocking and not self.in_warmup:
            if self._last_sync_step == self.global_step:
                return self.progress.synced_replica_steps * self.progress.unit
            return None
        if not cfg.is_local_sgd or self.in_warmup or cfg.streaming:
            return float(self.global_step)
        if self._pending:
            if cfg.use_async:
                assert self._pending_counts is not None
                return self.progress.at_sync(self._pending_counts.tolist())
            return float(self.global_step)
        if self.steps_since_sync == 0:
            return (self.progress.synced_replica_steps / self.num_replicas if cfg.use_async
                    else float(self.global_step))
        return None

    @property
    def in_warmup(self) -> bool:
        """Whether training is (still) synchronous: gradients are averaged across replicas."""
        return not self.config.is_local_sgd or self.global_step < self.config.local_sgd_warmup_steps

    @torch.no_grad()
    def after_backward(self) -> None:
        """Call after the last micro-batch's backward, before ``optimizer.step()``.

        During warm-up (and for the synchronous method) this averages each rank's gradient
        shard over its sync group, completing HSDP semantics; FSDP2 already averaged over
        the shard group. In the local phase it does nothing: no cross-replica traffic.
        """
        if not self.in_warmup or self.num_replicas == 1:
            return
        t0 = time.perf_counter()
        with record_function("editrain::grad_allreduce"):
            self.comm.run(self._grad_allreduce_job)
        self.total_grad_sync_s += time.perf_counter() - t0

    def step(self) -> None:
        """Call once after each inner ``optimizer.step()``: counts and triggers syncs."""
        self._drain_round()  # a forward that skipped some units must not leave jobs behind
        self.global_step += 1
        cfg = self.config
        if not cfg.is_local_sgd:
            return
        if self.global_step <= cfg.local_sgd_warmup_steps:
            if self.global_step == cfg.local_sgd_warmup_steps:
                self._create_anchors()
            return
        self.steps_since_sync += 1
        if self.schedule is not None and self.ft is not None:
            self.ft.streaming_step(self.schedule.launches(
                self.global_step - cfg.local_sgd_warmup_steps))
            return
        if self.schedule is not None:
            self._streaming_step()
            return
        if self.nonblocking:
            self._nonblocking_step()
            return
        needs_clock = self._needs_clock
        elapsed = self._agreed_elapsed() if needs_clock else 0.0
        due = self.trigger.due(self.replica, self.steps_since_sync, elapsed)
        if not due and needs_clock and cfg.use_async:
            # The budget's end (agreed: the elapsed time within the replica, the rate from
            # the gathered last window).
            due = self.progress.budget_due(elapsed, self.steps_since_sync)
        if not due:
            return
        if self.ft is not None:
            self.ft.run(elapsed=elapsed if cfg.use_async else None)
            return
        counts = self._rendezvous(elapsed) if cfg.use_async else None
        if cfg.use_async and counts is None:
            return  # skipped: too few steps in total; clocks restarted
        if cfg.layerwise:
            self._pending, self._pending_counts = True, counts
        else:
            self._run_blocking(counts)

    def _streaming_step(self) -> None:
        """Merge the delayed round that is due, then launch the fragments due now."""
        cfg = self.config
        assert self.schedule is not None
        if self._merge_next is not None:  # no training forward took it: merge it now
            self._round, self._merge_next = self._merge_next, None
            self._drain_round()
        if self._pending:  # likewise for an armed round (every fragment launches in turn)
            self._run_blocking(None, self.fragments[self._pending_fragment],
                               self._pending_fragment)
        if self._inflight and self._inflight[0].apply_at == self.global_step:
            rnd = self._inflight.pop(0)
            if cfg.layerwise:
                self._merge_next = rnd
            else:
                self._round = rnd
                self._drain_round()
        for f in self.schedule.launches(self.global_step - cfg.local_sgd_warmup_steps):
            if cfg.overlap_steps > 0:
                self._launch(f)
            elif cfg.layerwise:
                self._pending, self._pending_fragment = True, f
            else:
                self._run_blocking(None, self.fragments[f], f)

    def _nonblocking_step(self) -> None:
        """A-EDiT, non-blocking: merge the round that is due, then launch one if this
        replica's trigger (or the budget's end) says so and none is in flight."""
        cfg = self.config
        # The due round is merged here, at the step boundary (not in the next forward), so
        # that a launch at this very step snapshots the merged model.
        if (self._inflight and self.global_step >= self._inflight[0].apply_at
                and self._ready_to_merge(self._inflight[0])):
            self._round = self._inflight.pop(0)
            self._drain_round()
        if self._inflight or self.progress.spent:
            # One round in flight at a time: the k-th launches of all replicas pair up. Once
            # a sync has spent the budget (agreed) nobody launches again: the run ends there.
            return
        elapsed = self._agreed_elapsed() if self._needs_clock else 0.0
        window = elapsed + self._window_offset  # since the last launch (agreed)
        due = self.trigger.due(self.replica, self.steps_since_sync, elapsed)
        if not due and self._needs_clock:
            due = self.progress.budget_due(window, self.steps_since_sync)
        if not due:
            return
        units = list(range(len(self.units)))
        self._call_before_sync(units)
        for u in units:
            self.units[u].launch = self.units[u].flat_params()
        mine = torch.tensor([self.steps_since_sync, window], dtype=torch.float64,
                            device=self.device)
        rnd = SyncRound(index=self._next_index, step_counts=None, units=units,
                     launch_step=self.global_step, delayed=True,
                     apply_at=self.global_step + cfg.overlap_steps, comm=self._rendezvous_comm)
        self._rendezvous_comm = CommStats()
        self._next_index += 1
        rnd.my_steps = self.steps_since_sync
        rnd.rendezvous = self.comm.submit(self._rendezvous_job, rnd, mine, stats=rnd.comm)
        rnd.stats = self.comm.submit(self.round_statistics, rnd, stats=rnd.comm)
        rnd.submitted = [self.comm.submit(self._unit_job, rnd, i, stats=rnd.comm)
                         for i in range(len(units))]
        self._inflight.append(rnd)
        # This replica's next window starts at its snapshot: later steps count towards it.
        self.steps_since_sync = 0
        self._launch_clock = self.clock()
        self._window_offset = 0.0
        if not self.merge_when_done:
            self._clock_start = self._launch_clock

    def _ready_to_merge(self, rnd: SyncRound) -> bool:
        """Whether to merge ``rnd`` now (its ``apply_at`` reached). Exact schedule: always
        (the merge waits if need be). Merge when done: only if every job of the round is
        done on every rank of the replica; then the clock restarts here, so that every
        replica's next window starts when the round completed (within a step), whichever
        replica posted last, instead of drifting apart by a step per round."""
        if not self.merge_when_done:
            return True
        pending = any(f is not None and not f.done()
                      for f in (rnd.rendezvous, rnd.stats, *rnd.submitted))
        now = self.clock()
        flags = torch.tensor([float(pending), now - self._launch_clock], dtype=torch.float64,
                             device=self.device)
        if self._replica_group is not None:
            # The main thread's own replica group (the communication thread has a private
            # one): the ranks of a replica merge at the same step boundary.
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._replica_group)
        pending_any, since_launch = flags.tolist()
        if pending_any:
            return False
        self._window_offset = since_launch
        self._clock_start = now
        return True

    @torch.no_grad()
    def _rendezvous_job(self, rnd: SyncRound, mine: torch.Tensor) -> None:
        """Non-blocking A-EDiT: gather every replica's steps up to its snapshot and its
        window length (the same numbers :meth:`_rendezvous` gathers, in the round)."""
        got = self.comm.all_gather_sync(mine).cpu()  # [R, 2]
        counts = got[:, 0].contiguous()
        rnd.windows = got[:, 1].tolist()
        if float(counts.sum()) < self.config.min_total_global_steps:
            rnd.skipped = True
        else:
            rnd.step_counts = counts

    def _launch(self, fragment: int) -> None:
        """Start a delayed round: snapshot the fragment's parameters, queue all its jobs."""
        units = self.fragments[fragment]
        self._call_before_sync(units)
        for u in units:
            self.units[u].launch = self.units[u].flat_params()
        rnd = self._new_round(None, units, fragment,
                              apply_at=self.global_step + self.config.overlap_steps)
        rnd.submitted = [self.comm.submit(self._unit_job, rnd, i, stats=rnd.comm)
                         for i in range(len(units))]
        self._inflight.append(rnd)

    def finish(self, force: bool = False) -> None:
        """Run a sync that is armed but not yet started, and merge a delayed round that is
        due (call before evaluating or saving: the same arithmetic as in the next forward).
        With ``force``, also sync replicas that trained since the last sync although no
        sync is due (the end of training), so that every replica holds the global model:
        with streaming, rounds in flight are merged at once and every unit syncs once more.
        Every rank must call it at the same point."""
        self._drain_round()
        if self._merge_next is not None:
            self._round, self._merge_next = self._merge_next, None
            self._drain_round()
        was_pending = self._pending
        if was_pending:
            self._run_blocking(self._pending_counts, self.fragments[self._pending_fragment],
                               self._pending_fragment)
        if not force or not self.config.is_local_sgd or self.in_warmup:
            return
        if self.ft is not None:
            # Every replica runs one last round (A-EDiT replicas are at different steps);
            # replicas that have not trained since their last sync contribute nothing.
            # Streaming: the round in flight is merged first, then every unit syncs.
            syncs = self.num_syncs
            self.ft.merge_inflight()
            self.ft.run(elapsed=self._agreed_elapsed() if self.config.use_async else None,
                        allow_skip=False)
            self.num_syncs_forced += self.num_syncs - syncs
            return
        if self.schedule is not None:
            while self._inflight:
                self._round = self._inflight.pop(0)
                self._drain_round()
            if self.global_step > self.config.local_sgd_warmup_steps:
                self.num_syncs_forced += 1
                self._run_blocking(None, list(range(len(self.units))))
            return
        if was_pending:
            return
        while self._inflight:  # non-blocking A-EDiT: every replica launched the same rounds
            self._round = self._inflight.pop(0)
            self._drain_round()
        # A-EDiT replicas may differ in steps_since_sync: they all rendezvous to decide.
        counts = (self._rendezvous(self._agreed_elapsed(), allow_skip=False)
                  if self.config.use_async else None)
        if (counts is None and not self.steps_since_sync) or (
                counts is not None and float(counts.sum()) == 0):
            return
        self.num_syncs_forced += 1
        self._run_blocking(counts)

    def join(self, start_quorum: int | None = None, timeout_s: float = 600.0) -> bool:
        """The fault-tolerant mode: take part in the quorum before training (every replica
        at its start, and a replica that restarted). A replica behind the others heals
        there: it receives the global state from a healthy peer and holds the global model
        afterwards. The first round needs ``start_quorum`` replicas (default: all, for a
        start or a resume; a replica rejoining a running job passes 2). Returns True once
        joined; False without fault tolerance."""
        if self.ft is None:
            return False
        need = self.num_replicas if start_quorum is None else start_quorum
        return self.ft.join(need, timeout_s)

    def close(self) -> None:
        """Remove every hook and stop the communication thread."""
        self._drain_round()
        self._wait_inflight()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.comm.close()

    @property
    def pending_counts(self) -> list[float] | None:
        """A-EDiT: every replica's steps in the window of the armed sync (None otherwise)."""
        return None if self._pending_counts is None else self._pending_counts.tolist()

    @property
    def sync_pending(self) -> bool:
        """Whether the next training forward will run a layer-wise sync (or merge one)."""
        return self._pending or self._merge_next is not None

    @property
    def failed_rounds(self) -> int:
        """The fault-tolerant mode: rounds that did not commit (0 otherwise)."""
        return 0 if self.ft is None else self.ft.failed_rounds

    @property
    def heals(self) -> int:
        """The fault-tolerant mode: times this replica took the global state from a peer."""
        return 0 if self.ft is None else self.ft.heals

    def pop_sync_log(self) -> list[dict[str, Any]]:
        """Metrics of the syncs finished since the last call (one dict per sync)."""
        out, self._sync_log = self._sync_log, []
        return out

    @torch.no_grad()
    def scale_pseudo_gradients(self, factor: float) -> None:
        """Fault injection: multiply this rank's pseudo-gradients by ``factor`` (the local
        model becomes ``anchor - factor * (anchor - theta)``), e.g. from a ``before_sync``
        callback (then only the units of the sync that starts), to show what the penalty
        does with a corrupted replica."""
        units = self._starting if self._starting is not None else range(len(self.units))
        for u in units:
            unit = self.units[u]
            if unit.anchor is not None:
                unit.load_flat(unit.anchor.to(unit.device) - factor * unit.pseudo_grad())

    def extra_memory(self) -> dict[str, int]:
        """Bytes of anchors + outer state (+ error feedback) on this rank, by device type."""
        total: dict[str, int] = {}
        for unit in self.units:
            for k, v in unit.extra_bytes().items():
                total[k] = total.get(k, 0) + v
        return total

    @contextlib.contextmanager
    def global_model(self) -> Iterator[None]:
        """Inside the block the live parameters are the anchors (the global model as of the
        latest reductions; reductions in flight are waited for, not merged); afterwards
        they are exactly what they were. For evaluating a streaming run, whose replicas
        never hold the same model between syncs. Every rank must enter it."""
        self._drain_round()
        self._wait_inflight()
        _reshard(self.model)
        saved = [u.flat_params() if u.anchor is not None else None for u in self.units]
        try:
            with torch.no_grad():
                for unit in self.units:
                    if unit.anchor is not None:
                        unit.write_back()
            yield
        finally:
            _reshard(self.model)
            with torch.no_grad():
                for unit, flat in zip(self.units, saved):
                    if flat is not None:
                        unit.load_flat(flat)

    # ================================================================== hooks
    def _root_pre_hook(self, module: nn.Module, args: Any) -> None:
        if not module.training or not self.sync_pending:
            return
        # FSDP2 keeps the root unit gathered after a forward without backward (evaluation);
        # reshard so the next all-gather reads the synced shards, not a stale full copy.
        _reshard(module)
        if self._pending:
            self._pending = False
            self._start_round(self._pending_counts, self.fragments[self._pending_fragment],
                              self._pending_fragment)
        else:
            self._round, self._merge_next = self._merge_next, None
        self._advance(self._first_module_unit - 1)  # the root unit (-1: there is none)

    def _make_block_hook(self, u: int) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, args: Any) -> None:
            if self._round is not None:
                self._advance(u)
        return hook

    # ================================================================== rounds
    def _call_before_sync(self, units: list[int]) -> None:
        if self.before_sync is not None:
            self._starting = units
            try:
                self.before_sync(self._next_index)
            finally:
                self._starting = None

    def _new_round(self, step_counts: torch.Tensor | None, units: list[int],
                   fragment: int, apply_at: int | None = None) -> SyncRound:
        """A round of ``units``; delayed (merged after step ``apply_at``) when given. Its
        statistics job is queued at once."""
        rnd = SyncRound(index=self._next_index, step_counts=step_counts, units=list(units),
                     fragment=fragment, launch_step=self.global_step,
                     delayed=apply_at is not None, apply_at=apply_at or 0,
                     comm=self._rendezvous_comm,
                     windows=self._pending_windows if step_counts is not None else None)
        self._rendezvous_comm = CommStats()
        self._next_index += 1
        if self.config.penalty_enabled or step_counts is not None:
            rnd.stats = self.comm.submit(self.round_statistics, rnd, stats=rnd.comm)
        return rnd

    def _start_round(self, step_counts: torch.Tensor | None, units: list[int],
                     fragment: int = 0) -> None:
        self._call_before_sync(units)
        self._round = self._new_round(step_counts, units, fragment)

    def _advance(self, u: int) -> None:
        """Queue the round's units up to ``prefetch_depth`` past unit ``u``, then wait for
        (and, if delayed, merge) every unit of the round up to ``u``."""
        rnd = self._round
        assert rnd is not None
        upto = rnd.position(u)
        last = min(len(rnd.units), upto + self.config.prefetch_depth)
        while len(rnd.submitted) < last:
            rnd.submitted.append(
                self.comm.submit(self._unit_job, rnd, len(rnd.submitted), stats=rnd.comm))
        while rnd.waited < upto:
            t0 = time.perf_counter()
            with record_function("editrain::sync::wait"):
                rnd.submitted[rnd.waited].result()  # re-raises a failed job's exception
            waited = time.perf_counter() - t0
            rnd.wait_s += waited
            self.total_wait_s += waited
            if rnd.delayed:
                unit = self.units[rnd.units[rnd.waited]]
                if rnd.skipped:
                    unit.launch = None  # nothing was reduced: the local model stays
                else:
                    unit.merge(self.config.merge, self.config.merge_alpha)
            rnd.waited += 1
        if rnd.waited == len(rnd.units):
            self._end_round()

    def _drain_round(self) -> None:
        if self._round is not None:
            self._advance(len(self.units) - 1)

    def _wait_inflight(self) -> None:
        """Wait for the jobs of every delayed round (no merge: that stays on schedule)."""
        for rnd in self._inflight + ([self._merge_next] if self._merge_next else []):
            for fut in [rnd.rendezvous, rnd.stats, *rnd.submitted]:
                if fut is not None:
                    fut.result()

    def _run_blocking(self, step_counts: torch.Tensor | None,
                      units: list[int] | None = None, fragment: int = 0) -> None:
        self._pending = False
        _reshard(self.model)
        self._start_round(step_counts, list(range(len(self.units))) if units is None else units,
                          fragment)
        self._drain_round()

    def _end_round(self) -> None:
        rnd = self._round
        assert rnd is not None
        self._round = None
        if rnd.skipped:
            # Too few steps in total: the steps up to the snapshot count towards the next
            # sync (defect 7), whose window already started at the snapshot; so does the
            # time they took.
            self.num_skipped_syncs += 1
            self.steps_since_sync += rnd.my_steps
            if rnd.windows:
                self._window_offset += rnd.windows[self.replica]
            return
        self.num_syncs += 1
        self._last_sync_step = self.global_step
        if rnd.step_counts is not None:
            self.progress.record_sync(rnd.step_counts.tolist(), rnd.windows or [])
        if not (self.nonblocking and rnd.delayed):  # (non-blocking: reset at the launch)
            self.steps_since_sync = 0
            self._clock_start = self.clock()
        self._pending_counts = None
        self._sync_log.append(self.round_log_entry(rnd))

    def round_log_entry(self, rnd: SyncRound) -> dict[str, Any]:
        """The sync log's record of a finished round (``metrics.jsonl``'s ``sync``)."""
        stats = rnd.comm.snapshot()
        entry: dict[str, Any] = {
            "sync": rnd.index,
            "step": self.global_step,
            "units": len(rnd.units),
            "wait_s": rnd.wait_s,
            "sync_time_s": time.perf_counter() - rnd.started,
            "rendezvous_wait_s": self._rendezvous_wait_s,
            **stats,
            "work_s": rnd.work_s,
            "hidden": (max(0.0, 1.0 - rnd.wait_s / rnd.work_s) if rnd.work_s > 0 else None),
        }
        self._rendezvous_wait_s = 0.0
        if self.schedule is not None:
            entry["fragment"] = rnd.fragment
        if rnd.delayed:
            entry["launch_step"] = rnd.launch_step
        if rnd.step_counts is not None:
            entry["replica_steps"] = rnd.step_counts.tolist()
        if rnd.norms is not None:
            entry["norms"] = rnd.norms.tolist()
        if rnd.weights is not None:
            entry["weights"] = rnd.weights.tolist()
        if rnd.outlier is not None:
            entry["outlier"] = rnd.outlier.tolist()
        if rnd.z is not None:
            entry["z"] = [[None if math.isnan(v) else v for v in row] for row in rnd.z.tolist()]
        if rnd.clip:
            entry["clip"] = rnd.clip
        return entry

    # ================================================================== jobs (comm thread)
    def _grad_allreduce_job(self) -> None:
        for unit in self.units:
            grads = []
            for p in unit.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(local_view(p.grad))
            if not grads:
                continue
            flat = torch.cat([g.reshape(-1) for g in grads])
            piece = unit.own_part(flat)  # full copies: this rank's slice, then all-gathered
            self.comm.all_reduce_sync(piece)
            piece.div_(self.num_replicas)
            flat = unit.assemble(piece)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    def _pseudo_grad(self, rnd: SyncRound, u: int) -> torch.Tensor:
        unit = self.units[u]
        return unit.pseudo_grad(unit.launch if rnd.delayed else None)

    @torch.no_grad()
    def round_statistics(self, rnd: SyncRound) -> None:
        """Batched statistics of the round's units: one shard all-reduce, one sync
        all-gather."""
        t0 = time.perf_counter()
        cfg = self.config
        if rnd.skipped:
            return
        with record_function("editrain::sync::stats"):
            sq = torch.stack([
                self.units[u].square_sum(self._pseudo_grad(rnd, u)) if self.units[u].numel
                else torch.zeros((), dtype=torch.float64, device=self.device)
                for u in rnd.units
            ])
            self.comm.all_reduce_shard(sq)
            norms = self.comm.all_gather_sync(sq).sqrt().cpu()  # [R, units of the round]
            if rnd.members is not None:
                norms = _by_replica(norms, rnd, self.num_replicas)
        if self.detectors is not None:
            included, outlier, z = self.detectors.observe(norms, rnd.units)
            rnd.outlier, rnd.z = outlier, z
        else:
            included = finite_mask(norms)
        rnd.norms = norms
        rnd.weights = compute_weights(
            norms, included,
            norm_softmax=bool(cfg.pseudo_gradnorm_reduce),
            temperature=cfg.weight_softmax_temperature,
            step_counts=rnd.step_counts if cfg.use_step_weight else None,
            step_weight_ratio=cfg.step_weight_ratio,
        )
        rnd.work_s += time.perf_counter() - t0

    @torch.no_grad()
    def _unit_job(self, rnd: SyncRound, i: int) -> None:
        """Steps 1, 6-9 of the sync of the round's ``i``-th unit on this rank."""
        t0 = time.perf_counter()
        try:
            self.reduce_unit(rnd, i)
        finally:
            rnd.work_s += time.perf_counter() - t0

    def reduce_unit(self, rnd: SyncRound, i: int) -> None:
        """Sync the round's ``i``-th unit: weights, reduction (plain, GTA or quantised),
        clipping, then the outer step and write-back (or, for a round that must commit
        first, the reduced pseudo-gradient kept in ``rnd.tentative``). Comm thread."""
        u = rnd.units[i]
        unit = self.units[u]
        if unit.anchor is None:
            raise RuntimeError("sync before anchors exist (warm-up not finished)")
        with record_function("editrain::sync::unit"):
            if rnd.stats is not None:
                rnd.stats.result()
            if rnd.skipped:
                return
            if rnd.weights is not None:
                column = rnd.weights[:, i]
                weight = float(column[self.replica])
                if float(column.sum()) == 0.0:
                    # Nobody is trustworthy for this unit: keep the anchor, drop local
                    # progress (a delayed round merges it as usual).
                    if rnd.tentative is not None:
                        rnd.tentative[i] = None
                    elif not rnd.delayed:
                        unit.write_back()
                    rnd.clip.append(float("nan"))
                    return
                weights = column.tolist()
                if rnd.members is not None:  # in the order of the quorum's collectives
                    weights = [weights[m] for m in rnd.members]
            elif rnd.contributes is not None:
                share = 1.0 / sum(rnd.contributes)
                weights = [share if c else 0.0 for c in rnd.contributes]
                weight = weights[rnd.members.index(self.replica)] if rnd.members else 0.0
            else:
                weight = 1.0 / self.num_replicas
                weights = [weight] * self.num_replicas
            delta = self._pseudo_grad(rnd, u)
            if rnd.delayed and self.config.merge != "keep_local":
                unit.launch = None  # only keep_local needs the snapshot at the merge
            if weight == 0.0:
                delta.zero_()  # an excluded replica sends zeros (even if its delta is NaN)
            if unit.segments is None:
                reduced = self._reduce(rnd, u, delta, weight, weights, unit.error, self.rank)
            else:
                # Tensor parallelism: the pieces tp peers hold alike are reduced apart from
                # the rest, with the same random draws and magnitude ranks on every peer,
                # so that their copies stay identical.
                reduced = torch.empty_like(delta)
                alike = self.rank - self.topo.tp_of(self.rank)  # the same on tp peers
                tags = (alike, self.topo.world_size), (self.rank,)
                for index, tag in zip(unit.segments, tags):
                    if not index.numel():
                        continue
                    error = None if unit.error is None else unit.error[index.to(
                        unit.error.device)]
                    part = self._reduce(rnd, u, delta[index], weight, weights, error, *tag)
                    reduced[index] = part
                    if error is not None:
                        unit.error[index.to(unit.error.device)] = error
            if self.config.clip_pseudo_grad:
                sq = unit.square_sum(reduced).reshape(1)
                self.comm.all_reduce_shard(sq)
                coef = float(clip_coefficient(float(sq.sqrt()), self.config.clip_pseudo_grad))
                if coef < 1.0:
                    reduced.mul_(coef)
                rnd.clip.append(coef)
            if rnd.tentative is not None:
                rnd.tentative[i] = reduced  # applied once the round commits
                return
            unit.outer_step(reduced)
            if not rnd.delayed:
                unit.write_back()

    def _reduce(self, rnd: SyncRound, u: int, delta: torch.Tensor, weight: float,
                weights: list[float], error: torch.Tensor | None, *tag: int) -> torch.Tensor:
        """The cross-replica reduction of one pseudo-gradient vector: the reducer (plain
        or GTA; random draws seeded by the engine's seed, the round, the unit and ``tag``)
        or, with a quantised ``comm_dtype``, :meth:`_quantised_reduce`."""
        if self.config.comm_dtype != "fp32":
            return self._quantised_reduce(delta, weight, weights, error)
        gen = None
        if self.config.gta.sparsification_method in ("random", "rescaled_random"):
            gen = torch.Generator(device=delta.device)
            gen.manual_seed(_mix(self.seed, rnd.index, u, *tag))
        return self.reducer.reduce(delta, weight, self.comm.all_reduce_sync, generator=gen)

    def _quantised_reduce(self, delta: torch.Tensor, weight: float, weights: list[float],
                          error: torch.Tensor | None) -> torch.Tensor:
        """Gather every replica's quantised ``delta (+ error feedback)``, sum the decoded
        values weighted, in fp32, in replica order (``docs/streaming.md`` section 4).
        ``error`` (this replica's residual, if kept) is updated in place."""
        dtype = self.config.comm_dtype
        if weight == 0.0:
            message, _ = quant.encode(delta, dtype)  # delta was zeroed: Q(0)
        else:
            x = delta if error is None else delta + error.to(delta.device)
            message, decoded = quant.encode(x, dtype)
            if error is not None:
                error.copy_((x - decoded).to(error.device))
        gathered = self.comm.all_gather_sync(message)
        out = torch.zeros_like(delta)
        for r, w in enumerate(weights):
            out.add_(quant.decode(gathered[r], delta.numel(), dtype).mul_(w))
        return out

    # ================================================================== rounds run outside
    # the step hooks (the fault-tolerant mode, sync/ft_round.py)
    def new_round(self, units: Sequence[int] | None = None, fragment: int = 0,
                  apply_at: int | None = None) -> SyncRound:
        """A round over ``units`` (default: all), numbered next, delayed (merged after step
        ``apply_at``) when given; its jobs are the caller's to run."""
        return SyncRound(index=self._next_index, step_counts=None,
                         units=list(range(len(self.units))) if units is None else list(units),
                         fragment=fragment, launch_step=self.global_step,
                         delayed=apply_at is not None, apply_at=apply_at or 0)

    def end_round(self, rnd: SyncRound, applied: bool, record: Mapping[str, Any]) -> None:
        """Book-keeping after such a round: when its outer steps were applied (and it had
        units) it counts as a sync and the next window starts; its log entry, with
        ``record`` added, goes to the sync log."""
        if rnd.skipped:  # A-EDiT: too few steps in total; they count towards the next
            self.num_skipped_syncs += 1
            self._clock_start = self.clock()
        elif not rnd.units and not self.steps_since_sync:
            self._clock_start = self.clock()  # joined: this replica's window starts now
        elif applied and rnd.units:
            self.num_syncs += 1
            self._last_sync_step = self.global_step
            self.steps_since_sync = 0
            self._clock_start = self.clock()
            if rnd.step_counts is not None:
                self.progress.record_sync(rnd.step_counts.tolist(), rnd.windows or [])
        entry = self.round_log_entry(rnd)
        entry.update(record)
        if self.schedule is not None:
            entry["fragment"] = rnd.fragment
        self._sync_log.append(entry)
        self._next_index = rnd.index + 1

    def peer_state(self) -> dict[str, Any]:
        """What this rank sends a replica that heals (the fault-tolerant mode): its share
        of the global state (anchors, outer optimizer state) and the counters, as CPU
        copies (the sender trains on while the receiver reads). Replica-own entries (error
        feedback, launch snapshots) stay here."""
        units = [{k: (v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v)
                  for k, v in unit.state_dict().items() if not k.startswith("replica.")}
                 for unit in self.units]
        return {"units": units, "global_step": self.global_step, "num_syncs": self.num_syncs,
                "next_index": self._next_index, "seed": self.seed,
                "progress": self.progress.state_dict(),
                "detectors": self.detectors.state_dict() if self.detectors is not None
                else None}

    def adopt_peer_state(self, sd: Mapping[str, Any]) -> None:
        """Take :meth:`peer_state` of a healthy replica and restart from the global model:
        anchors into the parameters, no local progress, this replica's own error feedback
        back to zero."""
        with torch.no_grad():
            for unit, unit_sd in zip(self.units, sd["units"]):
                unit.load_state_dict(unit_sd)
                unit.write_back()
        self.global_step = int(sd["global_step"])
        self.num_syncs = int(sd["num_syncs"])
        self._next_index = int(sd["next_index"])
        self.seed = int(sd["seed"])
        self.progress.load_state_dict(sd["progress"])
        if self.detectors is not None and sd["detectors"] is not None:
            self.detectors.load_state_dict(sd["detectors"])
        self.steps_since_sync = 0
        self._last_sync_step = self.global_step
        self._clock_start = self.clock()

    # ================================================================== helpers
    def _create_anchors(self) -> None:
        self._check_replicas_agree()
        for unit in self.units:
            unit.create_anchor()
        self.progress.start(self.global_step)
        self.steps_since_sync = 0
        self._clock_start = self._launch_clock = self.clock()
        self._window_offset = 0.0
        # The sync log's counters describe syncs: warm-up gradient traffic is not sync traffic.
        self.comm.stats.reset()

    @torch.no_grad()
    def _check_replicas_agree(self) -> None:
        """The local phase must start from one model on every replica (the anchors are
        taken from each replica's own parameters): compare a checksum of every unit's
        shard (sum and sum of squares, float64) across replicas, agreed over the replica's
        ranks, and fail on every rank alike if they differ (e.g. different seeds)."""
        if self.comm.sync_size == 1:
            return  # (the fault-tolerant mode: a joining replica heals instead)
        sums = torch.zeros(len(self.units), 2, dtype=torch.float64, device=self.device)
        for i, unit in enumerate(self.units):
            if unit.numel:
                flat = unit.flat_params().double()
                sums[i, 0], sums[i, 1] = flat.sum(), flat.square().sum()
        got = self.comm.run(self.comm.all_gather_sync, sums).cpu()  # [R, units, 2]
        scale = got[0].abs().clamp_min(1e-12)
        differs = ((got - got[0]).abs() > 1e-6 * scale).any(dim=2).any(dim=0)  # [units]
        agreed = differs.to(torch.float64).to(self.device)
        self.comm.run(self.comm.all_reduce_shard, agreed, dist.ReduceOp.MAX)
        bad = [self.units[i].name for i, d in enumerate(agreed.tolist()) if d]
        if bad:
            raise RuntimeError(
                f"replicas start the local phase from different parameters (units "
                f"{', '.join(bad)}): every replica must hold the same model when local SGD "
                f"begins; initialise every replica with the same seed or load the same "
                f"checkpoint")

    def _agreed_elapsed(self) -> float:
        """Wall time since the clocks started, max over this replica's ranks."""
        elapsed = self.clock() - self._clock_start
        if self.comm.shard_size == 1:
            # A one-rank replica agrees with itself: no trip through the communication
            # thread at every step (about 30 us, more when the GIL is contended).
            return elapsed
        t = torch.tensor([elapsed], dtype=torch.float64, device=self.device)
        self.comm.run(self.comm.all_reduce_shard, t, dist.ReduceOp.MAX)
        return float(t)

    def _rendezvous(self, elapsed: float, allow_skip: bool = True) -> torch.Tensor | None:
        """A-EDiT: gather every replica's steps since the last sync and its agreed elapsed
        time; the counts, or None when skipped (too few steps in total)."""
        t0 = time.perf_counter()
        mine = torch.tensor([self.steps_since_sync, elapsed], dtype=torch.float64,
                            device=self.device)
        got = self.comm.submit(self.comm.all_gather_sync, mine,
                               stats=self._rendezvous_comm).result().cpu()  # [R, 2]
        self._rendezvous_wait_s += time.perf_counter() - t0
        counts = got[:, 0].contiguous()
        if allow_skip and float(counts.sum()) < self.config.min_total_global_steps:
            self.num_skipped_syncs += 1
            self._clock_start = self.clock()
            return None
        self._pending_windows = got[:, 1].tolist()
        return counts

    # ================================================================== state
    @property
    def has_anchors(self) -> bool:
        """Whether the anchors exist (the local phase has begun)."""
        return any(u.anchor is not None for u in self.units)

    def state_dict(self) -> dict[str, Any]:
        """Everything the engine owns, as a tree that ``torch.distributed.checkpoint`` saves.

        Anchors and outer optimizer state are laid out like the parameters (DTensors) and
        are identical on every replica, so DCP stores them once and re-shards them to any
        topology; counters, sync clock, anomaly detectors and the RNG seed are this rank's
        plain data under a per-rank key (see :mod:`editrain.sync.state`). Every rank calls
        it; an unfinished sync is completed first (the same jobs it would run anyway). Like
        ``nn.Module.state_dict()``, the per-element tensors are views of the live state:
        save them before training on. Delayed rounds in flight are waited for (not merged:
        that stays on schedule) and saved with the launch snapshots they still need.
        """
        self._drain_round()
        self._wait_inflight()
        if self.ft is not None:
            self.ft.wait_inflight()
        return self._layout.pack([u.state_dict() for u in self.units], self._plain_state())

    def state_dict_template(self, saved: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Empty tensors shaped for this topology, for ``dcp.load`` to fill with a saved state.

        Args:
            saved: what the checkpoint holds under the key the state was saved at:
                flattened key (as DCP writes it, without that key) -> a tensor of the
                saved shape and dtype (the meta device will do); see
                :func:`editrain.checkpoint.saved_tensors`.

        Raises:
            ValueError: ``saved`` holds no engine state.
        """
        return self._layout.template(saved)

    def load_state_dict(self, state: Mapping[str, Any]) -> bool:
        """Restore a state saved by :meth:`state_dict` and loaded into its template.

        On the topology that saved it, training continues exactly. On another one (a
        different number of replicas or shards: elastic) every replica restarts from the
        anchors, which are written into the live parameters; step and sync counts and the
        detectors of replicas that still exist are kept; the local phase restarts (no
        pending sync, clocks reset). Call it after restoring the model's parameters.

        Args:
            state: the tree from :meth:`state_dict_template`, filled by ``dcp.load``.

        Returns:
            Whether the topology changed (an elastic resume).
        """
        unit_states, plain, elastic = self._layout.unpack(state)
        for unit, unit_state in zip(self.units, unit_states):
            unit.load_state_dict(unit_state)
        self._load_plain(plain, elastic)
        if elastic:
            with torch.no_grad():
                for unit in self.units:
                    if unit.anchor is not None:
                        unit.write_back()
        return elastic

    def _plain_state(self) -> dict[str, Any]:
        """Counters, clock, detectors and RNG seed of this rank (JSON-able)."""
        return {
            "global_step": self.global_step,
            "steps_since_sync": self.steps_since_sync,
            "num_syncs": self.num_syncs,
            "num_skipped_syncs": self.num_skipped_syncs,
            "num_syncs_forced": self.num_syncs_forced,
            "next_index": self._next_index,
            "inflight": [_round_state(r) for r in self._inflight],
            "merge_next": None if self._merge_next is None else _round_state(self._merge_next),
            "pending": self._pending,
            "pending_fragment": self._pending_fragment,
            "pending_counts": None if self._pending_counts is None
            else self._pending_counts.tolist(),
            "elapsed_s": self.clock() - self._clock_start,
            "since_launch_s": self.clock() - self._launch_clock,
            "window_offset_s": self._window_offset,
            "pending_windows": self._pending_windows,
            **self.progress.state_dict(),
            "detectors": self.detectors.state_dict() if self.detectors is not None else None,
            "rng": {"seed": self.seed},
        }

    def _load_plain(self, sd: dict[str, Any], elastic: bool) -> None:
        self.num_syncs = int(sd["num_syncs"])
        self.num_skipped_syncs = int(sd["num_skipped_syncs"])
        self.num_syncs_forced = int(sd["num_syncs_forced"])
        self._next_index = int(sd.get("next_index", self.num_syncs))
        self._inflight, self._merge_next = [], None
        self.progress.load_state_dict(sd)
        self.seed = int(sd["rng"]["seed"])
        if elastic:
            # A-EDiT replicas were at different steps: the replica-steps done are converted
            # to this topology at equal tokens, and every replica restarts at their mean (the
            # budget and the schedule stay counted in the run's first topology). Every other
            # method keeps the (common) step count.
            old = (max(1, int(sd["topology"][0])), max(1, int(sd["topology"][1])))
            if self.config.use_async:
                self.progress.rescale(old)
                self.global_step = int(round(self.synced_replica_steps / self.num_replicas))
            else:
                self.global_step = int(sd["global_step"])
            self.steps_since_sync, self._pending, self._pending_counts = 0, False, None
            self._next_index = self.num_syncs  # rounds in flight are dropped
            for unit in self.units:
                unit.launch = None
            self._clock_start = self._launch_clock = self.clock()
            self._window_offset = 0.0
            self.progress.last_window_counts, self.progress.last_window_s = None, 0.0
        else:
            self.global_step = int(sd["global_step"])
            self.steps_since_sync = int(sd["steps_since_sync"])
            self._pending = bool(sd["pending"])
            self._pending_fragment = int(sd.get("pending_fragment", 0))
            self._inflight = [_round_from_state(r) for r in sd.get("inflight", [])]
            if sd.get("merge_next") is not None:
                self._merge_next = _round_from_state(sd["merge_next"])
            counts = sd["pending_counts"]
            self._pending_counts = (None if counts is None
                                    else torch.tensor(counts, dtype=torch.float64))
            now = self.clock()
            self._clock_start = now - float(sd["elapsed_s"])
            self._launch_clock = now - float(sd.get("since_launch_s", sd["elapsed_s"]))
            self._window_offset = float(sd.get("window_offset_s", 0.0))
            self._pending_windows = sd.get("pending_windows")
        if self.detectors is not None and sd["detectors"] is not None:
            self.detectors.load_state_dict(sd["detectors"], allow_resize=True)


EDiT = SyncEngine
"""The engine's original name (the paper's method), kept for existing code: the same class."""


def _round_state(rnd: SyncRound) -> dict[str, Any]:
    """A delayed round whose jobs are done, as plain data (its merge is still to come)."""
    return {
        "index": rnd.index, "fragment": rnd.fragment, "units": rnd.units,
        "launch_step": rnd.launch_step, "apply_at": rnd.apply_at,
        "wait_s": rnd.wait_s, "work_s": rnd.work_s, "comm": rnd.comm.snapshot(),
        "norms": None if rnd.norms is None else rnd.norms.tolist(),
        "weights": None if rnd.weights is None else rnd.weights.tolist(),
        "outlier": None if rnd.outlier is None else rnd.outlier.tolist(),
        "z": None if rnd.z is None else [[None if math.isnan(v) else v for v in row]
                                         for row in rnd.z.tolist()],
        "clip": rnd.clip,
        "step_counts": None if rnd.step_counts is None else rnd.step_counts.tolist(),
        "windows": rnd.windows, "skipped": rnd.skipped, "my_steps": rnd.my_steps,
    }


def _round_from_state(sd: dict[str, Any]) -> SyncRound:
    """Inverse of :func:`_round_state`: a delayed round with completed jobs."""
    rnd = SyncRound(index=int(sd["index"]), step_counts=None, units=list(sd["units"]),
                 fragment=int(sd["fragment"]), delayed=True,
                 launch_step=int(sd["launch_step"]), apply_at=int(sd["apply_at"]),
                 wait_s=float(sd["wait_s"]), work_s=float(sd["work_s"]), clip=list(sd["clip"]),
                 windows=sd.get("windows"), skipped=bool(sd.get("skipped", False)),
                 my_steps=int(sd.get("my_steps", 0)))
    if sd.get("step_counts") is not None:
        rnd.step_counts = torch.tensor(sd["step_counts"], dtype=torch.float64)
    for key, value in sd["comm"].items():
        setattr(rnd.comm, key, value)
    for key, dtype in (("norms", torch.float64), ("weights", torch.float64),
                       ("outlier", torch.bool)):
        if sd[key] is not None:
            setattr(rnd, key, torch.tensor(sd[key], dtype=dtype))
    if sd["z"] is not None:
        rnd.z = torch.tensor([[math.nan if v is None else v for v in row] for row in sd["z"]],
                             dtype=torch.float64)
    for _ in rnd.units:
        done: Future = Future()
        done.set_result(None)
        rnd.submitted.append(done)
    return rnd


def _by_replica(norms: torch.Tensor, rnd: SyncRound, replicas: int) -> torch.Tensor:
    """The quorum's ``[members, L]`` norms laid out by replica id (``[replicas, L]``), NaN
    for replicas absent or not contributing: the penalty excludes them."""
    out = torch.full((replicas, norms.shape[1]), float("nan"), dtype=norms.dtype)
    assert rnd.members is not None and rnd.contributes is not None
    for row, (member, contributes) in enumerate(zip(rnd.members, rnd.contributes)):
        if contributes:
            out[member] = norms[row]
    return out


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
    if cfg.use_async and cfg.overlap_steps > 0:
        problems.append("non-blocking A-EDiT (sync.overlap_steps > 0) is not supported yet")
    elif cfg.streaming and cfg.is_local_sgd and cfg.local_sgd_sync_interval:
        gap = cfg.local_sgd_sync_interval // cfg.fragments
        if cfg.overlap_steps > gap:
            problems.append(f"sync.overlap_steps must be <= local_sgd_sync_interval // "
                            f"fragments = {gap} (one round in flight at a time), got "
                            f"{cfg.overlap_steps}")
    if problems:
        raise ValueError("dist.fault_tolerance=torchft: " + "; ".join(problems))


def _reshard(module: nn.Module) -> None:
    """Free FSDP2's gathered parameters of ``module`` (a no-op for plain modules)."""
    if isinstance(module, FSDPModule):
        module.reshard()


def _gta_kwargs(cfg: SyncConfig) -> dict[str, Any]:
    g = cfg.gta
    if g.reducer != "gta":
        return {}
    return {
        "consensus_method": g.consensus_method,
        "sparsification_method": g.sparsification_method,
        "normalize": g.normalize,
        "density": g.density,
        "int8_mask": g.int8_mask,
    }


def _mix(*values: int) -> int:
    """A deterministic 63-bit seed from a few integers (splitmix-style)."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h ^= (v + 0x9E3779B97F4A7C15 + (h << 6) + (h >> 2)) & 0xFFFFFFFFFFFFFFFF
    return h & 0x7FFFFFFFFFFFFFFF


__all__ = ["EDiT", "SHARD_DIM", "SyncEngine", "find_root_params", "unit_modules"]
