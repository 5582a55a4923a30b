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

The engine is a coordinator: the units and groups come from :mod:`editrain.sync.setup`, a
schedule object decides when rounds start and merge (:mod:`editrain.sync.schedules`; the
fault-tolerant mode's in :mod:`editrain.sync.ft_round`), every round is a
:class:`~editrain.sync.round.SyncRound` whose jobs run the one reduction of
:mod:`editrain.sync.reduction`, and A-EDiT's clock and rendezvous are
:mod:`editrain.sync.clock`. The engine keeps the round slots (armed, running, in flight,
due for merge), the forward hooks that drive them, and the counters.

The engine owns all of its state: ``state_dict()`` / ``load_state_dict()`` give and take it
as a DCP-ready tree whose layout lives in :mod:`editrain.sync.state`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.profiler import record_function
from torch.distributed.device_mesh import DeviceMesh

from editrain.sync.clock import SyncClock
from editrain.sync.comm import CommPath, LinkDelay
from editrain.sync.config import SyncConfig
from editrain.sync.ft_round import FaultTolerantSchedule
from editrain.sync.progress import Progress
from editrain.sync.reduction import Reduction
from editrain.sync.round import SyncRound
from editrain.sync.schedules import (
    BlockingSchedule,
    NonBlockingSchedule,
    Schedule,
    StreamingSchedule,
)
from editrain.sync.setup import (
    build_units,
    check_fault_tolerant,
    check_replica_wrapper,
    comm_group_backend,
    private_groups,
    release_groups,
    reshard,
)
from editrain.sync.state import StateLayout
from editrain.sync.triggers import IntervalTrigger, SyncTrigger, TimeTrigger
from editrain.topology import topology_of
from editrain.units import unwrap_ddp

BeforeSyncHook = Callable[[int], None]
"""Called on every rank, in the main thread, just before sync number ``n`` starts."""


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
        self.before_sync = before_sync
        blocks = list(blocks)
        if not blocks:
            raise ValueError("the sync engine needs at least one block (sync unit) in `blocks`")

        # Units in forward order: the root first (its all-gather happens first), then every
        # block and every other separately sharded module (embeddings, output head).
        self.stage = self.topo.stage_of(self.rank)
        """This rank's pipeline stage (0 without pipeline parallelism): ``model`` is then
        that stage's module and the engine syncs its units only."""
        check_replica_wrapper(model, self.topo.stage_ranks(self.replica, self.stage))
        model = unwrap_ddp(model)  # hooks, units and state names: the wrapped module's
        built = build_units(model, blocks, cfg, self.topo, self.rank,
                            lambda t: self.comm.call(self.comm.all_gather_shard, t))
        self.units = built.units
        self.device = next((u.device for u in self.units if u.params), self.units[0].device)
        self.fragments = [list(range(f, len(self.units), cfg.fragments))
                          for f in range(cfg.fragments)]
        """Fragment ``f``'s units: every ``P``-th unit from ``f`` (strided over depth)."""
        self._layout = StateLayout(self.units, model, self.rank, self.topo.shape)

        # The communication thread's private groups; the engine's "shard group" is the
        # ranks that hold this rank's units: the whole replica (S x T ranks with tensor
        # parallelism), or with pipeline stages this rank's stage of it. Every statistic
        # is summed over it; what every rank of a replica decides alike (A-EDiT's clock,
        # the start's check) is agreed over the whole replica, every stage.
        backend = comm_group_backend(comm_backend)
        self.groups = private_groups(self.topo, mesh, backend)
        self._closed = False
        self.comm = CommPath(self.groups.sync, self.groups.replica, self.device, link_delay,
                             stage_on_host=backend == "gloo" and self.device.type != "cpu",
                             cross=cross_replica, agree_group=self.groups.agree)
        self.reduction = Reduction(self.units, self.comm, cfg, self.topo, self.rank,
                                   self.replica, self.num_replicas, seed)
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
        self.last_sync_step = -1
        """Global step of the last sync (a non-blocking sync point)."""
        self.progress = Progress(self.num_replicas, self.topo.shard_size)
        """A-EDiT's progress and budget (:mod:`editrain.sync.progress`)."""
        self.clock = SyncClock(self.comm, self.device, cfg.min_total_global_steps, clock)
        """A-EDiT's clock and rendezvous (:mod:`editrain.sync.clock`)."""

        # The round slots.
        self._pending = False
        """A round is armed: it runs layer-wise in the next training forward."""
        self._pending_counts: torch.Tensor | None = None
        self._pending_fragment = 0
        self._round: SyncRound | None = None
        """The round whose units the current forward waits for (or that runs blocking)."""
        self.inflight: list[SyncRound] = []
        """Delayed rounds launched and not yet merged, in launch order."""
        self._merge_next: SyncRound | None = None
        """A delayed round due: merged unit by unit in the next training forward."""
        self._next_index = 0
        self._loss_sum: torch.Tensor | None = None
        """:meth:`record_loss`: this rank's training losses since the last round opened
        (float64, on the device; None: never called, no loss travels with the rounds)."""
        self._loss_steps = 0
        self._starting: list[int] | None = None
        self._sync_log: list[dict[str, Any]] = []
        self._log_fragments = cfg.streaming and not cfg.use_async
        """Whether log entries name the round's fragment (streaming)."""

        self.ft: FaultTolerantSchedule | None = None
        """The fault-tolerant schedule (None in the plain mode)."""
        self.schedule: Schedule
        """When rounds start and merge (:mod:`editrain.sync.schedules`)."""
        if cross_replica is not None:
            self.schedule = self.ft = FaultTolerantSchedule(self, cross_replica)
        elif cfg.streaming and not cfg.use_async:
            self.schedule = StreamingSchedule(self)
        elif cfg.use_async and cfg.overlap_steps > 0:
            self.schedule = NonBlockingSchedule(self)
        else:
            self.schedule = BlockingSchedule(self)

        self._first_module_unit = built.first_module_unit
        self._handles = [model.register_forward_pre_hook(self._root_pre_hook, prepend=True)]
        for u, (_, module) in enumerate(built.modules, start=self._first_module_unit):
            self._handles.append(
                module.register_forward_pre_hook(self._make_block_hook(u), prepend=True)
            )
        reshard(model)  # anchors must be taken from the shards, not a gathered copy
        if cfg.is_local_sgd and cfg.local_sgd_warmup_steps == 0:
            self._create_anchors()

    # ================================================================== public loop API
    def __enter__(self) -> SyncEngine:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # After an exception the other ranks may never come to the barrier: stop the
        # thread and the hooks only, and leave the groups to the process's end.
        self.close(release=exc_type is None)

    @property
    def seed(self) -> int:
        """Seeds GTA's random sparsification (saved with the state)."""
        return self.reduction.seed

    @property
    def detectors(self) -> Any:
        """The anomaly detectors (:class:`editrain.sync.penalty.DetectorBank`), or None."""
        return self.reduction.detectors

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
        if not self.config.is_local_sgd or self.in_warmup:
            return float(self.global_step)
        return self.schedule.sync_point()

    @property
    def in_warmup(self) -> bool:
        """Whether training is (still) synchronous: gradients are averaged across replicas."""
        return not self.config.is_local_sgd or self.global_step < self.config.local_sgd_warmup_steps

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
            self.comm.run(self.reduction.grad_allreduce, cause="gradients")
        self.total_grad_sync_s += time.perf_counter() - t0

    def record_loss(self, loss: torch.Tensor | float) -> None:
        """Optional: this rank's training loss of the step, so that every round also
        tells each replica's mean training loss since its previous round (the sync log's
        ``replica_loss``, ``train/loss/replica{r}`` in the trackers) at the cost of one
        float64 per rank in the round's statistics gather (one small extra gather for a
        method without statistics). No host synchronisation: the loss is summed on its
        device. Call it on every rank or on none (the rounds' collectives must match);
        ``editrain train`` calls it at every step."""
        value = (loss.detach().to(torch.float64).reshape(()) if isinstance(loss, torch.Tensor)
                 else torch.tensor(float(loss), dtype=torch.float64))
        self.track_losses()
        self._loss_sum = self._loss_sum + value.to(self.device)
        self._loss_steps += 1

    def track_losses(self) -> None:
        """Make every round carry each replica's loss from now on, before the first
        :meth:`record_loss` (which calls it): NaN for a replica that recorded no step since
        its previous round. Call it on every rank where a rank may open a round before its
        first recorded step, as a replica group (re)joining a ``--ft`` run does: the rounds'
        collectives must match on every member."""
        if self._loss_sum is None:
            self._loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
            self._loss_steps = 0

    def _take_loss(self) -> torch.Tensor | None:
        """The mean of the losses recorded since the last round opened (NaN if none was),
        and a fresh count; None when :meth:`record_loss` was never called."""
        if self._loss_sum is None:
            return None
        mean = (self._loss_sum / self._loss_steps if self._loss_steps
                else torch.full((), float("nan"), dtype=torch.float64, device=self.device))
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self._loss_steps = 0
        return mean

    def step(self) -> None:
        """Call once after each inner ``optimizer.step()``: counts steps; the schedule
        starts, arms or merges rounds as due."""
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
        self.schedule.step()

    def attach(self, optimizer: torch.optim.Optimizer, average_gradients: bool = True
               ) -> list[Any]:
        """Drive the engine from ``optimizer.step()`` so the loop need not call it: a step
        pre-hook runs :meth:`after_backward` (with ``average_gradients``) and a step
        post-hook runs :meth:`step`. Clip gradients yourself? During warm-up they are then
        clipped before the cross-replica average: call :meth:`after_backward` before
        clipping and attach with ``average_gradients=False``. Returns the hooks' handles
        (``handle.remove()`` detaches)."""
        handles = []
        if average_gradients:
            handles.append(optimizer.register_step_pre_hook(
                lambda opt, args, kwargs: self.after_backward()))
        handles.append(optimizer.register_step_post_hook(lambda opt, args, kwargs: self.step()))
        return handles

    def finish(self, force: bool = False) -> None:
        """Run a sync that is armed but not yet started, and merge a delayed round that is
        due (call before evaluating or saving: the same arithmetic as in the next forward).
        With ``force``, also sync replicas that trained since the last sync although no
        sync is due (the end of training), so that every replica holds the global model:
        with streaming, rounds in flight are merged at once and every unit syncs once more.
        Every rank must call it at the same point."""
        self._drain_round()
        ran_armed = self.settle()
        if not force or not self.config.is_local_sgd or self.in_warmup:
            return
        self.schedule.finish(force, ran_armed)

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

    def close(self, release: bool = True) -> None:
        """End the engine: finish the round in flight, remove every hook, stop the
        communication thread and, with ``release``, destroy the process groups the engine
        created, after a barrier on the default group (every rank must call it then; the
        context manager does, unless the block raised). Destroy the default group after
        this (:func:`editrain.shutdown`): groups left to the interpreter's exit make gloo
        abort the process now and then. Calling it again does nothing more."""
        if not self._closed:
            self._closed = True
            self._drain_round()
            self._wait_inflight()
            for h in self._handles:
                h.remove()
            self._handles.clear()
            self.comm.close()
        if release:
            release_groups(self.groups)

    @property
    def replica_group(self) -> dist.ProcessGroup | None:
        """The main thread's group over this replica's ranks (stages x shard x tp), for the
        caller's own collectives over one model copy (e.g. gradient norms of the whole
        model, every pipeline stage); None for a one-rank replica."""
        return self.groups.replica_main

    @property
    def armed(self) -> bool:
        """Whether a round is armed: it runs layer-wise in the next training forward."""
        return self._pending

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
        """Inside the block the live parameters are the global model; afterwards they are
        exactly what they were. For evaluating a streaming run, whose replicas never hold
        the same model between syncs. Every rank must enter it.

        The global model is the anchors as of the latest reductions (reductions in flight
        are waited for, not merged). With the eager merge it is every unit's global anchor
        ``G`` with its round in flight merged as sent (``docs/streaming.md`` section 3c):
        computed by every replica alike from the rounds' own messages, so entering the
        block sends nothing across replicas."""
        self._drain_round()
        self._wait_inflight()
        reshard(self.model)
        saved = [u.flat_params() if u.anchor is not None else None for u in self.units]
        try:
            with torch.no_grad():
                for unit in self.units:
                    if unit.anchor is None:
                        continue
                    if unit.eager_replicas:
                        unit.load_flat(unit.global_view())
                    else:
                        unit.write_back()
            yield
        finally:
            reshard(self.model)
            with torch.no_grad():
                for unit, flat in zip(self.units, saved):
                    if flat is not None:
                        unit.load_flat(flat)

    # ================================================================== what schedules ask
    def arm(self, step_counts: torch.Tensor | None, fragment: int = 0) -> None:
        """Arm a round of ``fragment``'s units (all units without fragments): it runs
        layer-wise in the next training forward."""
        self._pending, self._pending_counts = True, step_counts
        self._pending_fragment = fragment

    def run_now(self, step_counts: torch.Tensor | None, units: list[int] | None = None,
                fragment: int = 0) -> None:
        """Run a round of ``units`` (default: all) now, at the step boundary, and wait."""
        self._pending = False
        reshard(self.model)
        self._start_round(step_counts, list(range(len(self.units))) if units is None else units,
                          fragment)
        self._drain_round()

    def launch(self, units: list[int], fragment: int, apply_at: int,
               rendezvous: list[float] | None = None) -> SyncRound:
        """Start a delayed round: snapshot the units' parameters and queue all its jobs
        (first, with ``rendezvous``, A-EDiT's gather of this row); it is merged after step
        ``apply_at`` (:meth:`merge_now` or :meth:`merge_in_next_forward`)."""
        self._call_before_sync(units)
        for u in units:
            if self.config.merge == "eager":
                self.units[u].eager_launch()  # D kept, own share applied, theta <- A
            else:
                self.units[u].launch = self.units[u].flat_params()
        # (with a rendezvous, the statistics job is queued after it: it needs the counts)
        rnd = self.open_round(None, units, fragment, apply_at=apply_at,
                              statistics=None if rendezvous is None else False)
        if rendezvous is not None:
            rnd.my_steps = self.steps_since_sync
            rnd.rendezvous = self.comm.submit(self.clock.round_rendezvous, rnd, rendezvous,
                                              stats=rnd.comm, cause="control")
            rnd.stats = self.comm.submit(self.reduction.statistics, rnd, stats=rnd.comm,
                                         cause="statistics")
        rnd.submitted = [self.comm.submit(self.reduction.unit_job, rnd, i, stats=rnd.comm,
                                          cause="rounds") for i in range(len(units))]
        self.inflight.append(rnd)
        return rnd

    def merge_now(self, rnd: SyncRound) -> None:
        """Wait for a delayed round's jobs and merge it into the live parameters now."""
        self._round = rnd
        self._drain_round()

    def merge_in_next_forward(self, rnd: SyncRound) -> None:
        """Merge a delayed round unit by unit in the next training forward."""
        self._merge_next = rnd

    def settle(self) -> bool:
        """Merge the delayed round that is due and run the armed round now (what the next
        training forward would have done). Returns whether an armed round ran."""
        if self._merge_next is not None:
            rnd, self._merge_next = self._merge_next, None
            self.merge_now(rnd)
        if not self._pending:
            return False
        self.run_now(self._pending_counts, self.fragments[self._pending_fragment],
                     self._pending_fragment)
        return True

    def open_round(self, step_counts: torch.Tensor | None, units: Sequence[int],
                   fragment: int = 0, apply_at: int | None = None,
                   statistics: bool | None = None, numbered: bool = True) -> SyncRound:
        """A new round of ``units``; delayed (merged after step ``apply_at``) when given.
        Its statistics job is queued at once when ``statistics`` says so (default: when
        the penalty or A-EDiT's step weights need them). ``numbered``: the round takes the
        next index now (the fault-tolerant path numbers it when it closes)."""
        rnd = SyncRound(index=self._next_index, step_counts=step_counts, units=list(units),
                        fragment=fragment, launch_step=self.global_step,
                        delayed=apply_at is not None, apply_at=apply_at or 0,
                        comm=self.clock.take_traffic(),
                        windows=self.clock.pending_windows if step_counts is not None
                        else None)
        if numbered:
            self._next_index += 1
        rnd.loss = self._take_loss()
        auto = statistics is None
        if statistics is None:
            statistics = self.config.penalty_enabled or step_counts is not None
        if statistics:
            rnd.stats = self.comm.submit(self.reduction.statistics, rnd, stats=rnd.comm,
                                         cause="statistics")
        elif auto and rnd.loss is not None:
            rnd.stats = self.comm.submit(self.reduction.replica_losses, rnd, stats=rnd.comm,
                                         cause="statistics")
        return rnd

    def close_round(self, rnd: SyncRound, applied: bool = True,
                    record: Mapping[str, Any] | None = None) -> None:
        """The one book-keeping of a finished round. Applied (and with units): it counts as a
        sync, the next window starts (a non-blocking round's started at its launch) and
        its log entry goes to the sync log. Skipped (A-EDiT, too few steps in total): its
        steps count towards the next round. ``record``: the fault-tolerant path's fields
        (committed, quorum, ...) for the log entry, which is then written whatever the
        outcome."""
        if rnd.skipped:
            self.num_skipped_syncs += 1
            if rnd.delayed:
                # Non-blocking: the steps up to the snapshot count towards the next sync
                # (defect 7), whose window already started at the snapshot; so does the
                # time they took.
                self.steps_since_sync += rnd.my_steps
                if rnd.windows:
                    self.clock.window_offset += rnd.windows[self.replica]
            else:
                self.clock.restart()
        elif applied and rnd.units:
            self.num_syncs += 1
            self.last_sync_step = self.global_step
            if rnd.step_counts is not None:
                self.progress.record_sync(rnd.step_counts.tolist(), rnd.windows or [])
            if not (rnd.delayed and isinstance(self.schedule, NonBlockingSchedule)):
                self.steps_since_sync = 0  # (non-blocking: reset at the launch)
                self.clock.restart()
            self._pending_counts = None
        elif not rnd.units and not self.steps_since_sync:
            self.clock.restart()  # joined: this replica's window starts now
        if record is None and (rnd.skipped or not applied):
            return
        rnd.staleness = max(0, self._next_index - 1 - rnd.index)
        rnd.replicas = len(rnd.members) if rnd.members else self.reduction.num_replicas
        entry = rnd.log_entry(self.global_step, self.clock.take_wait(),
                              fragment=self._log_fragments)
        if record is not None:
            entry.update(record)
            self._next_index = rnd.index + 1
        self._sync_log.append(entry)

    # ================================================================== hooks
    def _root_pre_hook(self, module: nn.Module, args: Any) -> None:
        if not module.training or not self.sync_pending:
            return
        # FSDP2 keeps the root unit gathered after a forward without backward (evaluation);
        # reshard so the next all-gather reads the synced shards, not a stale full copy.
        reshard(module)
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

    def _start_round(self, step_counts: torch.Tensor | None, units: list[int],
                     fragment: int = 0) -> None:
        self._call_before_sync(units)
        self._round = self.open_round(step_counts, units, fragment)

    def _advance(self, u: int) -> None:
        """Queue the round's units up to ``prefetch_depth`` past unit ``u``, then wait for
        (and, if delayed, merge) every unit of the round up to ``u``."""
        rnd = self._round
        assert rnd is not None
        upto = rnd.position(u)
        last = min(len(rnd.units), upto + self.config.prefetch_depth)
        while len(rnd.submitted) < last:
            rnd.submitted.append(self.comm.submit(self.reduction.unit_job, rnd,
                                                  len(rnd.submitted), stats=rnd.comm,
                                                  cause="rounds"))
        while rnd.waited < upto:
            t0 = time.perf_counter()
            with record_function("editrain::sync::wait"):
                rnd.submitted[rnd.waited].result()  # re-raises a failed job's exception
            waited = time.perf_counter() - t0
            rnd.wait_s += waited
            self.total_wait_s += waited
            if rnd.delayed:
                unit = self.units[rnd.units[rnd.waited]]
                if rnd.skipped and not unit.eager_replicas:
                    unit.launch = None  # nothing was reduced: the local model stays
                else:
                    unit.merge(self.config.merge, self.config.merge_alpha)
            rnd.waited += 1
        if rnd.waited == len(rnd.units):
            self._round = None
            self.close_round(rnd)

    def _drain_round(self) -> None:
        if self._round is not None:
            self._advance(len(self.units) - 1)

    def _wait_inflight(self) -> None:
        """Wait for the jobs of every delayed round (no merge: that stays on schedule)."""
        for rnd in self.inflight + ([self._merge_next] if self._merge_next else []):
            rnd.wait()
        if self.ft is not None:
            self.ft.wait_inflight()

    # ================================================================== the fault-tolerant mode
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
        self.reduction.seed = int(sd["seed"])
        self.progress.load_state_dict(sd["progress"])
        if self.detectors is not None and sd["detectors"] is not None:
            self.detectors.load_state_dict(sd["detectors"])
        self.steps_since_sync = 0
        self.last_sync_step = self.global_step
        self.clock.restart()

    # ================================================================== helpers
    def _create_anchors(self) -> None:
        self._check_replicas_agree()
        for unit in self.units:
            unit.create_anchor()
        self._take_loss()  # the first round's losses are the local phase's
        self.progress.start(self.global_step)
        self.steps_since_sync = 0
        self.clock.restart_all()
        # The sync log's counters describe syncs: warm-up gradient traffic is not sync traffic.
        self.comm.stats.reset()

    @torch.no_grad()
    def _check_replicas_agree(self) -> None:
        """The local phase must start from one model on every replica (the anchors are
        taken from each replica's own parameters): compare a checksum of every unit's
        shard (sum and sum of squares, float64) across replicas, agreed over the replica's
        ranks (every pipeline stage), and fail on every rank alike if they differ (e.g.
        different seeds)."""
        if self.comm.sync_size == 1:
            return  # (the fault-tolerant mode: a joining replica heals instead)
        sums = torch.zeros(len(self.units), 2, dtype=torch.float64, device=self.device)
        for i, unit in enumerate(self.units):
            if unit.numel:
                flat = unit.flat_params().double()
                sums[i, 0], sums[i, 1] = flat.sum(), flat.square().sum()
        got = self.comm.run(self.comm.all_gather_sync, sums, cause="control").cpu()
        scale = got[0].abs().clamp_min(1e-12)
        differs = ((got - got[0]).abs() > 1e-6 * scale).any(dim=2).any(dim=0)  # [units]
        agreed = differs.to(torch.float64).to(self.device)
        self.comm.run(self.comm.all_reduce_shard, agreed, dist.ReduceOp.MAX)
        bad = [self.units[i].name for i, d in enumerate(agreed.tolist()) if d]
        if self.topo.pp_size > 1:
            # Another stage's units may differ: every stage of the replica fails alike
            # (a stage that went on alone would hang in the pipeline).
            verdict = torch.tensor([float(bool(bad))], dtype=torch.float64,
                                   device=self.device)
            self.comm.run(self.comm.all_reduce_replica, verdict, dist.ReduceOp.MAX)
            if float(verdict) and not bad:
                bad = ["of another pipeline stage"]
        if bad:
            raise RuntimeError(
                f"replicas start the local phase from different parameters (units "
                f"{', '.join(bad)}): every replica must hold the same model when local SGD "
                f"begins; initialise every replica with the same seed or load the same "
                f"checkpoint")

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
            "inflight": [r.state_dict() for r in self.inflight],
            "merge_next": None if self._merge_next is None else self._merge_next.state_dict(),
            "pending": self._pending,
            "pending_fragment": self._pending_fragment,
            "pending_counts": self.pending_counts,
            **self.clock.state_dict(),
            **self.progress.state_dict(),
            "detectors": self.detectors.state_dict() if self.detectors is not None else None,
            "rng": {"seed": self.seed},
            "loss": None if self._loss_sum is None else {
                "sum": float(self._loss_sum), "steps": self._loss_steps},
        }

    def _load_plain(self, sd: dict[str, Any], elastic: bool) -> None:
        self.num_syncs = int(sd["num_syncs"])
        self.num_skipped_syncs = int(sd["num_skipped_syncs"])
        self.num_syncs_forced = int(sd["num_syncs_forced"])
        self._next_index = int(sd.get("next_index", self.num_syncs))
        self.inflight, self._merge_next = [], None
        self.progress.load_state_dict(sd)
        self.reduction.seed = int(sd["rng"]["seed"])
        if elastic:
            # A-EDiT replicas were at different steps: the replica-steps done are converted
            # to this topology at equal tokens, and every replica restarts at their mean (the
            # budget and the schedule stay counted in the run's first topology). Every other
            # method keeps the (common) step count.
            # (R, S) of the saving topology: (R, S[, T]), or (R, P, S, T) with stages
            topo = sd["topology"]
            shards = topo[2] if len(topo) == 4 else topo[1]
            old = (max(1, int(topo[0])), max(1, int(shards)))
            if self.config.use_async:
                self.progress.rescale(old)
                self.global_step = int(round(self.synced_replica_steps / self.num_replicas))
            else:
                self.global_step = int(sd["global_step"])
            self.steps_since_sync, self._pending, self._pending_counts = 0, False, None
            self._next_index = self.num_syncs  # rounds in flight are dropped
            for unit in self.units:
                unit.launch = None
            self.clock.restart_all()
            self.progress.last_window_counts, self.progress.last_window_s = None, 0.0
        else:
            self.global_step = int(sd["global_step"])
            self.steps_since_sync = int(sd["steps_since_sync"])
            self._pending = bool(sd["pending"])
            self._pending_fragment = int(sd.get("pending_fragment", 0))
            self.inflight = [SyncRound.from_state(r) for r in sd.get("inflight", [])]
            if sd.get("merge_next") is not None:
                self._merge_next = SyncRound.from_state(sd["merge_next"])
            counts = sd["pending_counts"]
            self._pending_counts = (None if counts is None
                                    else torch.tensor(counts, dtype=torch.float64))
            self.clock.load_state_dict(sd)
            if sd.get("loss") is not None:
                self._loss_sum = torch.tensor(float(sd["loss"]["sum"]), dtype=torch.float64,
                                              device=self.device)
                self._loss_steps = int(sd["loss"]["steps"])
        if self.detectors is not None and sd["detectors"] is not None:
            self.detectors.load_state_dict(sd["detectors"], allow_resize=True)


EDiT = SyncEngine
"""The engine's original name (the paper's method), kept for existing code: the same class."""

__all__ = ["EDiT", "SyncEngine"]
