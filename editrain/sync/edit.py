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

The engine owns all of its state: ``state_dict()`` / ``load_state_dict()`` give and take it
as a DCP-ready tree whose layout lives in :mod:`editrain.sync.state`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.profiler import record_function
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from editrain.sync.comm import CommPath, LinkDelay
from editrain.sync.config import SyncConfig
from editrain.sync.outer import SyncUnit, local_view, resolve_optimizer_class
from editrain.sync.penalty import DetectorBank, clip_coefficient, compute_weights, finite_mask
from editrain.sync.reducers import build_reducer
from editrain.sync.state import StateLayout
from editrain.sync.triggers import IntervalTrigger, SyncTrigger, TimeTrigger
from editrain.topology import SHARD_DIM, SYNC_DIM, topology_of

BeforeSyncHook = Callable[[int], None]
"""Called on every rank, in the main thread, just before sync number ``n`` starts."""


@dataclass
class _Round:
    """Book-keeping of one sync in flight."""

    index: int
    step_counts: torch.Tensor | None
    submitted: list[Future] = field(default_factory=list)
    stats: Future | None = None
    waited: int = 0
    wait_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)
    # Filled by the statistics job (identical on every rank).
    norms: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    outlier: torch.Tensor | None = None
    z: torch.Tensor | None = None
    clip: list[float] = field(default_factory=list)


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
        model: the root module (it must be a unit of its own under FSDP2).
        mesh: the ``("sync", "shard")`` DeviceMesh (see :func:`editrain.init_mesh`).
        config: the method and its options (``None`` fields take the method's defaults).
        blocks: the model's blocks in forward order (one sync unit each).
        link_delay: optional simulated cost of a cross-replica message (see ``editrain.sim``).
        trigger: override of the sync trigger (tests use a fixed step schedule).
        before_sync: optional hook called just before each sync (fault injection).
        seed: seeds the random sparsification of the GTA reducer (saved with the state:
            the engine's only randomness is derived from it, the sync index, the unit and the
            rank).
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
    ) -> None:
        self.config = cfg = config.resolve()
        self.model = model
        self.mesh = mesh
        self.topo = topology_of(mesh)
        self.rank = dist.get_rank()
        self.replica = self.topo.replica_of(self.rank)
        self.num_replicas = self.topo.num_replicas
        self.seed = seed
        self.before_sync = before_sync
        blocks = list(blocks)
        if not blocks:
            raise ValueError("the sync engine needs at least one block (sync unit) in `blocks`")

        # Units in forward order: the root first (its all-gather happens first).
        outer_cls = resolve_optimizer_class(cfg.outer_optim_class)
        unit_params = [find_root_params(model, blocks)] + [list(b.parameters()) for b in blocks]
        names = ["root"] + [f"block{i}" for i in range(len(blocks))]
        self.units = [
            SyncUnit(i, n, ps, outer_cls, cfg.outer_optim_kwargs or {}, cfg.cpu_offload)
            for i, (n, ps) in enumerate(zip(names, unit_params))
        ]
        self.device = self.units[0].device
        self._layout = StateLayout(self.units, model, self.rank,
                                   (self.topo.num_replicas, self.topo.shard_size))

        # Process groups: the mesh's sync group, and a private copy of this rank's shard group
        # for the engine's statistics (FSDP2 owns the mesh's shard group in the main thread).
        sync_group = mesh.get_group(SYNC_DIM) if self.topo.num_replicas > 1 else None
        shard_group = None
        if self.topo.shard_size > 1:
            shard_group, _ = dist.new_subgroups_by_enumeration(
                [self.topo.replica_ranks(r) for r in range(self.topo.num_replicas)]
            )
        self.comm = CommPath(sync_group, shard_group, self.device, link_delay)

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
        # A-EDiT book-keeping: replica-steps known at the last sync (all replicas), and the
        # last window's per-replica steps and length, from which progress can be estimated.
        self.synced_replica_steps = 0.0
        self.last_window_counts: list[float] | None = None
        self.last_window_s = 0.0
        self.extra_due: Callable[[float], bool] | None = None
        """Optional extra trigger, asked with the agreed elapsed time (A-EDiT's end of budget).
        It must answer identically on every rank of a replica."""
        self._pending_counts: torch.Tensor | None = None
        self._pending = False
        self._clock_start = time.perf_counter()
        self._round: _Round | None = None
        self._sync_log: list[dict[str, Any]] = []
        self._rendezvous_wait_s = 0.0

        self._handles = [model.register_forward_pre_hook(self._root_pre_hook, prepend=True)]
        for u, block in enumerate(blocks, start=1):
            self._handles.append(
                block.register_forward_pre_hook(self._make_block_hook(u), prepend=True)
            )
        _reshard(model)  # anchors must be taken from the shards, not a gathered copy
        if cfg.is_local_sgd and cfg.local_sgd_warmup_steps == 0:
            self._create_anchors()

    # ================================================================== public loop API
    def __enter__(self) -> SyncEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        needs_clock = getattr(self.trigger, "needs_clock", False) or self.extra_due is not None
        elapsed = self._agreed_elapsed() if needs_clock else 0.0
        due = self.trigger.due(self.replica, self.steps_since_sync, elapsed)
        if not due and self.extra_due is not None:
            due = self.extra_due(elapsed)
        if not due:
            return
        counts = self._rendezvous() if cfg.use_async else None
        if cfg.use_async and counts is None:
            return  # skipped: too few steps in total; clocks restarted
        if cfg.layerwise:
            self._pending, self._pending_counts = True, counts
        else:
            self._run_blocking(counts)

    def finish(self, force: bool = False) -> None:
        """Run a sync that is armed but not yet started (call before evaluating the global
        model). With ``force``, also sync replicas that trained since the last sync although
        no sync is due (the end of training), so that every replica holds the global model.
        Every rank must call it at the same point."""
        self._drain_round()
        if self._pending:
            self._run_blocking(self._pending_counts)
        elif force and self.config.is_local_sgd and not self.in_warmup:
            # A-EDiT replicas may differ in steps_since_sync: they all rendezvous to decide.
            counts = self._rendezvous(allow_skip=False) if self.config.use_async else None
            if (counts is None and not self.steps_since_sync) or (
                    counts is not None and float(counts.sum()) == 0):
                return
            self.num_syncs_forced += 1
            self._run_blocking(counts)

    def close(self) -> None:
        """Remove every hook and stop the communication thread."""
        self._drain_round()
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
        """Whether the next training forward will run a layer-wise sync."""
        return self._pending

    def pop_sync_log(self) -> list[dict[str, Any]]:
        """Metrics of the syncs finished since the last call (one dict per sync)."""
        out, self._sync_log = self._sync_log, []
        return out

    @torch.no_grad()
    def scale_pseudo_gradients(self, factor: float) -> None:
        """Fault injection: multiply this rank's pseudo-gradients by ``factor`` (the local
        model becomes ``anchor - factor * (anchor - theta)``), e.g. from a ``before_sync``
        callback, to show what the penalty does with a corrupted replica."""
        for unit in self.units:
            if unit.anchor is not None:
                unit.load_flat(unit.anchor.to(unit.device) - factor * unit.pseudo_grad())

    def extra_memory(self) -> dict[str, int]:
        """Bytes of anchors + outer state on this rank, by device type."""
        total: dict[str, int] = {}
        for unit in self.units:
            for k, v in unit.extra_bytes().items():
                total[k] = total.get(k, 0) + v
        return total

    # ================================================================== hooks
    def _root_pre_hook(self, module: nn.Module, args: Any) -> None:
        if not self._pending or not module.training:
            return
        self._pending = False
        # FSDP2 keeps the root unit gathered after a forward without backward (evaluation);
        # reshard so the next all-gather reads the synced shards, not a stale full copy.
        _reshard(module)
        self._start_round(self._pending_counts)
        self._advance(0)

    def _make_block_hook(self, u: int) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, args: Any) -> None:
            if self._round is not None:
                self._advance(u)
        return hook

    # ================================================================== rounds
    def _start_round(self, step_counts: torch.Tensor | None) -> None:
        if self.before_sync is not None:
            self.before_sync(self.num_syncs)
        rnd = _Round(index=self.num_syncs, step_counts=step_counts)
        self._round = rnd
        if self.config.penalty_enabled or step_counts is not None:
            rnd.stats = self.comm.submit(self._stats_job, rnd)

    def _advance(self, u: int) -> None:
        """Queue units up to ``u + prefetch_depth``, then wait for unit ``u``."""
        rnd = self._round
        assert rnd is not None
        last = min(len(self.units) - 1, u + self.config.prefetch_depth)
        while len(rnd.submitted) <= last:
            rnd.submitted.append(self.comm.submit(self._unit_job, rnd, len(rnd.submitted)))
        t0 = time.perf_counter()
        with record_function("editrain::sync::wait"):
            while rnd.waited <= u:
                rnd.submitted[rnd.waited].result()  # re-raises a failed job's exception
                rnd.waited += 1
        waited = time.perf_counter() - t0
        rnd.wait_s += waited
        self.total_wait_s += waited
        if rnd.waited == len(self.units):
            self._end_round()

    def _drain_round(self) -> None:
        if self._round is not None:
            self._advance(len(self.units) - 1)

    def _run_blocking(self, step_counts: torch.Tensor | None) -> None:
        self._pending = False
        _reshard(self.model)
        self._start_round(step_counts)
        self._advance(len(self.units) - 1)

    def _end_round(self) -> None:
        rnd = self._round
        assert rnd is not None
        self._round = None
        self.num_syncs += 1
        if rnd.step_counts is not None:
            self.synced_replica_steps += float(rnd.step_counts.sum())
            self.last_window_counts = rnd.step_counts.tolist()
            self.last_window_s = time.perf_counter() - self._clock_start
        self.steps_since_sync = 0
        self._pending_counts = None
        self._clock_start = time.perf_counter()
        stats = self.comm.stats.snapshot()
        self.comm.stats.reset()
        entry: dict[str, Any] = {
            "sync": rnd.index,
            "step": self.global_step,
            "units": len(self.units),
            "wait_s": rnd.wait_s,
            "sync_time_s": time.perf_counter() - rnd.started,
            "rendezvous_wait_s": self._rendezvous_wait_s,
            **stats,
        }
        self._rendezvous_wait_s = 0.0
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
        self._sync_log.append(entry)

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
            self.comm.all_reduce_sync(flat)
            flat.div_(self.num_replicas)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    @torch.no_grad()
    def _stats_job(self, rnd: _Round) -> None:
        """Batched statistics: one shard all-reduce, one sync all-gather, for all units."""
        cfg = self.config
        with record_function("editrain::sync::stats"):
            sq = torch.stack([
                u.pseudo_grad().double().square().sum() if u.numel else
                torch.zeros((), dtype=torch.float64, device=self.device)
                for u in self.units
            ])
            self.comm.all_reduce_shard(sq)
            norms = self.comm.all_gather_sync(sq).sqrt().cpu()  # [R, L]
        if self.detectors is not None:
            included, outlier, z = self.detectors.observe(norms)
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

    @torch.no_grad()
    def _unit_job(self, rnd: _Round, u: int) -> None:
        """Steps 1, 6-9 of the sync of one unit on this rank."""
        unit = self.units[u]
        if unit.anchor is None:
            raise RuntimeError("sync before anchors exist (warm-up not finished)")
        with record_function("editrain::sync::unit"):
            if rnd.stats is not None:
                rnd.stats.result()
            if rnd.weights is not None:
                column = rnd.weights[:, u]
                weight = float(column[self.replica])
                if float(column.sum()) == 0.0:
                    # Nobody is trustworthy for this unit: keep the anchor, drop local progress.
                    unit.write_back()
                    rnd.clip.append(float("nan"))
                    return
            else:
                weight = 1.0 / self.num_replicas
            delta = unit.pseudo_grad()
            if weight == 0.0:
                delta.zero_()  # an excluded replica sends zeros (even if its delta is NaN)
            gen = None
            if self.config.gta.sparsification_method in ("random", "rescaled_random"):
                gen = torch.Generator(device=delta.device)
                gen.manual_seed(_mix(self.seed, rnd.index, u, self.rank))
            reduced = self.reducer.reduce(delta, weight, self.comm.all_reduce_sync, generator=gen)
            if self.config.clip_pseudo_grad:
                sq = reduced.double().square().sum().reshape(1)
                self.comm.all_reduce_shard(sq)
                coef = float(clip_coefficient(float(sq.sqrt()), self.config.clip_pseudo_grad))
                if coef < 1.0:
                    reduced.mul_(coef)
                rnd.clip.append(coef)
            unit.outer_step(reduced)
            unit.write_back()

    # ================================================================== helpers
    def _create_anchors(self) -> None:
        for unit in self.units:
            unit.create_anchor()
        self.synced_replica_steps = float(self.global_step * self.num_replicas)
        self.steps_since_sync = 0
        self._clock_start = time.perf_counter()
        # The sync log's counters describe syncs: warm-up gradient traffic is not sync traffic.
        self.comm.stats.reset()

    def _agreed_elapsed(self) -> float:
        """Wall time since the clocks started, max over this replica's ranks."""
        t = torch.tensor([time.perf_counter() - self._clock_start], dtype=torch.float64,
                         device=self.device)
        self.comm.run(self.comm.all_reduce_shard, t, dist.ReduceOp.MAX)
        return float(t)

    def _rendezvous(self, allow_skip: bool = True) -> torch.Tensor | None:
        """A-EDiT: gather every replica's steps since the last sync; None when skipped."""
        t0 = time.perf_counter()
        mine = torch.tensor([self.steps_since_sync], dtype=torch.float64, device=self.device)
        counts = self.comm.run(self.comm.all_gather_sync, mine).reshape(-1).cpu()
        self._rendezvous_wait_s += time.perf_counter() - t0
        if allow_skip and float(counts.sum()) < self.config.min_total_global_steps:
            self.num_skipped_syncs += 1
            self._clock_start = time.perf_counter()
            return None
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
        save them before training on.
        """
        self._drain_round()
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
            "pending": self._pending,
            "pending_counts": None if self._pending_counts is None
            else self._pending_counts.tolist(),
            "elapsed_s": time.perf_counter() - self._clock_start,
            "synced_replica_steps": self.synced_replica_steps,
            "last_window_counts": self.last_window_counts,
            "last_window_s": self.last_window_s,
            "detectors": self.detectors.state_dict() if self.detectors is not None else None,
            "rng": {"seed": self.seed},
        }

    def _load_plain(self, sd: dict[str, Any], elastic: bool) -> None:
        self.num_syncs = int(sd["num_syncs"])
        self.num_skipped_syncs = int(sd["num_skipped_syncs"])
        self.num_syncs_forced = int(sd["num_syncs_forced"])
        self.synced_replica_steps = float(sd["synced_replica_steps"])
        self.seed = int(sd["rng"]["seed"])
        if elastic:
            # A-EDiT replicas were at different steps: all restart at the mean step of the
            # last sync. Every other method keeps the (common) step count.
            old_replicas = max(1, int(sd["topology"][0]))
            self.global_step = (int(round(self.synced_replica_steps / old_replicas))
                                if self.config.use_async else int(sd["global_step"]))
            self.steps_since_sync, self._pending, self._pending_counts = 0, False, None
            self._clock_start = time.perf_counter()
            self.last_window_counts, self.last_window_s = None, 0.0
        else:
            self.global_step = int(sd["global_step"])
            self.steps_since_sync = int(sd["steps_since_sync"])
            self._pending = bool(sd["pending"])
            counts = sd["pending_counts"]
            self._pending_counts = (None if counts is None
                                    else torch.tensor(counts, dtype=torch.float64))
            self._clock_start = time.perf_counter() - float(sd["elapsed_s"])
            self.last_window_counts = sd["last_window_counts"]
            self.last_window_s = float(sd["last_window_s"])
        if self.detectors is not None and sd["detectors"] is not None:
            self.detectors.load_state_dict(sd["detectors"], allow_resize=True)


EDiT = SyncEngine
"""The engine's original name (the paper's method), kept for existing code: the same class."""


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


__all__ = ["EDiT", "SHARD_DIM", "SyncEngine", "find_root_params"]
