"""Pipeline stages in the job model.

Which units each stage holds, the schedule's bubble, the activations that cross the
stages, the stages' memory and their cross-replica links.

A replica of ``pp`` stages is ``pp x shard_size x tp`` GPUs (training's ``dist.pp_size``,
:mod:`editrain.pipeline`). Each stage holds contiguous runs of blocks split as the trainer
splits them (:func:`stage_blocks`; interleaved 1F1B: ``pp x V`` chunks, rank ``r`` holding
chunks ``r, r + pp, ...``), the embeddings on the first rank, the final norm and the output
on the last. ``docs/planning.md`` (section Pipeline stages) writes the model down; in short:

* Compute: rank ``r`` computes its units' share of the step's FLOPs on its ``shard_size x
  tp`` GPUs (``T_r``, with its own FSDP2 and tp collectives); ``M`` microbatches of
  ``T_r / M`` each through the schedule take ``max T + (sum T - max T) / (V M)``
  (:func:`pipelined_step_s`): ``(M + pp - 1)`` microbatch times for GPipe and 1F1B with
  balanced stages, a bubble of ``(pp - 1) / (V M + pp - 1)`` of the step
  (:func:`bubble_fraction`), ``V`` times smaller interleaved.
* Activations: one microbatch's residual stream crosses each boundary forward and its
  gradient backward (:func:`transfer_s`); the pipeline's fill and drain wait for them, the
  steady state hides them behind the compute unless the link is slower.
* Memory: the busiest rank's units, and the microbatches its schedule keeps in flight
  (:func:`in_flight`).
* Sync: each stage syncs its own units with the same stage of the other replicas (the
  engine's sync group is per position in the replica), in parallel with the other stages;
  stages on one node share its link (:func:`link_groups`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from editrain.errors import ConfigError
from editrain.plan.inputs import GBIT, Cluster, MethodSpec, ModelSpec

# Shapes, layouts and rounds are editrain.plan.model's (Shape, Layout, Round), which
# imports this module: they are built here with dataclasses.replace.


def stage_blocks(layers: int, pp: int, stages_per_rank: int = 1) -> list[list[int]]:
    """The blocks each pipeline rank holds, as training splits them
    (:func:`editrain.pipeline.stage_layers`, which imports torch): ``pp x stages_per_rank``
    contiguous chunks, as even as possible with the earlier chunks one block longer, rank
    ``r`` holding chunks ``r, r + pp, ...`` in forward order.

    Args:
        layers: the model's blocks.
        pp: pipeline ranks.
        stages_per_rank: chunks per rank (interleaved 1F1B), 1 otherwise.
    """
    chunks = pp * stages_per_rank
    base, extra = divmod(layers, chunks)
    runs, start = [], 0
    for c in range(chunks):
        size = base + (1 if c < extra else 0)
        runs.append(list(range(start, start + size)))
        start += size
    return [[b for k in range(stages_per_rank) for b in runs[r + k * pp]] for r in range(pp)]


def stage_units(shape: Any, pp: int, stages_per_rank: int = 1) -> list[list[int]]:
    """Indices into ``shape.units`` of each rank's sync units, in the engine's order
    (root first): its blocks, ``tok_embeddings`` on the first rank, ``root`` (the final
    norm) and ``output`` on the last.

    Args:
        shape: the model's shape (untied: a tied model cannot be split into stages).
        pp: pipeline ranks.
        stages_per_rank: chunks per rank.
    """
    blocks = stage_blocks(shape.layers, pp, stages_per_rank)
    owner = {f"block{b}": r for r, held in enumerate(blocks) for b in held}
    owner.update(tok_embeddings=0, root=pp - 1, output=pp - 1)
    out: list[list[int]] = [[] for _ in range(pp)]
    for u, (name, _) in enumerate(shape.units):
        out[owner[name]].append(u)
    return out


def unit_flops_per_token(shape: Any, seq_len: int) -> list[float]:
    """Training FLOPs per token of each unit: 6 per matrix-product parameter, plus
    attention's ``12 dim seq_len`` for a block (the embedding lookup costs nothing). They
    sum to :meth:`Shape.flops_per_token` of an untied model."""
    out = []
    for name, n in shape.units:
        if name == "tok_embeddings":
            out.append(0.0)
        elif name.startswith("block"):
            out.append(6.0 * n + 12.0 * shape.dim * seq_len)
        else:
            out.append(6.0 * n)
    return out


def bubble_fraction(pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """The share of a balanced pipeline's step that a stage idles: ``(pp - 1) / (V M + pp
    - 1)`` for ``M`` microbatches (GPipe and 1F1B: ``V = 1``; interleaved 1F1B divides the
    idle time by its ``V`` chunks per rank). Relative to the ideal step the idle time is
    ``(pp - 1) / (V M)``.

    Args:
        pp: pipeline stages.
        microbatches: microbatches in one schedule (all of a step's).
        stages_per_rank: chunks per rank ``V``.
    """
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)


def pipelined_step_s(rank_s: list[float], microbatches: int, stages_per_rank: int = 1
                     ) -> float:
    """Seconds of one pipelined step whose ranks compute ``rank_s`` each (all ``M``
    microbatches): the slowest rank sets the pace of the steady state, and the first
    microbatch's forward and the last one's backward pass every other rank once
    (``V`` times faster interleaved): ``max T + (sum T - max T) / (V M)``. Equal ranks
    give ``T (V M + pp - 1) / (V M)``, the bubble of :func:`bubble_fraction`.

    Args:
        rank_s: each rank's compute seconds per step.
        microbatches: ``M``.
        stages_per_rank: ``V``.
    """
    slowest = max(rank_s)
    return slowest + (sum(rank_s) - slowest) / (stages_per_rank * microbatches)


def schedule_factor(shape: Any, spec: ModelSpec, pipe: Pipeline) -> float:
    """The pipelined step over the step with every GPU busy, from the schedule and the
    ranks' shares of the FLOPs alone (no transfers): ``pp (w_max + (1 - w_max) / (V M))``
    for the busiest rank's share ``w_max``; ``1 + (pp - 1) / (V M)`` with equal stages.
    Calibration divides a pipelined run's measured step by it."""
    flops = unit_flops_per_token(shape, spec.seq_len)
    total = sum(flops)
    rank_s = [pipe.pp * sum(flops[u] for u in units) / total for units in pipe.units]
    return pipelined_step_s(rank_s, pipe.microbatches, pipe.stages_per_rank)


def in_flight(schedule: str, pp: int, microbatches: int, stages_per_rank: int, rank: int
              ) -> float:
    """Microbatches whose activations rank ``rank`` holds at once (in its layers' worth):
    GPipe all ``M`` (every forward before any backward); 1F1B ``pp - rank`` (a rank starts
    backwards once the last stage has a loss); interleaved 1F1B ``pp - rank + (pp - 1) /
    V``, its longer warm-up (Korthikanti et al. 2022: the first stage holds ``1 + (pp - 1)
    / (pp V)`` times the layers' activations of ``pp`` microbatches); never more than
    ``M``."""
    if schedule == "gpipe":
        return float(microbatches)
    extra = (pp - 1) / stages_per_rank if schedule == "interleaved-1f1b" else 0.0
    return min(float(microbatches), pp - rank + extra)


@dataclass
class Pipeline:
    """A setting's pipeline, resolved against the model and the batch.

    Args:
        pp: stages (ranks) per replica.
        schedule: gpipe, 1f1b or interleaved-1f1b.
        stages_per_rank: chunks per rank ``V``.
        per_forward: microbatches each forward batch is split into (``pp_microbatches``).
        accumulation: forward batches per step (the trainer runs them in one schedule).
        sequences: sequences per pipeline microbatch.
        units: each rank's unit indices (:func:`stage_units`).
        blocks: each rank's blocks (:func:`stage_blocks`).
    """

    pp: int
    schedule: str
    stages_per_rank: int
    per_forward: int
    accumulation: int
    sequences: int
    units: list[list[int]]
    blocks: list[list[int]]

    @property
    def microbatches(self) -> int:
        """Microbatches in one step's schedule ``M``: every accumulation step's."""
        return self.per_forward * self.accumulation


def check_pipeline(shape: Any, spec: ModelSpec, method: MethodSpec, lay: Any
                   ) -> Pipeline:
    """The pipeline of ``method`` for this model and batch, checked as training checks
    ``dist.pp_size`` (:func:`editrain.config.validation._check_pipeline`): untied
    embeddings, at least one block per chunk, a batch every shard's pipeline takes whole,
    microbatches that divide the forward batch and that interleaved 1F1B can split into
    its rounds, fragments that every stage has units for.

    Raises:
        ConfigError: naming the option and what is allowed.
    """
    pp, v = lay.pp, method.pp_stages_per_rank
    if shape.tied:
        raise ConfigError(f"method.pp: {pp} stages need untied embeddings (the first and "
                          "last stage would share the embedding matrix); set "
                          "model.tie_embeddings = false or plan pp = 1")
    if pp * v > shape.layers:
        raise ConfigError(f"method.pp: pp x pp_stages_per_rank ({pp} x {v}) must be at most "
                          f"the model's layers ({shape.layers}): every chunk holds a block")
    per_shard, left = divmod(spec.batch_size, lay.shard_size)
    if left or not per_shard:
        raise ConfigError(f"model.batch_size: {spec.batch_size} sequences do not split "
                          f"evenly over the {lay.shard_size} shards of a pipeline stage "
                          "(every shard's pipeline takes the same batch): use a multiple "
                          f"of {lay.shard_size}")
    forward = spec.micro_batch or per_shard
    if per_shard % forward:
        raise ConfigError(f"model.micro_batch: must divide the {per_shard} sequences each "
                          f"shard's pipeline takes per step (training's train.batch_size x "
                          f"gradient_accumulation_steps), got {forward}")
    m = method.microbatches
    if forward % m:
        what = (f"pp_microbatches = {m}" if method.pp_microbatches
                else f"pp_microbatches = 0 means pp ({m}) microbatches, which")
        raise ConfigError(f"method.pp_microbatches: {what} must divide the {forward} "
                          "sequences of a GPU's forward (model.micro_batch; training's "
                          "train.batch_size): every microbatch has as many sequences")
    accumulation = per_shard // forward
    total = m * accumulation
    rounds = max(1, total // pp)
    if method.pp_schedule == "interleaved-1f1b" and total % rounds:
        raise ConfigError(f"method.pp_microbatches: interleaved-1f1b needs a step's "
                          f"microbatches ({m} x {accumulation} accumulation steps = {total})"
                          f" to be a multiple of its rounds, max(1, {total} // pp) = "
                          f"{rounds}")
    units = stage_units(shape, pp, v)
    fewest = min(len(u) for u in units)
    if method.fragments > fewest:
        raise ConfigError(f"method.fragments: {method.fragments} is more than the {fewest} "
                          "sync units of the smallest pipeline stage (each stage splits "
                          "its own units into the fragments)")
    return Pipeline(pp, method.pp_schedule, v, m, accumulation, forward // m, units,
                    stage_blocks(shape.layers, pp, v))


def transfer_s(cluster: Cluster, lay: Any, nbytes: float) -> float:
    """Seconds one microbatch's activation (or its gradient) of ``nbytes`` takes across a
    stage boundary: on the intra-node link (per GPU) when the replica fits in a node (its
    stages share the node), else on the node's inter-node link, shared by the node's
    ranks of a stage that send at once (``min(shard_size x tp, gpus_per_node)``)."""
    if lay.gpus_per_replica <= cluster.gpus_per_node:
        return (cluster.intra_node_latency_us * 1e-6
                + nbytes / (cluster.intra_node_gbps * GBIT))
    share = min(lay.stage_gpus, cluster.gpus_per_node)
    return cluster.inter_latency_s + share * nbytes / cluster.inter_bytes_per_s


@dataclass
class PipelineStep:
    """What a pipelined step costs (seconds per step of one replica).

    Args:
        step_s: the pipelined step: compute, bubble and exposed transfers.
        rank_s: each rank's compute.
        bubble_s: the mean rank's idle time in the schedule (fill, drain, imbalance).
        transfer_s: the activations' transfers that nothing hides.
        fwd_s: forward seconds per unit of the first microbatch (model order).
        link_bound: the transfers of the steady state take longer than the compute.
    """

    step_s: float
    rank_s: list[float]
    bubble_s: float
    transfer_s: float
    fwd_s: list[float]
    link_bound: bool = False


def link_groups(cluster: Cluster, lay: Any) -> list[list[int]]:
    """The pipeline ranks whose cross-replica rounds share one node's link: all of them
    when a replica fits in a node, one per stage when a stage fills a node or more, else
    the stages on one node (ranks are placed stage after stage)."""
    per_node = max(1, cluster.gpus_per_node // lay.stage_gpus)
    return [list(range(s, min(s + per_node, lay.pp))) for s in range(0, lay.pp, per_node)]


def merge_rounds(stage_rounds: list[list[Any]]) -> list[Any]:
    """The rounds of stages that share a link: fragment by fragment, their jobs taken in
    turn (each stage's communication thread launches its round at the same boundary, and
    the link's FIFO serves them as they come)."""
    merged = []
    for per_stage in zip(*stage_rounds):
        jobs = []
        longest = max(len(r.jobs) for r in per_stage)
        for i in range(longest):
            jobs += [r.jobs[i] for r in per_stage if i < len(r.jobs)]
        merged.append(dataclasses.replace(per_stage[0], jobs=jobs))
    return merged


def stage_shape(shape: Any, units: list[int], blocks: int) -> Any:
    """The :class:`~editrain.plan.model.Shape` of one rank's ``units`` and ``blocks``
    blocks (its compute, memory and rounds), its forward shares those of the whole model
    renormalised."""
    total = sum(shape.fwd_share[u] for u in units) or 1.0
    return dataclasses.replace(shape, units=[shape.units[u] for u in units],
                               fwd_share=[shape.fwd_share[u] / total for u in units],
                               layers=blocks)


def to_global(rounds: list[Any], units: list[int]) -> list[Any]:
    """``rounds`` of one stage with its units' indices in the whole model (unit-less jobs,
    -1, kept)."""
    return [dataclasses.replace(r, jobs=[(units[u] if u >= 0 else u, s) for u, s in r.jobs])
            for r in rounds]


__all__ = ["Pipeline", "PipelineStep", "bubble_fraction", "check_pipeline", "in_flight",
           "link_groups", "merge_rounds", "pipelined_step_s", "schedule_factor",
           "stage_blocks", "stage_shape", "stage_units", "to_global", "transfer_s",
           "unit_flops_per_token"]
