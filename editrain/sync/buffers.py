"""The model's buffers at a sync: every replica leaves it with the same ones.

A sync makes the replicas' parameters one global model, but a model also carries state that
training changes outside its parameters: BatchNorm's ``running_mean`` / ``running_var`` and
``num_batches_tracked``, or any buffer a forward updates. Left alone, the replicas would end
a run (``finish(force=True)``) with one set of parameters and R sets of buffers, and the
"global model" would evaluate differently on every replica. So at every applied sync the
engine makes them agree, as local-SGD implementations that average the whole model do:

* a floating-point buffer becomes the mean over the replicas (running statistics are
  averages over data, so the mean is the statistic over all replicas' data), except where
  every replica holds the same value, which is kept bitwise;
* any other buffer (integer counters such as ``num_batches_tracked``, flags) is taken from
  replica 0, as ``DistributedDataParallel`` takes buffers from rank 0: an average of
  counters or flags would mean nothing.

Non-blocking A-EDiT (``overlap_steps > 0`` with ``aedit``) syncs them at
``finish(force=True)`` only: each replica merges a round at a step of its own there, so a
collective after the merge would meet another replica's next rendezvous on the sync group
(a deadlock, seen with a step schedule of 2 and 3 steps per window).

Only persistent buffers are synced (those in ``model.state_dict()``): a non-persistent
buffer is derived from the configuration (editrain's Llama's rotary tables) and identical
everywhere by construction, so a model without persistent buffers sends nothing more. The
buffers are synced over the sync group (the ranks at one position of every replica); the
ranks of one replica hold their own copies, kept as the user's loop keeps them.

Not in the fault-tolerant mode (``dist.fault_tolerance = "torchft"``): there a round is
all or nothing over the replicas of its quorum, may commit on one replica and not on
another, and a replica that heals receives the engine's and the trainer's state, not the
model's buffers; a buffer collective at a step boundary, outside the round's vote, could
meet a replica that left or one that did not commit. So each replica keeps its own, and
the engine says so once, before training (:func:`unsynced_buffers_warning`), where the
model has floating persistent buffers, with pipeline stages once for each stage that has
some (integer ones, such as ``num_batches_tracked``, are counters the replicas mostly
agree on anyway).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from editrain.sync.comm import CommPath, CommStats
from editrain.topology import Topology

log = logging.getLogger("editrain")


def persistent_buffer_names(model: nn.Module) -> list[str]:
    """Names of ``model``'s persistent buffers (the buffers its state dict holds), in
    ``named_buffers()`` order."""
    saved = {id(t) for t in model.state_dict(keep_vars=True).values()}
    return [name for name, b in model.named_buffers() if id(b) in saved]


def warns_for_its_stage(topo: Topology, rank: int, replica: int) -> bool:
    """Whether ``rank`` says :func:`unsynced_buffers_warning` of its model: the first rank
    (shard 0, tp 0) of its pipeline stage in replica group 0. Each stage holds the
    buffers of its own layers (a stage's ranks the same ones), so one rank per stage
    names them all, once; without pipeline parallelism that is the group's rank 0.

    Args:
        topo: the job's topology (of one replica group in the fault-tolerant mode).
        rank: this process's rank in it.
        replica: this rank's replica (group) index.
    """
    return replica == 0 and topo.position_of(rank) % topo.stage_size == 0


def unsynced_buffers_warning(names: list[str], stage: int | None = None) -> str:
    """The warning of a fault-tolerant run whose model has the floating persistent buffers
    ``names``, which no replica shares with another (see the module docstring); ``stage``:
    the pipeline stage that holds them (None without pipeline parallelism)."""
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    held = f" (pipeline stage {stage})" if stage is not None else ""
    return (f"dist.fault_tolerance = 'torchft' (--ft): the model's floating persistent "
            f"buffers{held} ({shown}) are not synced across replica groups: each group keeps its "
            f"own (a healed group too), so the global model evaluates differently on every "
            f"replica; without --ft they are averaged at every sync (see "
            f"docs/fault_tolerance.md)")


class BufferSync:
    """Averages a model's floating persistent buffers over the replicas and gives them every
    other persistent buffer of replica 0 (see the module docstring).

    A sync marks the buffers due (:meth:`mark_due`) and the engine syncs them at the next
    step boundary (:meth:`sync_if_due`): a layer-wise round closes inside the forward,
    where autograd has saved BatchNorm's running statistics for the backward (writing
    them there fails the backward), and the rest of that forward changes them again.

    Args:
        model: the module whose buffers are synced (the engine's, DDP unwrapped).
        comm: the engine's communication path (its sync group spans the replicas).
        replica: this rank's replica index.
        enabled: False in the fault-tolerant mode, whose replicas come and go between
            rounds: there each replica keeps its own buffers, and the first rank of each
            pipeline stage in replica 0 (:func:`warns_for_its_stage`) warns once
            (:func:`unsynced_buffers_warning`) if its model has floating persistent
            buffers.
        topo: the job's topology (which stage this rank's ``model`` is; default: one
            replica without pipeline stages, whose rank 0 warns).
    """

    def __init__(self, model: nn.Module, comm: CommPath, replica: int,
                 enabled: bool = True, topo: Topology | None = None) -> None:
        self.model = model
        self.comm = comm
        self.replica = replica
        self.names = persistent_buffer_names(model) if enabled else []
        """The buffers synced (looked up by name at every sync: a module may replace one)."""
        self.left_alone = [] if enabled else _floating(model, persistent_buffer_names(model))
        """The floating persistent buffers each replica keeps for itself (the
        fault-tolerant mode)."""
        # Once per stage: each stage's model holds the buffers of its own layers only.
        rank = dist.get_rank()
        world = dist.get_world_size()
        topo = topo or Topology(world_size=world, shard_size=world)
        if self.left_alone and warns_for_its_stage(topo, rank, replica):
            stage = topo.stage_of(rank) if topo.pp_size > 1 else None
            log.warning("%s", unsynced_buffers_warning(self.left_alone, stage))
        self.due = False
        """Whether a sync was applied since the buffers were last synced."""

    def mark_due(self, stats: CommStats | None = None) -> None:
        """A round was applied (or the run ends in lock-step): sync at the next boundary."""
        self.due = True

    def sync_if_due(self) -> None:
        """At a step boundary (every rank at the same one): :meth:`sync` if due."""
        if self.due:
            self.due = False
            self.sync()

    def sync(self, stats: CommStats | None = None) -> None:
        """Make every replica's persistent buffers equal; a collective of the sync group, on
        the communication thread (behind every job queued before it). Sends nothing
        without persistent buffers or with one replica."""
        if not self.names or self.comm.sync_size == 1:
            return
        self.comm.run(self._sync_now, stats=stats, cause="consensus")

    def _sync_now(self) -> None:
        buffers = dict(self.model.named_buffers())
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for name in self.names:
            b = buffers.get(name)
            if b is not None and b.numel():
                by_dtype.setdefault(b.dtype, []).append(b)
        for dtype, group in by_dtype.items():
            self._reduce(group, mean=dtype.is_floating_point or dtype.is_complex)

    def _reduce(self, group: list[torch.Tensor], mean: bool) -> None:
        """Buffers of one dtype: replica 0's (an all-reduce where the others send zeros),
        or, ``mean``, the mean over the replicas where they differ (see :meth:`_mean`)."""
        flat = torch.cat([b.detach().reshape(-1) for b in group])
        if flat.dtype == torch.bool:
            flat = flat.to(torch.uint8)  # collectives sum numbers, not truth values
        if mean:
            flat = self._mean(flat)
        else:
            if self.replica != 0:
                flat.zero_()
            self.comm.all_reduce_sync(flat)
        offset = 0
        with torch.no_grad():
            for b in group:
                b.copy_(flat[offset:offset + b.numel()].view_as(b))
                offset += b.numel()

    def _mean(self, flat: torch.Tensor) -> torch.Tensor:
        """The replicas' mean of ``flat`` where they hold different values, replica 0's
        (everyone's) where they hold the same: a buffer the replicas agree on (a constant,
        statistics of a layer no replica trained) stays bitwise what it was, where the sum
        of R equal values divided by R is not (0.123456789 in float32 over 3 replicas:
        one ulp off, and again at every sync). Two all-reduces: the sum beside replica 0's values,
        then whether any replica differs from them."""
        n = flat.numel()
        both = torch.cat([flat, flat if self.replica == 0 else torch.zeros_like(flat)])
        self.comm.all_reduce_sync(both)
        total, first = both[:n], both[n:]
        differs = (flat != first).to(flat.dtype)  # a NaN differs: the mean, NaN everywhere
        self.comm.all_reduce_sync(differs)
        return torch.where(differs != 0, total / self.comm.sync_size, first)


def _floating(model: nn.Module, names: list[str]) -> list[str]:
    """Those of the buffers ``names`` that hold floating-point (or complex) values."""
    buffers = dict(model.named_buffers())
    return [n for n in names if buffers[n].dtype.is_floating_point or buffers[n].dtype.is_complex]
