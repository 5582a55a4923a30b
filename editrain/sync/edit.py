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
fault-tolerant mode's in :mod:`editrain.sync.ft_round`) and sees the engine only through
an :class:`~editrain.sync.view.EngineView`, the round slots and every round's start and
close are :mod:`editrain.sync.rounds`, every round is a
:class:`~editrain.sync.round.SyncRound` whose jobs run the one reduction of
:mod:`editrain.sync.reduction`, A-EDiT's clock and rendezvous are
:mod:`editrain.sync.clock`, the anchors as one model (consensus check, evaluation swap)
are :mod:`editrain.sync.global_model`, the warm-up's gradient averaging
:mod:`editrain.sync.warmup` and the loss tracking :mod:`editrain.sync.losses`. The engine
keeps the forward hooks that drive the rounds, and the counters.

The engine owns all of its state: ``state_dict()`` / ``load_state_dict()`` give and take it
as a DCP-ready tree whose layout lives in :mod:`editrain.sync.state` (the per-rank plain
part in :mod:`editrain.sync.plain_state`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from editrain.sync.buffers import BufferSync
from editrain.sync.clock import SyncClock
from editrain.sync.comm import CommPath, LinkDelay
from editrain.sync.config import SyncConfig
from editrain.sync.ft_round import FaultTolerantSchedule
from editrain.sync.global_model import GlobalModel
from editrain.sync.losses import LossTracker
from editrain.sync.plain_state import PlainState
from editrain.sync.progress import Progress
from editrain.sync.reduction import Reduction
from editrain.sync.rounds import Rounds
from editrain.sync.schedules import NonBlockingSchedule, Schedule, plain_schedule
from editrain.sync.setup import (
    build_units,
    check_fault_tolerant,
    check_no_live_engine,
    check_replica_wrapper,
    claim_modules,
    comm_group_backend,
    default_trigger,
    private_groups,
    release_groups,
    reshard,
)
from editrain.sync.state import StateLayout
from editrain.sync.triggers import SyncTrigger
from editrain.sync.view import Counters, EngineView
from editrain.sync.warmup import GradientAveraging
from editrain.topology import topology_of
from editrain.units import unwrap_ddp

BeforeSyncHook = Callable[[int], None]
"""Called on every rank, in the main thread, just before sync number ``n`` starts."""


def _part(part: str, name: str, doc: str) -> property:
    """A read-only engine attribute that is ``name`` of one of its parts (e.g. a counter)."""
    def get(self: SyncEngine) -> Any:
        return getattr(getattr(self, part), name)
    get.__doc__ = doc
    return property(get)


def _flag(name: str, doc: str) -> property:
    """A read-only engine attribute that is its own private ``name``."""
    def get(self: SyncEngine) -> Any:
        return getattr(self, name)
    get.__doc__ = doc
    return property(get)


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
        check_no_live_engine([unwrap_ddp(model), *blocks])

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
        self.trigger = default_trigger(cfg) if trigger is None else trigger

        self.counters = Counters()
        """Steps, syncs and waits (shared with the schedule; saved by state_dict())."""
        self.anchors = GlobalModel(self.units, self.model, self.comm, self.device, self.topo)
        """The units' anchors as one model (:mod:`editrain.sync.global_model`)."""
        self.averaging = GradientAveraging(self.comm, self.reduction)
        self.losses = LossTracker(self.device)
        """:meth:`record_loss`'s losses since the last round opened."""
        self.progress = Progress(self.num_replicas, self.topo.shard_size)
        """A-EDiT's progress and budget (:mod:`editrain.sync.progress`)."""
        self.clock = SyncClock(self.comm, self.device, cfg.min_total_global_steps, clock,
                               self.progress)  # A-EDiT's clock, rendezvous: sync/clock.py

        self.rounds = Rounds(cfg, self.units, self.fragments, self.model, self.comm,
                             self.reduction, self.clock, self.progress, self.counters,
                             self.losses, before_sync, self.replica)
        """The round slots: armed, running, in flight, due (:mod:`editrain.sync.rounds`)."""
        self._plain = PlainState(cfg, self.counters, self.rounds, self.clock, self.progress,
                                 self.reduction, self.losses, self.num_replicas)
        view = self._view()
        self.ft = None if cross_replica is None else FaultTolerantSchedule(view, cross_replica)
        """The fault-tolerant schedule (None in the plain mode)."""
        self.schedule: Schedule = self.ft or plain_schedule(view)
        """When rounds start and merge (:mod:`editrain.sync.schedules`)."""
        self.rounds.reset_at_launch = isinstance(self.schedule, NonBlockingSchedule)
        self.buffers = BufferSync(model, self.comm, self.replica, self.ft is None, self.topo)
        if not self.rounds.reset_at_launch:  # non-blocking: finish(force=True) only
            self.rounds.on_sync = self.buffers.mark_due

        self._first_module_unit = built.first_module_unit
        self._handles = [model.register_forward_pre_hook(self._root_pre_hook, prepend=True)]
        for u, (_, module) in enumerate(built.modules, start=self._first_module_unit):
            self._handles.append(
                module.register_forward_pre_hook(self._make_block_hook(u), prepend=True)
            )
        reshard(model)  # anchors must be taken from the shards, not a gathered copy
        if cfg.is_local_sgd and cfg.local_sgd_warmup_steps == 0:
            self._create_anchors()
        claim_modules([model, *(m for _, m in built.modules)], self)

    def _view(self) -> EngineView:
        """What the schedule sees of this engine (:mod:`editrain.sync.view`)."""
        r = self.rounds
        return EngineView(
            config=self.config, units=self.units, fragments=self.fragments,
            replica=self.replica, num_replicas=self.num_replicas, device=self.device,
            counters=self.counters, trigger=self.trigger, clock=self.clock,
            progress=self.progress, comm=self.comm, reduction=self.reduction,
            replica_group=self.groups.replica_main, arm=r.arm, run_now=r.run_now,
            launch=r.launch, merge_now=r.merge_now,
            merge_in_next_forward=r.merge_in_next_forward, settle=r.settle,
            oldest_inflight=r.oldest_inflight, pop_inflight=r.pop_inflight,
            armed=lambda: r.armed, armed_counts=lambda: self.pending_counts,
            open_round=r.open_round, close_round=r.close_round, anchors=self.anchors)

    # ================================================================== public loop API
    def __enter__(self) -> SyncEngine:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # After an exception the other ranks may never come to the barrier: stop the
        # thread and the hooks only, and leave the groups to the process's end.
        self.close(release=exc_type is None)

    global_step = _part("counters", "global_step", "Inner steps taken (this replica's).")
    steps_since_sync = _part("counters", "steps_since_sync", "Inner steps since this replica's last sync.")
    num_syncs = _part("counters", "num_syncs", "Syncs applied.")
    num_skipped_syncs = _part("counters", "num_skipped_syncs", "A-EDiT rounds skipped (too few steps).")
    num_syncs_forced = _part("counters", "num_syncs_forced", "Syncs run by ``finish(force=True)``.")
    last_sync_step = _part("counters", "last_sync_step", "Global step of the last sync.")
    total_wait_s = _part("counters", "total_wait_s", "Seconds the caller waited for sync jobs.")

    total_grad_sync_s = _part("averaging", "total_s", "Seconds spent averaging gradients "
                              "across replicas (warm-up / sync method).")
    seed = _part("reduction", "seed", "Seeds GTA's random sparsification (saved with the "
                 "state).")
    detectors = _part("reduction", "detectors", "The anomaly detectors "
                      "(:class:`editrain.sync.penalty.DetectorBank`), or None.")
    # A-EDiT's book-keeping, kept under its former names.
    synced_replica_steps = _part("progress", "synced_replica_steps",
                                 "Replica-steps of all replicas up to the last sync.")
    last_window_counts = _part("progress", "last_window_counts",
                               "Each replica's steps in the last sync's window.")
    last_window_s = _part("progress", "last_window_s", "Length of the last window "
                          "(gathered: identical on every rank).")

    def set_budget(self, steps: float | None) -> None:
        """A-EDiT: the run's budget in synchronous-step equivalents (``train.steps``). With
        the time trigger, a replica then also enters the rendezvous once the cluster has
        probably used it up; :attr:`budget_spent` says when a sync has reached it."""
        self.progress.budget = steps

    budget_spent = _part("progress", "spent", "Whether a finished sync reached the budget "
                         "(agreed: from gathered counts).")

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
        return self.progress.position(self.replica, self.rounds.unsynced_steps())

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
        self._check_open("after_backward")
        if self.in_warmup and self.num_replicas > 1:
            self.averaging.average()

    def record_loss(self, loss: torch.Tensor | float) -> None:
        """Optional: this rank's training loss of the step, so that every round also
        tells each replica's mean training loss since its previous round (the sync log's
        ``replica_loss``, ``train/loss/replica{r}`` in the trackers) at the cost of one
        float64 per rank in the round's statistics gather (one small extra gather for a
        method without statistics). No host synchronisation: the loss is summed on its
        device. Call it on every rank or on none (the rounds' collectives must match);
        ``editrain train`` calls it at every step."""
        self._check_open("record_loss")
        self.losses.record(loss)

    def track_losses(self) -> None:
        """Make every round carry each replica's loss from now on, before the first
        :meth:`record_loss` (which calls it): NaN for a replica that recorded no step since
        its previous round. Call it on every rank where a rank may open a round before its
        first recorded step, as a replica group (re)joining a ``--ft`` run does: the rounds'
        collectives must match on every member."""
        self.losses.track()

    def step(self) -> None:
        """Call once after each inner ``optimizer.step()``: counts steps; the schedule
        starts, arms or merges rounds as due."""
        self._check_open("step")
        self.rounds.drain()  # a forward that skipped some units must not leave jobs behind
        self.buffers.sync_if_due()  # a round that closed in this step's forward
        c, cfg = self.counters, self.config
        c.global_step += 1
        if not cfg.is_local_sgd:
            return
        if c.global_step <= cfg.local_sgd_warmup_steps:
            if c.global_step == cfg.local_sgd_warmup_steps:
                self._create_anchors()
            return
        c.steps_since_sync += 1
        self.schedule.step()
        self.buffers.sync_if_due()  # a round that ran at this step boundary

    def attach(self, optimizer: torch.optim.Optimizer, average_gradients: bool = True
               ) -> list[Any]:
        """Drive the engine from ``optimizer.step()`` so the loop need not call it: a step
        pre-hook runs :meth:`after_backward` (with ``average_gradients``) and a step
        post-hook runs :meth:`step`. Clip gradients yourself? During warm-up they are then
        clipped before the cross-replica average: call :meth:`after_backward` before
        clipping and attach with ``average_gradients=False``. Returns the hooks' handles
        (``handle.remove()`` detaches); :meth:`close` removes them too, so the optimizer
        steps on without the engine afterwards."""
        self._check_open("attach")
        handles = []
        if average_gradients:
            handles.append(optimizer.register_step_pre_hook(
                lambda opt, args, kwargs: self.after_backward()))
        handles.append(optimizer.register_step_post_hook(lambda opt, args, kwargs: self.step()))
        self._handles.extend(handles)
        return handles

    def finish(self, force: bool = False) -> None:
        """Run a sync that is armed but not yet started, and merge a delayed round that is
        due (call before evaluating or saving: the same arithmetic as in the next forward).
        With ``force``, also sync replicas that trained since the last sync although no
        sync is due (the end of training), so that every replica holds the global model:
        with streaming, rounds in flight are merged at once and every unit syncs once more.
        Syncs, and ``force`` always, also make the persistent buffers agree
        (:mod:`editrain.sync.buffers`). Every rank must call it at the same point."""
        self._check_open("finish")
        self.rounds.drain()
        ran_armed = self.rounds.settle()
        if force and self.config.is_local_sgd and not self.in_warmup:
            self.schedule.finish(force, ran_armed)
        self.buffers.due |= force  # the end: the buffers agree too, whatever ran
        self.buffers.sync_if_due()

    def join(self, start_quorum: int | None = None, timeout_s: float = 600.0,
             between_attempts: Callable[[], None] | None = None) -> bool:
        """The fault-tolerant mode: take part in the quorum before training (at a start, a
        resume, a restart); a replica behind the others heals there from a healthy peer. The
        first round needs ``start_quorum`` replicas (default: all; a replica rejoining a
        running job passes 2); ``between_attempts`` runs on every rank after each failed
        attempt and ends the join by raising. True once joined; False without torchft."""
        if self.ft is None:
            return False
        return self.ft.join(self.num_replicas if start_quorum is None else start_quorum,
                            timeout_s, between_attempts)

    closed = _flag("_closed", "Whether :meth:`close` has run (the model may then get a "
                   "new engine; a second live one is refused).")

    def _check_open(self, call: str) -> None:
        """Refuse a loop call on a closed engine: its hooks are gone and its thread has
        stopped, so the call could neither count a step nor run a sync."""
        if self._closed:
            raise RuntimeError(f"engine.{call}(): the engine is closed (engine.close() or "
                               "the end of its `with` block); build a new engine with "
                               "editrain.edit(...) to go on syncing")

    def close(self, release: bool = True) -> None:
        """End the engine: finish the round in flight, remove every hook (the forward
        hooks, and the optimizer hooks of :meth:`attach`), stop the communication thread
        and, with ``release``, destroy the process groups the engine created, after a
        barrier on the default group (every rank must call it then; the context manager
        does, unless the block raised). Destroy the default group after this
        (:func:`editrain.shutdown`): groups left to the interpreter's exit make gloo abort
        the process now and then. Calling it again does nothing more; the loop's calls
        (:meth:`step`, :meth:`after_backward`, :meth:`finish`, ...) are refused after it."""
        if not self._closed:
            self._closed = True
            self.rounds.drain()
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

    armed = _part("rounds", "armed", "Whether a round is armed: it runs layer-wise in the "
                  "next training forward.")

    @property
    def pending_counts(self) -> list[float] | None:
        """A-EDiT: every replica's steps in the window of the armed sync (None otherwise)."""
        counts = self.rounds.armed_counts
        return None if counts is None else counts.tolist()

    sync_pending = _part("rounds", "pending", "Whether the next training forward will run "
                         "a layer-wise sync (or merge one).")
    inflight = _part("rounds", "inflight", "Delayed rounds launched and not yet merged, in "
                     "launch order.")

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
        out, self.rounds.sync_log = self.rounds.sync_log, []
        return out

    def scale_pseudo_gradients(self, factor: float) -> None:
        """Fault injection: multiply this rank's pseudo-gradients by ``factor`` (the local
        model becomes ``anchor - factor * (anchor - theta)``), e.g. from a ``before_sync``
        callback (then only the units of the sync that starts), to show what the penalty
        does with a corrupted replica."""
        self.anchors.scale_pseudo_gradients(factor, self.rounds.starting)

    def extra_memory(self) -> dict[str, int]:
        """Bytes of anchors + outer state (+ error feedback) on this rank, by device type."""
        return self.anchors.extra_memory()

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
        self._check_open("global_model")
        self.rounds.drain()
        self._wait_inflight()
        with self.anchors.swapped_in():
            yield

    # ================================================================== hooks
    def _root_pre_hook(self, module: nn.Module, args: Any) -> None:
        if not module.training or not self.rounds.pending:
            return
        # FSDP2 keeps the root unit gathered after a forward without backward (evaluation);
        # reshard so the next all-gather reads the synced shards, not a stale full copy.
        reshard(module)
        self.rounds.start_pending()
        self.rounds.advance(self._first_module_unit - 1)  # the root unit (-1: there is none)

    def _make_block_hook(self, u: int) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, args: Any) -> None:
            if self.rounds.running is not None:
                self.rounds.advance(u)
        return hook

    def _wait_inflight(self) -> None:
        """Wait for the jobs of every delayed round (no merge: that stays on schedule)."""
        self.rounds.wait_inflight()
        if self.ft is not None:
            self.ft.wait_inflight()

    def _create_anchors(self) -> None:
        self.anchors.create()
        self.losses.take()  # the first round's losses are the local phase's
        self.progress.start(self.global_step)
        self.counters.steps_since_sync = 0
        self.clock.restart_all()
        # The sync log's counters describe syncs: warm-up gradient traffic is not sync traffic.
        self.comm.stats.reset()

    # ================================================================== state
    @property
    def has_anchors(self) -> bool:
        """Whether the anchors exist (the local phase has begun)."""
        return self.anchors.exists

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
        self.rounds.drain()
        self._wait_inflight()
        return self._layout.pack([u.state_dict() for u in self.units], self._plain.state_dict())

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
        self._plain.load_state_dict(plain, elastic)
        if elastic:
            self.anchors.write_back()
        return elastic


EDiT = SyncEngine
"""The engine's original name (the paper's method), kept for existing code: the same class."""

__all__ = ["EDiT", "SyncEngine"]
