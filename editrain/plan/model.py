"""The job model: step time, exposed communication, bytes and memory of one setting.

Everything here is arithmetic on the inputs of :mod:`editrain.plan.inputs` (no torch, no
training). ``docs/planning.md`` writes the model down with its assumptions and limits;
the pieces, bottom up:

* :class:`Shape`: the model's sync units (root, embeddings, blocks, output) with their
  parameter counts and their share of the forward's FLOPs.
* link costs: :func:`ring_allreduce_s` and :func:`allgather_s` (bandwidth and latency per
  message, the bytes a ring transmits), :func:`expected_max_stall_s` for random stalls.
* :func:`timeline`: one replica's clock over a few rounds of H steps, with the rounds'
  jobs queued FIFO on its node's link, merged after ``overlap`` steps (or in the next
  forward, unit by unit, for a layer-wise sync) and waited for when not done.
* :func:`predict`: the whole setting: layout (replicas x shards x tp), compute per step,
  replica-internal collectives, the communication thread's CPU cost of the rounds that
  run beside the compute (:func:`overlap_slowdown_s`), the cross-replica rounds,
  stragglers, memory per rank.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from editrain.errors import ConfigError, as_config_error
from editrain.paths import shown
from editrain.plan import pipeline
from editrain.plan.inputs import Cluster, MethodSpec, ModelSpec, training_section
from editrain.sync import codecs

GIB = 2**30
BLOCK = 128
"""Values per fp32 scale of the int8 / int4 / fp4 codecs (as in ``editrain.sync.quant``)."""
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
CODEC_BITS = {"fp32": 32, "bf16": 16, "int8": 8, "int4": 4, "fp4": 4}
CYCLES = 5
"""Rounds of H steps the timeline runs; the first is left out (the link starts idle)."""


# --------------------------------------------------------------------------- model shape
@dataclass
class Shape:
    """The model as the planner needs it.

    Args:
        units: ``(name, parameters)`` per sync unit, in sync order (root first).
        fwd_share: each unit's share of the forward's FLOPs (sums to 1).
        dim: model width.
        layers: transformer blocks.
        heads: attention heads.
        vocab: vocabulary size.
        tied: whether the output projection reuses the embedding (in the root unit).
    """

    units: list[tuple[str, int]]
    fwd_share: list[float]
    dim: int
    layers: int
    heads: int
    vocab: int
    tied: bool

    @property
    def params(self) -> int:
        """All parameters."""
        return sum(n for _, n in self.units)

    @property
    def matmul_params(self) -> int:
        """Parameters used in matrix products (all but an untied input embedding)."""
        emb = sum(n for name, n in self.units if name == "tok_embeddings")
        return self.params - emb

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per matmul parameter plus attention's
        ``12 * layers * dim * seq_len`` (forward and backward, no causal halving)."""
        return 6.0 * self.matmul_params + 12.0 * self.layers * self.dim * seq_len


def _block_params(dim: int, heads: int, kv_heads: int, ffn: int, head_dim: int) -> int:
    attn = 2 * dim * heads * head_dim + 2 * dim * kv_heads * head_dim
    return attn + 3 * dim * ffn + 2 * dim


