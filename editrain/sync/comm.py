"""The communication path of the sync engine.

All cross-replica collectives (on the *sync* group) and the engine's own shard-group
statistics run here, on one dedicated thread with a FIFO of jobs. Why a thread:

* the forward pass keeps computing unit ``u`` while the collectives of unit ``u + 1`` are in
  flight (gloo collectives release the GIL; on CUDA the jobs run on a side stream);
* one FIFO per process group keeps the collective order identical on every rank.

FSDP2 issues its own shard-group collectives from the main thread, so the engine uses a
*private* duplicate of the shard group here: two threads never share one process group.
On CUDA those private groups are gloo groups by default (tensors staged through pinned
host buffers), so NCCL only ever sees the main thread's collectives, in program order:
see ``docs/architecture.md``, "Collective order".
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# torch >= 2.10 renamed all_gather_into_tensor; keep working on both sides of the rename.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

LinkDelay = Callable[[int], float]
"""Simulated slow link: bytes this rank transmits for one message -> seconds to wait before
the collective (see :class:`editrain.sim.SharedLink`)."""


CAUSES = ("rounds", "statistics", "gradients", "evaluation", "consensus", "checkpoints",
          "control")
"""Why bytes crossed replicas (:class:`WireLedger`): a round's pseudo-gradients
(``rounds``), its statistics and loss gathers (``statistics``), gradient averaging in
warm-up and the synchronous method (``gradients``), evaluating the global model and
summing its loss (``evaluation``), making the replicas agree on one model (``consensus``),
saving a checkpoint (``checkpoints``), and everything else: the start's check that the
replicas agree, A-EDiT's clock and rendezvous, the logged loss's average (``control``)."""


class WireLedger:
    """Bytes this rank sent in collectives that span replicas, by cause (:data:`CAUSES`),
    since the engine started (never reset). Every such collective of the engine and of the
    trainer goes through :class:`CommPath`, which counts it here: the ring formulas of
    :class:`CommStats` for what the collective transmits."""

    def __init__(self) -> None:
        self._bytes = dict.fromkeys(CAUSES, 0)
        self._lock = threading.Lock()

    def add(self, cause: str, nbytes: int) -> None:
        """Count ``nbytes`` sent for ``cause``."""
        if cause not in self._bytes:
            raise ValueError(f"unknown cause of cross-replica bytes {cause!r}; "
                             f"allowed: {', '.join(CAUSES)}")
        with self._lock:
            self._bytes[cause] += nbytes

    def totals(self) -> dict[str, int]:
        """Bytes per cause, and their ``total``."""
        with self._lock:
            out = dict(self._bytes)
        out["total"] = sum(out.values())
        return out


def format_bytes_by_cause(totals: dict[str, int]) -> str:
    """``total 1.2 MiB (rounds 1.2 MiB, statistics 3.1 KiB, ...)``: the causes that sent
    anything, for the log's last line."""
    def size(n: int) -> str:
        for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
            if n >= scale:
                return f"{n / scale:.1f} {unit}"
        return f"{n} B"
    parts = [f"{c} {size(totals[c])}" for c in CAUSES if totals.get(c)]
    return f"{size(totals.get('total', 0))} across replicas" + (
        f" ({', '.join(parts)})" if parts else "")


