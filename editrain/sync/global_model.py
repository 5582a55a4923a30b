"""The global model across the engine's units: its creation, the consensus check, its view.

The *global model* is what every replica agrees on: the units' anchors (with the eager
merge, each unit's global anchor ``G``). This module holds what the engine does with all
of them at once, so that :class:`editrain.sync.edit.SyncEngine` only decides when:

- :meth:`GlobalModel.create` checks that every replica starts the local phase from the same
  parameters (a checksum per unit, compared across replicas) and takes the anchors;
- :meth:`GlobalModel.swapped_in` puts the global model into the live parameters for the
  length of a block (evaluating a streaming run) and restores them exactly;
- :meth:`GlobalModel.peer_units` / :meth:`GlobalModel.adopt` are the units' share of the
  global state a healing replica receives (the fault-tolerant mode);
- :meth:`GlobalModel.write_back` restarts every replica from the anchors (an elastic resume).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from editrain.sync.comm import CommPath
from editrain.sync.outer import SyncUnit
from editrain.sync.setup import reshard
from editrain.topology import Topology


class GlobalModel:
    """The units' anchors taken as one model.

    Args:
        units: the engine's units, in forward order.
        model: the root module (resharded around a swap, so no gathered copy goes stale).
        comm: the engine's communication path (the consensus check's collectives).
        device: where the units' parameters live.
        topo: the job's topology (whether there are pipeline stages to agree with).
    """

    def __init__(self, units: Sequence[SyncUnit], model: nn.Module, comm: CommPath,
                 device: torch.device, topo: Topology) -> None:
        self.units = list(units)
        self.model = model
        self.comm = comm
        self.device = device
        self.topo = topo

    @property
    def exists(self) -> bool:
        """Whether the anchors exist (the local phase has begun)."""
        return any(u.anchor is not None for u in self.units)

    def create(self) -> None:
        """Take every unit's anchor from its live parameters, once the replicas are known
        to hold the same model (:meth:`check_replicas_agree`)."""
        self.check_replicas_agree()
        for unit in self.units:
            unit.create_anchor()

    @torch.no_grad()
    def check_replicas_agree(self) -> None:
        """The local phase must start from one model on every replica (the anchors are
        taken from each replica's own parameters): compare a checksum of every unit's
        shard (sum and sum of squares, float64) across replicas, agreed over the replica's
        ranks (every pipeline stage), and fail on every rank alike if they differ (e.g.
        different seeds)."""
        comm = self.comm
        if comm.sync_size == 1:
            return  # (the fault-tolerant mode: a joining replica heals instead)
        sums = torch.zeros(len(self.units), 2, dtype=torch.float64, device=self.device)
        for i, unit in enumerate(self.units):
            if unit.numel:
                flat = unit.flat_params().double()
                sums[i, 0], sums[i, 1] = flat.sum(), flat.square().sum()
        got = comm.run(comm.all_gather_sync, sums, cause="control").cpu()
        scale = got[0].abs().clamp_min(1e-12)
        differs = ((got - got[0]).abs() > 1e-6 * scale).any(dim=2).any(dim=0)  # [units]
        agreed = differs.to(torch.float64).to(self.device)
        comm.run(comm.all_reduce_shard, agreed, dist.ReduceOp.MAX)
        bad = [self.units[i].name for i, d in enumerate(agreed.tolist()) if d]
        if self.topo.pp_size > 1:
            # Another stage's units may differ: every stage of the replica fails alike
            # (a stage that went on alone would hang in the pipeline).
            verdict = torch.tensor([float(bool(bad))], dtype=torch.float64,
                                   device=self.device)
            comm.run(comm.all_reduce_replica, verdict, dist.ReduceOp.MAX)
            if float(verdict) and not bad:
                bad = ["of another pipeline stage"]
        if bad:
            raise RuntimeError(
                f"replicas start the local phase from different parameters (units "
                f"{', '.join(bad)}): every replica must hold the same model when local SGD "
                f"begins; initialise every replica with the same seed or load the same "
                f"checkpoint")

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Inside the block the live parameters are the global model (the anchors; with the
        eager merge every unit's ``G`` with its round in flight merged as sent, computed
        alike on every replica, so nothing is sent); afterwards they are exactly what they
        were. The caller completes or waits for the rounds in flight first."""
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

    @torch.no_grad()
    def write_back(self) -> None:
        """Every unit that has an anchor restarts from it (an elastic resume)."""
        for unit in self.units:
            if unit.anchor is not None:
                unit.write_back()

    @torch.no_grad()
    def end_on_global(self, units: Iterable[int]) -> None:
        """The eager merge's end for ``units`` that trained nothing since their last
        launch (that round merged): every replica takes ``G`` as it is, with its outer
        state, and ``C <- 0``; no round, no byte (docs/streaming.md section 3c)."""
        for u in units:
            self.units[u].eager_end(None)

    def peer_units(self) -> list[dict[str, Any]]:
        """The units' share of the global state (anchors, outer optimizer state) as CPU
        copies, for a replica that heals (the sender trains on while the receiver reads).
        Replica-own entries (error feedback, launch snapshots) stay here."""
        return [{k: (v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v)
                 for k, v in unit.state_dict().items() if not k.startswith("replica.")}
                for unit in self.units]

    @torch.no_grad()
    def adopt(self, unit_states: Sequence[Mapping[str, Any]]) -> None:
        """Take a healthy peer's :meth:`peer_units` and write the anchors into the live
        parameters (no local progress left)."""
        for unit, unit_sd in zip(self.units, unit_states):
            unit.load_state_dict(unit_sd)  # type: ignore[arg-type]
            unit.write_back()

    def extra_memory(self) -> dict[str, int]:
        """Bytes of anchors + outer state (+ error feedback) on this rank, by device type."""
        total: dict[str, int] = {}
        for unit in self.units:
            for k, v in unit.extra_bytes().items():
                total[k] = total.get(k, 0) + v
        return total

    @torch.no_grad()
    def scale_pseudo_gradients(self, factor: float, units: Sequence[int] | None) -> None:
        """Fault injection: ``anchor - factor * (anchor - theta)`` into the live parameters
        of ``units`` (default: all) that have an anchor."""
        for u in range(len(self.units)) if units is None else units:
            unit = self.units[u]
            if unit.anchor is not None:
                unit.load_flat(unit.anchor.to(unit.device) - factor * unit.pseudo_grad())
