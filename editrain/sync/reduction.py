"""One reduction of a unit across replicas, used by every schedule and the fault-tolerant path.

A round's statistics job computes every replica's pseudo-gradient norms for the round's
units and the penalty's weights from them (docs/algorithm.md sections 3-5); each unit job
then reduces one unit's pseudo-gradient over the sync group (weighted mean, GTA or a
quantised gather), clips it and applies the outer step (sections 2 and 6). The jobs run on
the communication thread (:mod:`editrain.sync.comm`).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from torch.autograd.profiler import record_function

from editrain.sync import quant
from editrain.sync.comm import CommPath
from editrain.sync.config import SyncConfig
from editrain.sync.outer import SyncUnit, local_view
from editrain.sync.penalty import DetectorBank, clip_coefficient, compute_weights, finite_mask
from editrain.sync.reducers import build_reducer
from editrain.sync.round import SyncRound, by_replica
from editrain.topology import Topology


class Reduction:
    """The arithmetic of a sync on this rank: statistics, weights, reductions, outer steps.

    Args:
        units: the engine's units.
        comm: the communication path (every method here runs on its thread).
        config: the resolved sync configuration.
        topo: the mesh's topology.
        rank: this rank (seeds GTA's random draws, with ``seed``).
        replica / num_replicas: this replica's id and the replica count (the
            fault-tolerant mode: over the whole job, not the local mesh).
        seed: seeds GTA's random sparsification (with the round, the unit and the rank).
    """

    def __init__(self, units: list[SyncUnit], comm: CommPath, config: SyncConfig,
                 topo: Topology, rank: int, replica: int, num_replicas: int,
                 seed: int = 0) -> None:
        cfg = config
        self.units = units
        self.comm = comm
        self.config = cfg
        self.topo = topo
        self.rank = rank
        self.replica = replica
        self.num_replicas = num_replicas
        self.seed = seed
        self.device = next((u.device for u in units if u.params), units[0].device)
        self.reducer = build_reducer(cfg.gta.reducer, **_gta_kwargs(cfg))
        self.detectors = (
            DetectorBank(len(units), num_replicas, cfg.ewma_alpha, cfg.ewma_warmup_steps,
                         cfg.ewma_threshold)
            if cfg.skip_anomaly else None
        )

    @torch.no_grad()
    def grad_allreduce(self) -> None:
        """Warm-up and the synchronous method: average every gradient over the sync group
        (comm thread).

        A parameter without a gradient on a replica (frozen, or unused in this step's
        forward) counts as a zero gradient there, as DistributedDataParallel counts it; one
        without a gradient on *every* replica keeps ``grad`` None, so the optimizer skips
        it as it would without replicas (a zero gradient would let AdamW's weight decay
        and momentum move a frozen or unused parameter). Whether each parameter has a
        gradient travels with the unit's gradients: one more element per parameter."""
        for unit in self.units:
            if not unit.params:
                continue
            grads = [local_view(p.grad) if p.grad is not None
                     else torch.zeros_like(local_view(p)) for p in unit.params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            piece = unit.own_part(flat)  # full copies: this rank's slice, then all-gathered
            has = torch.tensor([p.grad is not None for p in unit.params],
                               dtype=flat.dtype, device=flat.device)
            wire = torch.cat([piece, has])
            self.comm.all_reduce_sync(wire)
            piece, with_grad = wire[:piece.numel()], wire[piece.numel():].tolist()
            piece.div_(self.num_replicas)
            flat = unit.assemble(piece)
            offset = 0
            for p, g, n, count in zip(unit.params, grads, unit.numels, with_grad):
                if count > 0:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                        g = local_view(p.grad)
                    g.copy_(flat[offset:offset + n].view_as(g))
                offset += n

    def pseudo_grad(self, rnd: SyncRound, u: int) -> torch.Tensor:
        """Unit ``u``'s pseudo-gradient in ``rnd`` (a delayed round: from its launch snapshot)."""
        unit = self.units[u]
        if rnd.delayed and unit.eager_replicas:
            assert unit.launch is not None
            return unit.launch  # the eager merge keeps D itself (the anchor moved on)
        return unit.pseudo_grad(unit.launch if rnd.delayed else None)

    def _loss_share(self, rnd: SyncRound) -> list[torch.Tensor]:
        """This rank's share of its replica's mean loss, as the last statistic: summed over
        the replica's ranks (tp peers hold the same loss) it gives the replica's mean."""
        if rnd.loss is None:
            return []
        return [rnd.loss.to(self.device) / self.comm.shard_size]

    def _take_losses(self, rnd: SyncRound, gathered: torch.Tensor) -> torch.Tensor:
        """Split the gathered statistics' last column off into ``rnd.replica_loss``."""
        if rnd.loss is None:
            return gathered
        losses = gathered[:, -1:]
        if rnd.members is not None:
            losses = by_replica(losses, rnd, self.num_replicas)
        rnd.replica_loss = [v if math.isfinite(v) else None for v in losses[:, 0].tolist()]
        return gathered[:, :-1]

    @torch.no_grad()
    def replica_losses(self, rnd: SyncRound) -> None:
        """A method without statistics: only every replica's mean training loss (one shard
        all-reduce and one sync all-gather of a float64)."""
        if rnd.skipped:
            return
        t0 = time.perf_counter()
        share = torch.stack(self._loss_share(rnd))
        self.comm.all_reduce_shard(share)
        self._take_losses(rnd, self.comm.all_gather_sync(share).cpu())
        rnd.work_s += time.perf_counter() - t0

    @torch.no_grad()
    def statistics(self, rnd: SyncRound) -> None:
        """Batched statistics of the round's units (and the replicas' losses, when
        recorded): one shard all-reduce, one sync all-gather."""
        t0 = time.perf_counter()
        cfg = self.config
        if rnd.skipped:
            return
        with record_function("editrain::sync::stats"):
            sq = torch.stack([
                self.units[u].square_sum(self.pseudo_grad(rnd, u)) if self.units[u].numel
                else torch.zeros((), dtype=torch.float64, device=self.device)
                for u in rnd.units
            ] + self._loss_share(rnd))
            self.comm.all_reduce_shard(sq)
            gathered = self._take_losses(rnd, self.comm.all_gather_sync(sq).cpu())
            norms = gathered.sqrt()  # [R, units of the round]
            if rnd.members is not None:
                norms = by_replica(norms, rnd, self.num_replicas)
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
    def unit_job(self, rnd: SyncRound, i: int) -> None:
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
        eager = bool(unit.eager_replicas)
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
                    elif eager and rnd.delayed:
                        unit.incoming = None  # I = 0: the merge takes the own share back
                    elif eager:
                        unit.eager_end(None)  # the end: G as it is, every replica on it
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
            delta = self.pseudo_grad(rnd, u)
            if rnd.delayed and eager:
                delta = delta.clone()  # D stays for the merge
            elif rnd.delayed and self.config.merge != "keep_local":
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
            if eager and rnd.delayed:
                unit.incoming = reduced  # I: enters the outer step at the merge (3c)
                return
            if eager:
                unit.eager_end(reduced)  # a blocking round (the end): G with I, theta <- G
                return
            unit.outer_step(reduced)
            if not rnd.delayed:
                unit.write_back()

    def _reduce(self, rnd: SyncRound, u: int, delta: torch.Tensor, weight: float,
                weights: list[float], error: torch.Tensor | None, *tag: int) -> torch.Tensor:
        """The cross-replica reduction of one pseudo-gradient vector: the reducer (plain
        or GTA; random draws seeded by the engine's seed, the round, the unit and ``tag``;
        a sparsifying GTA gathers compact messages and needs ``weights``, every replica's
        in the order of the sync group's collectives) or, with a quantised ``comm_dtype``,
        :meth:`_quantised_reduce`."""
        rnd.values += delta.numel()  # the round's compression: bytes sent per fp32 byte
        if self.config.comm_dtype != "fp32":
            return self._quantised_reduce(rnd, delta, weight, weights, error)
        gen = None
        if self.config.gta.sparsification_method in ("random", "rescaled_random"):
            gen = torch.Generator(device=delta.device)
            gen.manual_seed(_mix(self.seed, rnd.index, u, *tag))
        return self.reducer.reduce(delta, weight, self.comm.all_reduce_sync, generator=gen,
                                   weights=weights, all_gather=self.comm.all_gather_sync)

    def _quantised_reduce(self, rnd: SyncRound, delta: torch.Tensor, weight: float,
                          weights: list[float], error: torch.Tensor | None) -> torch.Tensor:
        """Gather every replica's quantised (or sparse) ``delta + decay * error``, sum the
        decoded values weighted, in fp32, in replica order (``docs/streaming.md`` sections
        4 and 4b). ``error`` (this replica's residual, if kept) is updated in place; the
        round's compression is counted by :meth:`_reduce`."""
        cfg = self.config
        dtype, chunk, k = cfg.comm_dtype, cfg.sparse_chunk, cfg.sparse_k
        if weight == 0.0:
            message, _ = quant.encode(delta, dtype, chunk, k)  # delta was zeroed: Q(0)
        else:
            if error is None:
                x = delta
            elif cfg.ef_decay == 1.0:
                x = delta + error.to(delta.device)
            else:
                x = delta + error.to(delta.device) * cfg.ef_decay
            message, decoded = quant.encode(x, dtype, chunk, k)
            if error is not None:
                error.copy_((x - decoded).to(error.device))
        gathered = self.comm.all_gather_sync(message)
        out = torch.zeros_like(delta)
        for r, w in enumerate(weights):
            out.add_(quant.decode(gathered[r], delta.numel(), dtype, chunk, k).mul_(w))
        return out


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