@dataclass
class CommStats:
    """Counters of what went over the wire; reset by the engine after each sync."""

    sync_collectives: int = 0
    """Collectives on the sync group (cross-replica traffic)."""
    shard_collectives: int = 0
    """Collectives on the engine's private shard group."""
    bytes_sent: int = 0
    """Bytes this rank transmitted in cross-replica collectives (ring algorithms: an
    all-reduce of N bytes sends 2 (R - 1) / R * N, an all-gather (R - 1) * N)."""
    max_message_bytes: int = 0
    """Largest single cross-replica message (bytes transmitted)."""
    comm_time_s: float = 0.0
    """Wall time spent inside collectives (including simulated link delay)."""
    link_delay_s: float = 0.0
    """Part of ``comm_time_s`` that is simulated link delay."""
    lifetime_sync_collectives: int = 0
    """Cross-replica collectives since the engine started (never reset)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def snapshot(self) -> dict[str, Any]:
        """Plain-data copy of the counters."""
        with self._lock:
            return {
                "sync_collectives": self.sync_collectives,
                "shard_collectives": self.shard_collectives,
                "bytes_sent": self.bytes_sent,
                "max_message_bytes": self.max_message_bytes,
                "comm_time_s": self.comm_time_s,
                "link_delay_s": self.link_delay_s,
            }

    def reset(self) -> None:
        """Zero every counter."""
        with self._lock:
            self.sync_collectives = self.shard_collectives = 0
            self.bytes_sent = self.max_message_bytes = 0
            self.comm_time_s = self.link_delay_s = 0.0

    def add_sync(self, nbytes: int, seconds: float, delay: float) -> None:
        """Count one cross-replica collective."""
        with self._lock:
            self.sync_collectives += 1
            self.lifetime_sync_collectives += 1
            self.bytes_sent += nbytes
            self.max_message_bytes = max(self.max_message_bytes, nbytes)
            self.comm_time_s += seconds
            self.link_delay_s += delay

    def add_shard(self, seconds: float) -> None:
        """Count one collective on the private shard group."""
        with self._lock:
            self.shard_collectives += 1
            self.comm_time_s += seconds


class CommPath:
    """A FIFO thread that runs collective jobs for the sync engine.

    Args:
        sync_group: process group of this rank's sync group (its ``R`` peers), or None if R=1.
        shard_group: a *private* process group over this rank's replica, or None if S=1.
        device: device of the tensors the jobs touch (selects the side stream on CUDA).
        link_delay: optional simulated link cost per cross-replica message.
        stage_on_host: the groups are CPU groups (gloo) while the tensors live on an
            accelerator: every collective copies through a (pinned) host buffer.
        cross: the fault-tolerant mode's cross-replica group (a
            :class:`editrain.sync.ft.TorchftGroup`): cross-replica collectives go through
            it, over the replicas of the current quorum, instead of ``sync_group``.
        agree_group: with pipeline stages, a private group over the whole replica (every
            stage), for what its ranks must decide alike (:meth:`all_reduce_replica`);
            None: ``shard_group`` is the whole replica.
    """

    def __init__(
        self,
        sync_group: dist.ProcessGroup | None,
        shard_group: dist.ProcessGroup | None,
        device: torch.device,
        link_delay: LinkDelay | None = None,
        stage_on_host: bool = False,
        cross: Any = None,
        agree_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.sync_group = sync_group
        self.shard_group = shard_group
        self.agree_group = agree_group
        self.cross = cross
        self._sync_size = dist.get_world_size(sync_group) if sync_group is not None else 1
        self.shard_size = dist.get_world_size(shard_group) if shard_group is not None else 1
        self.agree_size = (dist.get_world_size(agree_group) if agree_group is not None
                           else self.shard_size)
        """Ranks of the whole replica (every pipeline stage)."""
        self.device = device
        self.link_delay = link_delay
        self.stats = CommStats()
        """Counters since the last reset (and lifetime totals)."""
        self.ledger = WireLedger()
        """Cross-replica bytes by cause since the start (every collective counted here)."""
        self._sink: CommStats | None = None  # the running job's own counters (comm thread)
        self._cause = "control"  # the running job's cause (comm thread)
        self._thread_id: int | None = None  # the communication thread, once it has run a job
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="editrain-comm")
        self._closed = False
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.stage_on_host = stage_on_host
        self.trace: list[tuple[str, str, int, str]] | None = None
        """Set to a list to record every collective issued, in order, as ``(group, op,
        numel, dtype)`` (tests check that every rank issues the same sequence)."""

    @property
    def sync_size(self) -> int:
        """Replicas this rank's cross-replica collectives span (the fault-tolerant mode:
        the current quorum's)."""
        return self.cross.size if self.cross is not None else self._sync_size

    # ------------------------------------------------------------------ jobs
    def submit(self, fn: Callable[..., Any], *args: Any, stats: CommStats | None = None,
               cause: str = "control") -> Future:
        """Queue ``fn(*args)`` behind every job submitted before it.

        Args:
            fn: the job; it runs on the communication thread.
            *args: its arguments.
            stats: extra counters for this job's collectives (e.g. one sync round's), on
                top of :attr:`stats`.
            cause: what its cross-replica bytes count as in :attr:`ledger` (:data:`CAUSES`);
                a job that names none counts as ``control``, never as a round's, so that a
                new exchange shows up where only a few bytes per round are expected.
        """
        if cause not in CAUSES:
            raise ValueError(f"unknown cause {cause!r}; allowed: {', '.join(CAUSES)}")
        if self._closed:
            raise RuntimeError("the sync engine is closed (engine.close() or the end of its "
                               "`with` block): its communication thread has stopped")
        if self._stream is None:
            return self._pool.submit(self._run_counted, stats, cause, fn, *args)
        # The job reads tensors the main stream wrote: order it after them.
        ready = torch.cuda.current_stream(self.device).record_event()
        return self._pool.submit(self._run_on_side_stream, ready, stats, cause, fn, *args)

    def _run_counted(self, stats: CommStats | None, cause: str, fn: Callable[..., Any],
                     *args: Any) -> Any:
        self._thread_id = threading.get_ident()  # the pool's one thread (see call())
        self._sink, self._cause = stats, cause
        try:
            return fn(*args)
        finally:
            self._sink, self._cause = None, "control"

    def run(self, fn: Callable[..., Any], *args: Any, stats: CommStats | None = None,
            cause: str = "control") -> Any:
        """Queue ``fn(*args)`` and wait for its result (blocking); ``stats`` and ``cause``
        as for :meth:`submit`."""
        return self.submit(fn, *args, stats=stats, cause=cause).result()

    @contextlib.contextmanager
    def counted_as(self, cause: str):
        """Inside a job: the block's cross-replica bytes count as ``cause`` in
        :attr:`ledger` (the job's own counters still get them). For one job that runs
        collectives of several causes, such as the fault-tolerant round, whose rendezvous,
        statistics and reductions are one job because its first failure must end the
        rest: each part is counted as it would be in a job of its own."""
        if cause not in CAUSES:
            raise ValueError(f"unknown cause {cause!r}; allowed: {', '.join(CAUSES)}")
        if threading.get_ident() != self._thread_id:
            raise RuntimeError("counted_as is for jobs on the communication thread")
        previous, self._cause = self._cause, cause
        try:
            yield
        finally:
            self._cause = previous

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the communication thread: at once when called from inside a job
        (already there, in FIFO order), else queued behind every job submitted before it and
        waited for (:meth:`run`). For code that runs on either thread, e.g. writing an
        all-gathered unit into the parameters (see :class:`editrain.sync.outer.SyncUnit`)."""
        if threading.get_ident() == self._thread_id:
            return fn(*args)
        return self.run(fn, *args)

    def _run_on_side_stream(self, ready: Any, stats: CommStats | None, cause: str,
                            fn: Callable[..., Any], *args: Any) -> Any:
        assert self._stream is not None
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            out = self._run_counted(stats, cause, fn, *args)
        # Results are consumed by the main stream right after the future resolves.
        self._stream.synchronize()
        return out

    def close(self) -> None:
        """Finish queued jobs and stop the thread; later jobs are refused."""
        self._closed = True
        self._pool.shutdown(wait=True)

    # ------------------------------------------------------------------ collectives
    # The methods below are called from inside jobs, i.e. on the communication thread.
    def _delay(self, nbytes: int) -> float:
        if self.link_delay is None:
            return 0.0
        seconds = self.link_delay(nbytes)
        if seconds > 0:
            time.sleep(seconds)
        return seconds

    @contextlib.contextmanager
    def _timed_sync(self, nbytes: int):
        t0 = time.perf_counter()
        delay = self._delay(nbytes)
        yield
        elapsed = time.perf_counter() - t0
        self.ledger.add(self._cause, nbytes)
        for stats in (self.stats, self._sink):
            if stats is not None:
                stats.add_sync(nbytes, elapsed, delay)

    def _issue(self, group: str, op: str, tensor: torch.Tensor) -> None:
        if self.trace is not None:
            self.trace.append((group, op, tensor.numel(), str(tensor.dtype)))

    @contextlib.contextmanager
    def _wire(self, tensor: torch.Tensor, cross: bool = False):
        """The tensor a collective runs on: ``tensor`` itself, or with host staging a
        (pinned) CPU copy whose result is copied back into ``tensor`` afterwards (always
        for the fault-tolerant mode's cross-replica group, a gloo group)."""
        staged = self.stage_on_host or (cross and self.cross is not None)
        if not staged or tensor.device.type == "cpu":
            yield tensor
            return
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor)
        yield host
        tensor.copy_(host)

    def all_reduce_sync(self, tensor: torch.Tensor) -> None:
        """In-place sum over the sync group (cross-replica)."""
        if self.sync_size == 1:
            return
        r = self.sync_size
        nbytes = tensor.numel() * tensor.element_size()
        self._issue("sync", "all_reduce", tensor)
        with self._timed_sync(2 * (r - 1) * nbytes // r), self._wire(tensor, True) as wire:
            if self.cross is not None:
                self.cross.all_reduce(wire)
            else:
                dist.all_reduce(wire, group=self.sync_group)

    def all_gather_sync(self, tensor: torch.Tensor) -> torch.Tensor:
        """Gather ``tensor`` from every replica: result shape ``[R, *tensor.shape]``."""
        if self.sync_size == 1:
            return tensor.unsqueeze(0).clone()
        # Flat output: gloo wants [R * n], not [R, n].
        out = torch.empty(self.sync_size * tensor.numel(), dtype=tensor.dtype,
                          device=tensor.device)
        nbytes = tensor.numel() * tensor.element_size()
        self._issue("sync", "all_gather", tensor)
        with self._timed_sync((self.sync_size - 1) * nbytes), \
                self._wire(out, True) as wire_out, \
                self._wire(tensor.reshape(-1).contiguous(), True) as wire_in:
            if self.cross is not None:
                self.cross.all_gather(wire_out, wire_in)
            else:
                _all_gather_flat(wire_out, wire_in, group=self.sync_group)
        return out.view(self.sync_size, *tensor.shape)

    def all_reduce_main(self, tensor: torch.Tensor, group: dist.ProcessGroup | None,
                        cause: str, spans_replicas: bool) -> None:
        """In-place sum over ``group`` (None: the world) on the *caller's* thread, for the
        trainer's own collectives on the mesh's groups (an evaluation's loss sums, the
        logged loss): counted in :attr:`ledger` under ``cause`` (a ring all-reduce over
        the group) when the group ``spans_replicas``, so that no cross-replica byte goes
        uncounted. Not for the communication thread's groups."""
        size = dist.get_world_size(group)
        if size > 1 and spans_replicas:
            self.ledger.add(cause, 2 * (size - 1) * tensor.numel() * tensor.element_size()
                            // size)
        dist.all_reduce(tensor, group=group)

    def all_reduce_shard(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
        """In-place reduction over this replica's ranks (fast intra-replica link)."""
        if self.shard_size == 1:
            return
        t0 = time.perf_counter()
        self._issue("shard", f"all_reduce_{op}", tensor)
        with self._wire(tensor) as wire:
            dist.all_reduce(wire, op=op, group=self.shard_group)
        elapsed = time.perf_counter() - t0
        for stats in (self.stats, self._sink):
            if stats is not None:
                stats.add_shard(elapsed)

    def all_reduce_replica(self, tensor: torch.Tensor,
                           op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
        """In-place reduction over the whole replica, every pipeline stage: for what every
        rank of a replica must decide alike (its stages step together). Without pipeline
        stages the very :meth:`all_reduce_shard`."""
        if self.agree_group is None:
            self.all_reduce_shard(tensor, op)
            return
        t0 = time.perf_counter()
        self._issue("replica", f"all_reduce_{op}", tensor)
        with self._wire(tensor) as wire:
            dist.all_reduce(wire, op=op, group=self.agree_group)
        elapsed = time.perf_counter() - t0
        for stats in (self.stats, self._sink):
            if stats is not None:
                stats.add_shard(elapsed)

    def all_gather_shard(self, tensor: torch.Tensor) -> torch.Tensor:
        """Gather ``tensor`` (the same size on every rank) from every rank of this replica,
        over the fast intra-replica link: a flat result of ``S * tensor.numel()`` elements in
        shard order. Counted as a shard collective (no cross-replica bytes)."""
        if self.shard_size == 1:
            return tensor.reshape(-1).clone()
        out = torch.empty(self.shard_size * tensor.numel(), dtype=tensor.dtype,
                          device=tensor.device)
        t0 = time.perf_counter()
        self._issue("shard", "all_gather", tensor)
        with self._wire(out) as wire_out, \
                self._wire(tensor.reshape(-1).contiguous()) as wire_in:
            _all_gather_flat(wire_out, wire_in, group=self.shard_group)
        elapsed = time.perf_counter() - t0
        for stats in (self.stats, self._sink):
            if stats is not None:
                stats.add_shard(elapsed)
        return out