def _llama_shape(dim: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int,
                 tied: bool, head_dim: int | None = None) -> Shape:
    block = _block_params(dim, heads, kv_heads, ffn, head_dim or dim // heads)
    emb = vocab * dim
    units: list[tuple[str, int]] = [("root", dim + (emb if tied else 0))]
    if not tied:
        units.append(("tok_embeddings", emb))
    units += [(f"block{i}", block) for i in range(layers)]
    if not tied:
        units.append(("output", emb))
    # Forward FLOPs per token: 2 per matmul parameter; the output projection sits in the
    # root when tied, in `output` otherwise; the embedding lookup costs nothing.
    flops = {name: 2.0 * n for name, n in units}
    flops["root"] = 2.0 * emb if tied else 0.0
    if not tied:
        flops["tok_embeddings"] = 0.0
    total = sum(flops.values()) or 1.0
    return Shape(units, [flops[name] / total for name, _ in units], dim, layers, heads,
                 vocab, tied)


def llama_shape(mcfg: Any) -> Shape:
    """The :class:`Shape` of editrain's Llama of ``mcfg`` (a
    :class:`~editrain.models.LlamaConfig`): exactly its parameters."""
    return _llama_shape(mcfg.dim, mcfg.n_layers, mcfg.n_heads, mcfg.n_kv_heads,
                        mcfg.ffn_hidden, mcfg.vocab_size, mcfg.tie_embeddings, mcfg.head_dim)


def model_shape(spec: ModelSpec) -> Shape:
    """The :class:`Shape` of a model spec: the model ``editrain train`` builds from the
    same options (a preset with its overrides, a ``model.hf_config`` file, a
    ``model.init_from`` directory; read with training's own functions,
    :mod:`editrain.config.model`), or one made of counts (``params`` and ``layers``).

    Args:
        spec: the model.

    Raises:
        ConfigError: an unreadable Hugging Face config, naming the option.
    """
    if spec.params is not None:
        return _counted_shape(spec)
    from editrain.config.model import (
        section_hf_option,
        section_hf_source,
        section_model_config,
    )

    section = training_section(spec)
    with as_config_error():  # an init_from directory's config.json is read here
        source = section_hf_source(section)
    if source is None:  # editrain's Llama: a preset, or a Llama init_from directory
        return llama_shape(section_model_config(section, spec.vocab_size))
    return _hf_shape(source, section_hf_option(section))


HF_SHAPE_KEYS = ("hidden", "layers", "heads", "vocab")
"""What a Hugging Face config must say for the plan (:data:`editrain.models.hf_dir.HF_KEYS`
names each one's spellings)."""


def _hf_shape(source: str, option: str) -> Shape:
    """The shape of a model built through transformers from the ``config.json`` at
    ``source`` (read as training reads it, :func:`editrain.models.hf.read_hf_config`), as
    llama-like blocks: its vocabulary, width, heads, key/value heads, ``head_dim`` and
    ``intermediate_size`` (biases and other architectures' extras are not counted)."""
    from editrain.models.hf import read_hf_config
    from editrain.models.hf_dir import HF_KEYS, hf_int

    with as_config_error(FileNotFoundError):
        data = read_hf_config(source, option)
    missing = [HF_KEYS[k][0] for k in HF_SHAPE_KEYS if not hf_int(data, k)]
    ffn = data.get("intermediate_size")
    if not isinstance(ffn, int) or isinstance(ffn, bool) or ffn <= 0:
        missing.append("intermediate_size")
    if missing:
        raise ConfigError(f"{option}: {shown(source)} gives no positive {missing[0]}; the plan "
                          "reads a llama-like config.json (hidden_size, num_hidden_layers, "
                          "num_attention_heads, intermediate_size, vocab_size)")
    dim, heads = hf_int(data, "hidden"), hf_int(data, "heads")
    head_dim = data.get("head_dim")
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0:
        head_dim = dim // heads
    return _llama_shape(dim, hf_int(data, "layers"), heads, hf_int(data, "kv_heads") or heads,
                        ffn, hf_int(data, "vocab"), data.get("tie_word_embeddings") is True,
                        head_dim)


def _counted_shape(spec: ModelSpec) -> Shape:
    """A model made of counts: ``params`` split evenly over ``layers`` blocks beside the
    embeddings."""
    assert spec.params is not None and spec.layers is not None  # checked by ModelSpec
    layers = spec.layers
    dim = spec.dim or max(64, int(round(math.sqrt(spec.params / (12.0 * layers)) / 64) * 64))
    vocab = spec.vocab_size or 0
    emb = vocab * dim
    block = int((spec.params - 2 * emb - dim) / layers)
    if block <= 0:
        raise ConfigError(f"model.params: {spec.params:g} leaves nothing for the blocks "
                          f"after two {vocab} x {dim} embeddings")
    units: list[tuple[str, int]] = [("root", dim)]
    shares = [0.0]
    if emb:
        units.append(("tok_embeddings", emb))
        shares.append(0.0)
    units += [(f"block{i}", block) for i in range(layers)]
    shares += [float(block)] * layers
    if emb:
        units.append(("output", emb))
        shares.append(float(emb))
    total = sum(shares)
    return Shape(units, [s / total for s in shares], dim, layers,
                 spec.heads or max(1, dim // 128), vocab, False)


# --------------------------------------------------------------------------- link costs
def ring_allreduce_s(nbytes: float, ranks: int, bytes_per_s: float, latency_s: float,
                     per: str = "hop") -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``ranks`` members.

    Each member transmits ``2 (ranks - 1) / ranks * nbytes`` in ``2 (ranks - 1)`` steps;
    ``per = "collective"`` charges the latency once instead of per step.

    Args:
        nbytes: bytes of the reduced buffer.
        ranks: members of the ring.
        bytes_per_s: bandwidth of a member's link.
        latency_s: latency of one message.
        per: ``hop`` or ``collective``.
    """
    if ranks <= 1:
        return 0.0
    hops = 2 * (ranks - 1) if per == "hop" else 1
    return hops * latency_s + 2.0 * (ranks - 1) / ranks * nbytes / bytes_per_s


def allgather_s(nbytes_each: float, ranks: int, bytes_per_s: float, latency_s: float,
                per: str = "hop") -> float:
    """Seconds of a ring all-gather where every member contributes ``nbytes_each``:
    ``(ranks - 1)`` steps, ``(ranks - 1) * nbytes_each`` transmitted per member.

    Args:
        nbytes_each: bytes each member contributes.
        ranks: members.
        bytes_per_s: bandwidth of a member's link.
        latency_s: latency of one message.
        per: ``hop`` or ``collective``.
    """
    if ranks <= 1:
        return 0.0
    hops = ranks - 1 if per == "hop" else 1
    return hops * latency_s + (ranks - 1) * nbytes_each / bytes_per_s


def payload_bytes(n: float, codec: str) -> float:
    """Bytes of ``n`` values on the wire: fp32 4, bf16 2, int8 1, int4 and fp4 1/2 per
    value, plus one fp32 scale per :data:`BLOCK` values for the integer / fp4 codecs; the
    sparse codecs (topk2, topk1) at their default chunk and k, as
    :func:`editrain.sync.sparse.payload_bytes` counts them."""
    if codec in codecs.BITS:
        # The codec imports torch: not at import time, since every command imports this
        # package to build `editrain plan`'s parser (and editrain data imports no torch).
        from editrain.sync import sparse

        return float(sparse.payload_bytes(int(math.ceil(n)), codec))
    if codec in ("fp32", "bf16"):
        return n * CODEC_BITS[codec] / 8
    return math.ceil(n * CODEC_BITS[codec] / 8) + 4.0 * math.ceil(n / BLOCK)


def expected_max_stall_s(steps: int, replicas: int, prob: float, seconds: float) -> float:
    """Expected stall time of the most-stalled of ``replicas`` replicas over ``steps``
    steps, each step stalling with probability ``prob`` for ``seconds`` (independent):
    ``seconds * E[max of replicas Binomial(steps, prob)]``.

    Args:
        steps: steps in the window.
        replicas: replicas that wait for each other.
        prob: stall probability per step.
        seconds: seconds per stall.
    """
    if prob <= 0 or seconds <= 0 or steps <= 0:
        return 0.0
    return seconds * _expected_max_binomial(steps, replicas, prob)


@lru_cache(maxsize=4096)
def _expected_max_binomial(n: int, r: int, p: float) -> float:
    if p >= 1:
        return float(n)
    # E[max] = sum over k >= 0 of P(max > k) = sum (1 - F(k)^r); the pmf by recurrence
    # in logs (n can be thousands).
    total, cdf = 0.0, 0.0
    log_pmf = n * math.log1p(-p)
    ratio = math.log(p) - math.log1p(-p)
    for k in range(n):
        cdf = min(1.0, cdf + math.exp(log_pmf))
        total += 1.0 - cdf ** r
        if 1.0 - cdf ** r < 1e-12:
            break
        log_pmf += math.log(n - k) - math.log(k + 1) + ratio
    return total


# --------------------------------------------------------------------------- timeline
@dataclass
class Round:
    """One fragment's round: its jobs on the link and how it is merged.

    Args:
        fragment: the fragment index.
        offset: launched after inner steps ``k >= 1`` with ``k mod H == offset``.
        jobs: ``(unit index or -1 for a unit-less job, seconds on the link)`` in order.
    """

    fragment: int
    offset: int
    jobs: list[tuple[int, float]]


@dataclass
class Timeline:
    """What :func:`timeline` measured over the steady rounds."""

    wall_per_step_s: float
    wait_per_step_s: float
    link_busy_per_step_s: float
    rounds_in_flight_max: int


def timeline(step_s: float, fwd_s: list[float], rounds: list[Round], H: int, overlap: int,
             layerwise: bool, eager: bool = False, cycles: int = CYCLES) -> Timeline:
    """One replica's clock over ``cycles`` rounds of ``H`` steps (the first left out).

    Each step takes ``step_s``. After step ``k`` the rounds whose offset matches are
    launched: their jobs queue on the node's link behind every earlier job (FIFO; a job
    holds the link for its whole duration, latency included, as a rank's communication
    thread does). A round is merged ``overlap`` steps later (``eager``: ``H`` steps later,
    just before its next launch) at the step boundary, waiting for its last job; a
    layer-wise round is merged in the next forward instead: unit ``u``'s forward
    (``fwd_s[u]``) starts when its job is done. ``overlap = 0`` without layer-wise: the
    training thread waits at the launch (a blocking sync).

    Args:
        step_s: seconds per step without communication.
        fwd_s: forward seconds per unit (in sync order; their sum is the forward).
        rounds: the rounds, one per fragment.
        H: steps per round of each fragment.
        overlap: steps a round runs behind.
        layerwise: merge in the next forward, unit by unit.
        eager: a round may take a whole inner phase.
        cycles: rounds of H steps to run.

    Returns:
        Per-step averages over the steady cycles.
    """
    by_offset: dict[int, list[Round]] = {}
    for r in rounds:
        by_offset.setdefault(r.offset % H, []).append(r)
    delay = H if eager else overlap
    clock = link_free = waited = busy = 0.0
    boundary: dict[int, list[dict[int, float]]] = {}
    forward: dict[int, list[dict[int, float]]] = {}
    in_flight = peak = 0
    mark = (0.0, 0.0, 0.0)
    fwd_total = sum(fwd_s)
    # Only steps where something happens are visited; the others just add step_s.
    last = cycles * H
    events = {k for r in rounds for k in range(r.offset % H or H, last + 1, H)}
    events |= {k + delay + d for k in list(events) for d in (0, 1)}
    events = sorted(k for k in events | {H, last} if 1 <= k <= last)
    prev = 0
    for k in events:
        clock += (k - prev - 1) * step_s
        prev = k
        due = forward.pop(k, [])
        if due:
            arrival: dict[int, float] = {}
            for d in due:
                arrival.update(d)
            # The forward's end, from the step's start: summed unit by unit from 0 as
            # fwd_total is, so a round that arrived in time waits exactly 0 (from the
            # clock, the two sums rounded apart: +-1e-17 s waits, -2.9e-12 ms printed)
            t = max(0.0, arrival.get(-1, clock) - clock)
            for u, f in enumerate(fwd_s):
                if u in arrival:
                    t = max(t, arrival[u] - clock)
                t += f
            wait = t - fwd_total
            clock += wait
            waited += wait
            in_flight -= len(due)
        clock += step_s
        for done in boundary.pop(k, []):
            wait = max(0.0, max(done.values()) - clock)
            clock += wait
            waited += wait
            in_flight -= 1
        for r in by_offset.get(k % H, []):
            arrival = {}
            for unit, seconds in r.jobs:
                start = max(clock, link_free)
                link_free = start + seconds
                busy += seconds
                arrival[unit] = max(arrival.get(unit, 0.0), link_free)
            if not arrival:
                continue
            in_flight += 1
            peak = max(peak, in_flight)
            if not layerwise and delay == 0:  # blocking
                wait = max(arrival.values()) - clock
                clock += wait
                waited += wait
                in_flight -= 1
            elif layerwise and not eager:
                forward.setdefault(k + delay + 1, []).append(arrival)
            else:
                boundary.setdefault(k + delay, []).append(arrival)
        if k == H:
            mark = (clock, waited, busy)
    steps = (cycles - 1) * H
    return Timeline((clock - mark[0]) / steps, (waited - mark[1]) / steps,
                    (busy - mark[2]) / steps, peak)


def layerwise_exposure_s(fwd_s: list[float], jobs: list[tuple[int, float]]) -> float:
    """Exposed seconds of one layer-wise round started at a step boundary on an idle link:
    the next forward waits for each unit's job (used for A-EDiT's blocking sync).

    Args:
        fwd_s: forward seconds per unit.
        jobs: ``(unit, seconds)`` in order on the link (unit -1: before every unit).
    """
    t_link, arrival = 0.0, {}
    for unit, seconds in jobs:
        t_link += seconds
        arrival[unit] = t_link
    first = arrival.get(-1, 0.0)
    t = 0.0
    for u, f in enumerate(fwd_s):
        t = max(t, arrival.get(u, 0.0), first)
        t += f
    return max(0.0, t - sum(fwd_s))


# --------------------------------------------------------------------------- prediction
@dataclass
class Layout:
    """How the cluster's GPUs are split for a method."""

    replicas: int
    shard_size: int
    tp: int
    pp: int = 1
    """Pipeline stages per replica (each on its own ``shard_size x tp`` GPUs)."""

    @property
    def stage_gpus(self) -> int:
        """GPUs of one pipeline stage (the whole replica without stages)."""
        return self.shard_size * self.tp

    @property
    def gpus_per_replica(self) -> int:
        """GPUs of one replica."""
        return self.pp * self.stage_gpus


def layout(cluster: Cluster, method: MethodSpec) -> Layout:
    """Replicas x pipeline stages x shards x tp of a setting on a cluster (default
    shards: one node's GPUs over tp and the stages).

    Raises:
        ConfigError: the GPUs do not split evenly.
    """
    tp, pp = method.tp, method.pp
    if pp == 1:
        shard = method.shard_size or max(1, cluster.gpus_per_node // tp)
    else:
        shard = method.shard_size or max(1, cluster.gpus_per_node // (tp * pp))
    per_replica = pp * shard * tp
    if cluster.gpus % per_replica:
        stages = f"pp {pp} x " if pp > 1 else ""
        raise ConfigError(f"method.shard_size: {cluster.gpus} GPUs do not split into "
                          f"replicas of {stages}{shard} x tp {tp} GPUs")
    return Layout(cluster.gpus // per_replica, shard, tp, pp)


@dataclass
class Memory:
    """Bytes per GPU (rank) of one setting, by kind; ``host`` is offloaded CPU memory."""

    parts: dict[str, float]
    host: dict[str, float] = field(default_factory=dict)

    @property
    def gpu_bytes(self) -> float:
        """Bytes on the GPU."""
        return sum(self.parts.values())

    @property
    def host_bytes(self) -> float:
        """Bytes in host memory (offloaded state)."""
        return sum(self.host.values())


def memory_per_rank(shape: Shape, spec: ModelSpec, method: MethodSpec, lay: Layout) -> Memory:
    """Memory of one GPU: parameters, gradients and AdamW state (sharded over the replica's
    ``shard_size x tp`` GPUs), the outer state (anchor, outer momentum, error feedback,
    in-flight snapshots), a round's gather buffer and the activations.

    Args:
        shape: the model's shape.
        spec: the model spec (batch, sequence, precision, checkpointing).
        method: the setting.
        lay: the layout.
    """
    n = shape.params / lay.gpus_per_replica
    b = DTYPE_BYTES[spec.dtype]
    parts = {"parameters": n * b, "gradients": n * b,
             # AdamW's two moments, plus an fp32 master copy when training in bf16.
             "optimizer": n * (8 + (4 if spec.dtype == "bf16" else 0))}
    outer: dict[str, float] = {}
    if method.method in ("diloco", "edit", "aedit"):
        outer["anchor"] = 4 * n
        if method.outer_momentum:
            outer["outer_momentum"] = 4 * n
    if method.codec not in ("fp32",) and method.error_feedback and method.local:
        outer["error_feedback"] = 4 * n
    if method.eager:
        outer["previous_delta"] = 4 * n
        # The global anchor G, the same on every replica (docs/streaming.md 3c), and the
        # momentum of its own outer optimizer where it has one.
        outer["global_anchor"] = 4 * n
        if method.outer_momentum:
            outer["global_outer_momentum"] = 4 * n
    if method.local and (method.overlap or method.eager):
        delay = method.H if method.eager else method.overlap
        in_flight = min(method.fragments, math.floor(delay * method.fragments / method.H) + 1)
        parts["snapshots"] = 4 * n * in_flight / method.fragments
    if method.cpu_offload:
        host = outer
    else:
        parts.update(outer)
        host = {}
    if method.local and method.method != "post_local_sgd":
        largest = max(c for _, c in shape.units) / lay.gpus_per_replica
        if method.codec == "fp32":
            parts["round_buffer"] = 4 * largest
        else:
            parts["round_buffer"] = payload_bytes(largest, method.codec) * lay.replicas \
                + 4 * largest
    micro = spec.micro_batch or max(1, math.ceil(spec.batch_size / lay.shard_size))
    s, d = spec.seq_len, shape.dim
    scale = 2 if spec.dtype == "fp32" else 1
    # With checkpointing only each layer's input is kept, plus one layer's full set
    # during its backward.
    per_layer = layer_activation_bytes(shape, spec, lay.tp, micro)
    if spec.activation_checkpointing:
        acts = shape.layers * 2 * s * micro * d * scale / lay.tp + per_layer
    else:
        acts = shape.layers * per_layer
    parts["activations"] = acts
    parts["logits"] = s * micro * shape.vocab * 8 / lay.tp
    return Memory(parts, host)


def layer_activation_bytes(shape: Shape, spec: ModelSpec, tp: int, micro: int | None = None
                           ) -> float:
    """Activations one layer keeps for its backward, bytes per GPU, without recomputation:
    ``s b d (34 + 5 heads s / d)`` in bf16 (Korthikanti et al. 2022; x2 in fp32), split by
    tp, for ``micro`` sequences (default ``spec.micro_batch``).

    Args:
        shape: the model's shape (width, heads).
        spec: the model spec (sequence length, precision).
        tp: the tensor-parallel degree.
        micro: sequences per forward.
    """
    micro = spec.micro_batch if micro is None else micro
    s, d = spec.seq_len, shape.dim
    scale = 2 if spec.dtype == "fp32" else 1
    return s * micro * d * (34 + 5 * shape.heads * s / d) * scale / tp


@dataclass
class Prediction:
    """The plan of one setting."""

    label: str
    method: MethodSpec
    layout: Layout
    compute_s: float
    """Compute seconds per step of a replica at nominal speed (intra-replica collectives'
    exposed time and the slowdown of the rounds running beside the compute included)."""
    wall_per_step_s: float
    """Mean wall seconds per step (cluster tokens per step over cluster tokens/s)."""
    tokens_per_s: float
    """Tokens per second of the whole cluster."""
    utilisation: float
    """Compute time over wall time, mean over replicas (slowdowns count as compute)."""
    exposed_comm_s: float
    """Seconds per step the training thread waits for cross-replica communication."""
    straggler_wait_s: float
    """Seconds per step a replica waits for slower replicas (mean over replicas)."""
    bytes_per_round: float
    """Bytes a node sends per round of H steps (per step for sync)."""
    round_link_s: float
    """Seconds the node's link is busy per round."""
    memory: Memory
    staleness_steps: float = 0.0
    """Steps between a round's launch and its merge (overlap / eager / non-blocking)."""
    notes: list[str] = field(default_factory=list)
    bubble_s: float = 0.0
    """Seconds per step a replica's GPUs idle in the pipeline's schedule (fill, drain and
    the stages' imbalance; inside ``compute_s``; 0 without pipeline stages)."""
    pp_transfer_s: float = 0.0
    """Seconds per step of activation transfers between stages that nothing hides
    (inside ``compute_s``)."""

    @property
    def bubble(self) -> float:
        """The share of a step the pipeline's GPUs idle in the schedule (0 without
        stages)."""
        return self.bubble_s / self.compute_s if self.bubble_s else 0.0

    def row(self) -> dict[str, Any]:
        """A flat dict of the numbers (for JSON and tables)."""
        return {"label": self.label, "method": self.method.method,
                "replicas": self.layout.replicas, "pp": self.layout.pp,
                "shard_size": self.layout.shard_size,
                "tp": self.layout.tp, "bubble": self.bubble, "bubble_s": self.bubble_s,
                "pp_transfer_s": self.pp_transfer_s, "compute_s": self.compute_s,
                "wall_per_step_s": self.wall_per_step_s, "tokens_per_s": self.tokens_per_s,
                "utilisation": self.utilisation, "exposed_comm_s": self.exposed_comm_s,
                "straggler_wait_s": self.straggler_wait_s,
                "bytes_per_round": self.bytes_per_round, "round_link_s": self.round_link_s,
                "gpu_memory_bytes": self.memory.gpu_bytes,
                "host_memory_bytes": self.memory.host_bytes,
                "staleness_steps": self.staleness_steps}


def replica_factors(cluster: Cluster, replicas: int) -> list[float]:
    """Per-replica slowdown factors, evenly spaced in ``[1, 1 + straggler_spread]``."""
    if replicas == 1:
        return [1.0]
    return [1.0 + cluster.straggler_spread * i / (replicas - 1) for i in range(replicas)]


def step_flops(shape: Shape, spec: ModelSpec) -> float:
    """Training FLOPs of one replica's step: its ``batch_size x seq_len`` tokens times
    :meth:`Shape.flops_per_token`, x 4/3 with activation checkpointing (the forward runs
    twice).

    Args:
        shape: the model's shape.
        spec: the model spec (batch, sequence, checkpointing).
    """
    tokens = spec.batch_size * spec.seq_len
    flops = tokens * shape.flops_per_token(spec.seq_len)
    if spec.activation_checkpointing:
        flops *= 4.0 / 3.0
    return flops


def measured_scale(cluster: Cluster, shape: Shape, spec: ModelSpec, lay: Layout) -> float:
    """How many times the measured ``cluster.step_time_s`` this job's compute per step is.

    The measured step belongs to one job (``cluster.step_time_flops`` FLOPs per step on
    ``cluster.step_time_gpus`` GPUs per replica: calibration's run); what carries over to
    another model, batch, checkpointing or replica size is the machine's achieved FLOP/s
    per GPU, so the compute scales with the FLOPs per step and inversely with the GPUs
    per replica. Exactly 1 for the measured job itself, and when the cluster does not
    say which job was measured (``step_time_s`` is then the planned job's own).

    Args:
        cluster: the cluster (its ``step_time_flops`` and ``step_time_gpus``).
        shape: the planned model's shape.
        spec: the planned model spec.
        lay: the planned setting's layout.
    """
    measured_flops, measured_gpus = cluster.step_time_flops, cluster.step_time_gpus
    if measured_flops is None or measured_gpus is None:
        return 1.0
    flops, gpus = step_flops(shape, spec), lay.gpus_per_replica
    if flops == measured_flops and gpus == measured_gpus:
        return 1.0
    return flops / measured_flops * measured_gpus / gpus


def compute_step_s(cluster: Cluster, shape: Shape, spec: ModelSpec, lay: Layout,
                   method: MethodSpec | None = None) -> tuple[float, float]:
    """Compute seconds per step of one replica at nominal speed, and the exposed seconds
    of its replica-internal collectives (FSDP2 all-gathers and reduce-scatter, tp
    all-reduces) inside that figure.

    With a measured ``cluster.step_time_s`` that is the answer (it holds the collectives),
    converted to this job when it was measured on another one (:func:`measured_scale`).
    Otherwise ``tokens * flops_per_token / (gpus * peak * mfu)`` plus the collectives:
    FSDP2 moves ``3 (S - 1) / S`` of the replica's parameter bytes per rank per
    micro-batch pass, overlapped with compute except for the first unit's gather; tp
    all-reduces ``4`` activations per layer per micro-batch, not overlapped.

    Args:
        cluster: the cluster.
        shape: the model's shape.
        spec: the model spec.
        lay: the layout.
        method: unused, for symmetry.
    """
    if cluster.step_time_s is not None:
        return cluster.step_time_s * measured_scale(cluster, shape, spec, lay), 0.0
    assert cluster.gpu_peak_tflops is not None and cluster.mfu is not None
    flops = step_flops(shape, spec)
    compute = flops / (lay.gpus_per_replica * cluster.gpu_peak_tflops * 1e12 * cluster.mfu)
    b = DTYPE_BYTES[spec.dtype]
    micro = spec.micro_batch or max(1, math.ceil(spec.batch_size / lay.shard_size))
    passes = max(1, math.ceil(spec.batch_size / lay.shard_size / micro))
    exposed = 0.0
    if lay.shard_size > 1:
        nbytes = shape.params / lay.tp * b
        if lay.gpus_per_replica <= cluster.gpus_per_node:
            bw = cluster.intra_node_gbps * 1e9 / 8
            lat = cluster.intra_node_latency_us * 1e-6
            share = 1
        else:  # the replica spans nodes: its shards share each node's link
            bw, lat, share = cluster.inter_bytes_per_s, cluster.inter_latency_s, \
                cluster.gpus_per_node
        one = allgather_s(nbytes / lay.shard_size * share, lay.shard_size, bw, lat,
                          cluster.latency_per)
        fsdp = one * (2 * passes + 1)
        exposed += max(fsdp / len(shape.units), fsdp - compute)
    if lay.tp > 1:
        bw = cluster.intra_node_gbps * 1e9 / 8
        act = micro * spec.seq_len * shape.dim * b
        exposed += 4 * shape.layers * passes * ring_allreduce_s(
            act, lay.tp, bw, cluster.intra_node_latency_us * 1e-6, cluster.latency_per)
    return compute + exposed, exposed


def unit_bytes(method: MethodSpec, params: float, R: int, dtype_bytes: int = 4) -> float:
    """Bytes a node sends for one unit of ``params`` values in one round over ``R``
    replicas: an fp32 (sync: training dtype) ring all-reduce, ``2 (R - 1) / R`` of the
    buffer whatever ``R``; or an all-gather of the codec's payload, ``(R - 1)`` payloads
    (every replica receives every other's message: the quantised and sparse codecs cannot
    be summed on the way), which grows with ``R``. The node's ``shard x tp`` ranks each
    send their shard's part over the one link, so the node sends the whole unit's bytes."""
    if R <= 1:
        return 0.0
    if method.codec == "fp32" or method.method in ("sync", "post_local_sgd"):
        b = dtype_bytes if method.method == "sync" else 4
        return 2.0 * (R - 1) / R * params * b
    return (R - 1) * payload_bytes(params, method.codec)


def gather_break_even_replicas(codec: str, summable_bytes_per_value: float,
                               n: int = codecs.CHUNK) -> float:
    """The replica count above which a gathered ``codec`` sends more than a ring
    all-reduce of a codec of ``summable_bytes_per_value`` bytes per value that can be
    summed on the way (fp32 4, bf16 2): ``(R - 1) p > 2 (R - 1) / R b`` for ``R > 2 b /
    p``, ``p`` the gathered codec's bytes per value (over ``n`` values: its payload at
    the default chunk is exact for a multiple of it)."""
    p = payload_bytes(n, codec) / n
    return 2.0 * summable_bytes_per_value / p


def _unit_job_s(cluster: Cluster, method: MethodSpec, params: float, R: int,
                dtype_bytes: int) -> tuple[float, float]:
    """(seconds on the node's link, bytes the node sends: :func:`unit_bytes`) of one
    unit's cross-replica reduction."""
    bw, lat, per = cluster.inter_bytes_per_s, cluster.inter_latency_s, cluster.latency_per
    if R <= 1:
        return 0.0, 0.0
    nbytes = unit_bytes(method, params, R, dtype_bytes)
    if method.codec == "fp32" or method.method in ("sync", "post_local_sgd"):
        b = dtype_bytes if method.method == "sync" else 4
        return ring_allreduce_s(params * b, R, bw, lat, per), nbytes
    return allgather_s(payload_bytes(params, method.codec), R, bw, lat, per), nbytes


def _small_collective_s(cluster: Cluster, R: int) -> float:
    """One small all-gather over the replicas (statistics, rendezvous): latency only."""
    return allgather_s(0.0, R, cluster.inter_bytes_per_s, cluster.inter_latency_s,
                       cluster.latency_per)


def _rounds(cluster: Cluster, shape: Shape, method: MethodSpec, R: int, dtype_bytes: int
            ) -> tuple[list[Round], float, float]:
    """The rounds of a local method (one per fragment), the bytes a node sends per H steps
    and the link seconds per H steps."""
    P, H = method.fragments, method.H
    rounds, total_bytes, total_s = [], 0.0, 0.0
    for f in range(P):
        jobs: list[tuple[int, float]] = []
        if method.ft:
            jobs.append((-1, cluster.ft_quorum_ms / 1000.0 + _small_collective_s(cluster, R)))
        if method.method in ("edit", "aedit") and R > 1:
            # EDiT's pseudo-gradient statistics (norms for the weights and the detector).
            jobs.append((-1, _small_collective_s(cluster, R)))
        for u, (_, n) in enumerate(shape.units):
            if u % P != f:
                continue
            seconds, nbytes = _unit_job_s(cluster, method, n, R, dtype_bytes)
            jobs.append((u, seconds))
            total_bytes += nbytes
        total_s += sum(s for _, s in jobs)
        rounds.append(Round(f, ((f + 1) * H // P) % H, jobs))
    return rounds, total_bytes, total_s


def predict(cluster: Cluster, spec: ModelSpec, method: MethodSpec,
            shape: Shape | None = None, check_memory: bool = True) -> Prediction:
    """Plan one setting on one cluster.

    With pipeline stages (``method.pp > 1``, :mod:`editrain.plan.pipeline`) a step is the
    pipelined step (bubble and activation transfers included), the memory the busiest
    stage's, and the rounds those of the stages that share the busiest node link.

    Args:
        cluster: the cluster.
        spec: the model.
        method: the setting.
        shape: the model's shape (computed from ``spec`` when not given).
        check_memory: fail when the setting does not fit ``cluster.gpu_memory_gb``.

    Raises:
        ConfigError: the layout does not split, the fragments exceed the units, the
            pipeline does not suit the model or the batch, or the setting does not fit a
            GPU's memory.
    """
    shape = shape or model_shape(spec)
    lay = layout(cluster, method)
    if lay.pp > 1:
        pipe = pipeline.check_pipeline(shape, spec, method, lay)
        mem = _stage_memory(shape, spec, method, lay, pipe)
    elif method.fragments > len(shape.units):
        raise ConfigError(f"method.fragments: {method.fragments} is more than the model's "
                          f"{len(shape.units)} sync units")
    else:
        mem = memory_per_rank(shape, spec, method, lay)
    if check_memory and cluster.gpu_memory_gb is not None \
            and mem.gpu_bytes > cluster.gpu_memory_gb * GIB:
        top = max(mem.parts, key=mem.parts.get)  # type: ignore[arg-type]
        model = spec.label if spec.params is None else "the model"
        raise ConfigError(
            f"cluster.gpu_memory_gb: {model} with {method.label} needs "
            f"{mem.gpu_bytes / GIB:.1f} GiB per GPU (most: {top} "
            f"{mem.parts[top] / GIB:.1f} GiB), more than the {cluster.gpu_memory_gb:g} GiB "
            "of a GPU; use more shards, tp, micro_batch or activation_checkpointing")
    notes = _scaled_compute_notes(cluster, shape, spec, lay)
    if lay.pp == 1:
        compute, _intra = compute_step_s(cluster, shape, spec, lay)
        fwd = [compute / 3.0 * w for w in shape.fwd_share]
        return _predict_on_link(cluster, shape, spec, method, lay, compute, fwd, mem, notes,
                                [list(range(len(shape.units)))])
    step = _pipeline_step(cluster, shape, spec, lay, pipe)
    if step.link_bound:
        notes.append("the activations' transfers between stages set the pace")
    # Each group of stages shares a node's link; the slowest sets the replica's pace.
    preds = [_predict_on_link(cluster, shape, spec, method, lay, step.step_s, step.fwd_s,
                              mem, list(notes), [pipe.units[r] for r in ranks])
             for ranks in pipeline.link_groups(cluster, lay)]
    pred = min(preds, key=lambda x: x.tokens_per_s)
    pred.bubble_s, pred.pp_transfer_s = step.bubble_s, step.transfer_s
    return pred


def _link_rounds(cluster: Cluster, shape: Shape, method: MethodSpec, R: int,
                 dtype_bytes: int, stages: list[list[int]]
                 ) -> tuple[list[Round], float, float]:
    """:func:`_rounds` of the units on one node's link: every unit without pipeline
    stages; with them, each stage's own rounds (its units split into the fragments)
    merged on the shared link (:func:`editrain.plan.pipeline.merge_rounds`)."""
    if len(stages) == 1 and len(stages[0]) == len(shape.units):
        return _rounds(cluster, shape, method, R, dtype_bytes)
    per_stage, total_bytes, total_s = [], 0.0, 0.0
    for units in stages:
        stage = pipeline.stage_shape(shape, units, shape.layers)
        rounds, nbytes, seconds = _rounds(cluster, stage, method, R, dtype_bytes)
        per_stage.append(pipeline.to_global(rounds, units))
        total_bytes += nbytes
        total_s += seconds
    return pipeline.merge_rounds(per_stage), total_bytes, total_s


def _predict_on_link(cluster: Cluster, shape: Shape, spec: ModelSpec, method: MethodSpec,
                     lay: Layout, compute: float, fwd: list[float], mem: Memory,
                     notes: list[str], stages: list[list[int]]) -> Prediction:
    """The setting's prediction with the cross-replica traffic of ``stages`` (lists of
    unit indices) on one node's link: all the units without pipeline stages.

    Args:
        compute: compute seconds per step of a replica (a pipelined step with stages).
        fwd: forward seconds per unit (the layer-wise merge waits unit by unit).
        stages: the units on this link, stage by stage.
    """
    R = lay.replicas
    tokens_step = spec.batch_size * spec.seq_len  # per replica
    factors = replica_factors(cluster, R)
    over = cluster.step_overhead_s
    p, s = cluster.stall_prob, cluster.stall_s
    db = DTYPE_BYTES[spec.dtype]
    mean_busy_step = compute * sum(factors) / R + p * s  # per step, mean over replicas

    if method.method == "sync":
        on_link = [u for units in stages for u in units]
        jobs = [(u, _unit_job_s(cluster, method, shape.units[u][1], R, db)[0])
                for u in on_link]
        nbytes = sum(_unit_job_s(cluster, method, shape.units[u][1], R, db)[1]
                     for u in on_link)
        link = sum(x for _, x in jobs)
        if method.grad_overlap:
            # Units' backwards run last to first (2x their forward); each reduction starts
            # when its unit's backward is done and the link is free.
            job_s = dict(jobs)
            t, link_free = 0.0, 0.0
            for u in reversed(range(len(shape.units))):
                t += 2 * fwd[u]
                if u in job_s:
                    link_free = max(link_free, t) + job_s[u]
            exposed = max(0.0, link_free - t)
        else:
            exposed = link
        pace = compute * max(factors) + over + expected_max_stall_s(1, R, p, s)
        wall = pace + exposed
        return Prediction(method.label, method, lay, compute, wall, R * tokens_step / wall,
                          mean_busy_step / wall, exposed, pace - over - mean_busy_step,
                          nbytes, link, mem, notes=notes)

    rounds, round_bytes, round_s = _link_rounds(cluster, shape, method, R, db, stages)
    H = method.H
    # The communication thread's CPU work slows the compute of the steps its rounds run
    # beside, on every replica alike; spread over the H steps (docs/planning.md, The
    # model of one job, Compute).
    beside = overlap_slowdown_s(cluster, method)
    if method.method == "aedit":
        pred = _predict_aedit(cluster, method, lay, compute, factors, fwd, rounds,
                              round_bytes, round_s, tokens_step, mem, beside)
        pred.notes[:0] = notes
        return pred

    mean_busy_step += beside
    pace = compute * max(factors) + beside + over + expected_max_stall_s(H, R, p, s) / H
    tl = timeline(pace, fwd, rounds, H, method.overlap, bool(method.layerwise), method.eager)
    wall = tl.wall_per_step_s
    stale = float(H if method.eager else method.overlap)
    if tl.link_busy_per_step_s > pace * 1.0001 and (method.overlap or method.eager):
        notes.append("link-bound: the rounds need the link longer than the compute takes")
    return Prediction(method.label, method, lay, compute + beside, wall,
                      R * tokens_step / wall, mean_busy_step / wall, tl.wait_per_step_s,
                      pace - over - mean_busy_step, round_bytes, round_s, mem, stale, notes)


# --------------------------------------------------------------------------- stages
def _stage_spec(spec: ModelSpec, pipe: pipeline.Pipeline) -> ModelSpec:
    """``spec`` with one pipeline microbatch as the forward batch, unvalidated (a copy:
    the planned model is the same, only the unit of a forward changes)."""
    out = copy.copy(spec)
    out.micro_batch = pipe.sequences
    return out


def _rank_compute_s(cluster: Cluster, shape: Shape, spec: ModelSpec, lay: Layout,
                    pipe: pipeline.Pipeline) -> list[float]:
    """Each pipeline rank's compute seconds per step (all microbatches).

    A measured ``cluster.step_time_s`` is the step of the replica with every GPU busy
    (no bubble; converted to this job by :func:`measured_scale`): rank ``r`` takes ``pp``
    times its share of the FLOPs of it. Otherwise each rank is a job of its own units on
    ``shard_size x tp`` GPUs (:func:`compute_step_s`), its FSDP2 gathers and tp
    all-reduces counted per pipeline microbatch."""
    flops = pipeline.unit_flops_per_token(shape, spec.seq_len)
    if cluster.step_time_s is not None:
        ideal = cluster.step_time_s * measured_scale(cluster, shape, spec, lay)
        total = sum(flops)
        return [lay.pp * ideal * sum(flops[u] for u in units) / total
                for units in pipe.units]
    stage_lay = Layout(lay.replicas, lay.shard_size, lay.tp)
    micro = _stage_spec(spec, pipe)
    return [compute_step_s(cluster, pipeline.stage_shape(shape, units, len(blocks)), micro,
                           stage_lay)[0] for units, blocks in zip(pipe.units, pipe.blocks)]


def _pipeline_step(cluster: Cluster, shape: Shape, spec: ModelSpec, lay: Layout,
                   pipe: pipeline.Pipeline) -> pipeline.PipelineStep:
    """The pipelined step of one replica: its ranks' compute through the schedule
    (:func:`editrain.plan.pipeline.pipelined_step_s`), then the activations' transfers.
    The fill and the drain wait for ``2 (pp V - 1)`` of them (the first microbatch's
    forward and the last one's backward cross every chunk boundary in turn); in the steady
    state a rank sends ``2 V M`` (activations forward, gradients backward), hidden behind
    its compute unless they take longer (then the link sets the pace)."""
    rank_s = _rank_compute_s(cluster, shape, spec, lay, pipe)
    M, v = pipe.microbatches, pipe.stages_per_rank
    scheduled = pipeline.pipelined_step_s(rank_s, M, v)
    mean = sum(rank_s) / len(rank_s)
    act = pipe.sequences * spec.seq_len * shape.dim * DTYPE_BYTES[spec.dtype]
    one = pipeline.transfer_s(cluster, lay, act)
    step = max(scheduled, 2 * v * M * one) + 2 * (pipe.pp * v - 1) * one
    flops = pipeline.unit_flops_per_token(shape, spec.seq_len)
    fwd = [0.0] * len(shape.units)
    for r, units in enumerate(pipe.units):
        own = sum(flops[u] for u in units) or 1.0
        for u in units:
            fwd[u] = rank_s[r] * flops[u] / own / (3.0 * M)
    return pipeline.PipelineStep(step, rank_s, scheduled - mean, step - scheduled, fwd,
                                 2 * v * M * one > scheduled)


def _stage_memory(shape: Shape, spec: ModelSpec, method: MethodSpec, lay: Layout,
                  pipe: pipeline.Pipeline) -> Memory:
    """The memory of the busiest pipeline rank: its units' parameters, gradients,
    optimizer and outer state over its ``shard_size x tp`` GPUs (:func:`memory_per_rank`
    on its units), the activations of the microbatches its schedule holds
    (:func:`editrain.plan.pipeline.in_flight`) and, on the last rank, their logits."""
    stage_lay = Layout(lay.replicas, lay.shard_size, lay.tp)
    micro = _stage_spec(spec, pipe)
    checkpointing = spec.activation_checkpointing
    worst: Memory | None = None
    for r, (units, blocks) in enumerate(zip(pipe.units, pipe.blocks)):
        mem = memory_per_rank(pipeline.stage_shape(shape, units, len(blocks)), micro,
                              method, stage_lay)
        held = pipeline.in_flight(pipe.schedule, pipe.pp, pipe.microbatches,
                                  pipe.stages_per_rank, r)
        # With checkpointing only the layer being recomputed holds its whole set.
        full = layer_activation_bytes(shape, micro, lay.tp) if checkpointing else 0.0
        mem.parts["activations"] = (mem.parts["activations"] - full) * held + full
        if r == pipe.pp - 1:
            mem.parts["logits"] *= held
        else:
            del mem.parts["logits"]
        if worst is None or mem.gpu_bytes > worst.gpu_bytes:
            worst = mem
    assert worst is not None  # a pipeline has ranks
    return worst


def _scaled_compute_notes(cluster: Cluster, shape: Shape, spec: ModelSpec, lay: Layout
                          ) -> list[str]:
    """The note a setting gets when its compute is the measured step time converted from
    another job (:func:`measured_scale`), so that a reader knows the number is no
    measurement of this job; none otherwise."""
    if cluster.step_time_s is None:
        return []
    scale = measured_scale(cluster, shape, spec, lay)
    if scale == 1.0:
        return []
    return [f"compute scaled from the measured job's {cluster.step_time_s * 1000:.3g} ms "
            f"per step x{scale:.4g} ({step_flops(shape, spec) / 1e9:.4g} GFLOP per step on "
            f"{lay.gpus_per_replica} GPU(s) per replica against its "
            f"{cluster.step_time_flops / 1e9:.4g} on {cluster.step_time_gpus}; the same "
            "achieved FLOP/s per GPU assumed)"]


def overlap_slowdown_s(cluster: Cluster, method: MethodSpec) -> float:
    """Compute seconds per step that the rounds running beside the compute add:
    ``cluster.overlap_cpu_s`` per round, ``fragments / H`` rounds per step
    (:attr:`MethodSpec.overlapping_rounds_per_step`; 0 for sync and blocking rounds).

    Args:
        cluster: the cluster (its ``overlap_cpu_s``).
        method: the setting.
    """
    return cluster.overlap_cpu_s * method.overlapping_rounds_per_step


def _predict_aedit(cluster: Cluster, method: MethodSpec, lay: Layout, compute: float,
                   factors: list[float], fwd: list[float], rounds: list[Round],
                   round_bytes: float, round_s: float, tokens_step: int,
                   mem: Memory, beside: float = 0.0) -> Prediction:
    """A-EDiT: every replica trains for the same wall-clock window, so a slow replica does
    fewer steps instead of holding the others back.

    Blocking: replica ``i`` runs ``ceil(W / t_i)`` steps (the trigger is checked at step
    boundaries), the rendezvous waits for the last one to finish its step, then the
    layer-wise sync's exposed part. Non-blocking (``overlap > 0``): no replica waits; the
    round is merged when done, at least ``overlap`` steps after its launch. ``beside``:
    the compute slowdown per step of the rounds running beside the compute (one per H
    nominal steps)."""
    R = lay.replicas
    over, p, s = cluster.step_overhead_s, cluster.stall_prob, cluster.stall_s
    W = method.sync_time_s or method.H * (compute + over)
    t_i = [compute * f + beside + over + p * s for f in factors]
    n_i = [max(1, math.ceil(W / t)) for t in t_i]
    rv = _small_collective_s(cluster, R)
    jobs = [j for r in rounds for j in r.jobs]
    if method.overlap > 0:
        tokens_per_s = sum(tokens_step / t for t in t_i)
        busy = [(compute * f + beside + p * s) / t for f, t in zip(factors, t_i)]
        ends = [n * t for n, t in zip(n_i, t_i)]
        # The round completes after the last replica posts and the link has carried it.
        stale = max(method.overlap, (max(ends) - min(ends) + rv + round_s) / min(t_i))
        wall = R * tokens_step / tokens_per_s
        return Prediction(method.label, method, lay, compute + beside, wall, tokens_per_s,
                          sum(busy) / R, 0.0, 0.0, round_bytes, round_s + rv, mem,
                          float(stale))
    end = max(n * t for n, t in zip(n_i, t_i))
    exposed = rv + layerwise_exposure_s(fwd, jobs)
    cycle = end + exposed
    steps = sum(n_i)
    tokens_per_s = steps * tokens_step / cycle
    busy = [n * (compute * f + beside + p * s) / cycle for n, f in zip(n_i, factors)]
    waits = [(end - n * t) / (n) for n, t in zip(n_i, t_i)]
    wall = R * tokens_step / tokens_per_s
    return Prediction(method.label, method, lay, compute + beside, wall, tokens_per_s,
                      sum(busy) / R, exposed * R / steps, sum(waits) / R, round_bytes, round_s + rv, mem)


__all__ = ["CODEC_BITS", "Layout", "Memory", "Prediction", "Round", "Shape", "Timeline",
           "allgather_s", "compute_step_s", "expected_max_stall_s",
           "gather_break_even_replicas", "layerwise_exposure_s",
           "layout", "llama_shape", "measured_scale", "memory_per_rank", "model_shape",
           "overlap_slowdown_s", "payload_bytes", "predict",
           "replica_factors", "ring_allreduce_s", "step_flops", "timeline", "unit_bytes"]
