"""What a plan is asked about: a cluster, a model and method settings, validated.

A plan file is TOML with three kinds of tables (every field is documented below):

.. code-block:: toml

    [cluster]
    nodes = 8
    gpus_per_node = 8
    gpu_peak_tflops = 989          # dense bf16 per GPU
    mfu = 0.4                      # or step_time_s = 0.25 (measured compute per step)
    gpu_memory_gb = 80
    inter_node_gbps = 100          # Gbit/s per node, each way
    inter_node_latency_ms = 0.05
    straggler_spread = 0.1         # the slowest replica computes 10% slower

    [model]
    preset = "1b"                  # or hf_config = "config.json", init_from = DIR, or
                                   # params + layers
    seq_len = 2048
    batch_size = 64                # sequences per replica per step

    [[method]]
    method = "edit"
    H = 128

Every value is checked before anything is computed; a bad one raises
:class:`~editrain.errors.ConfigError` whose message starts with the field's dotted name
(``cluster.inter_node_gbps: must be > 0, got 0``), which the CLI prints as one line.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from editrain.errors import ConfigError, plain_count, plain_scalar, spelled
from editrain.paths import shown
from editrain.safe_io import parse_toml_scalar, read_toml
from editrain.sync.methods import OUTER_SGD

METHODS = ("sync", "post_local_sgd", "diloco", "edit", "aedit")
CODECS = ("fp32", "bf16", "int8", "int4", "fp4", "topk2", "topk1")
DTYPES = ("fp32", "bf16")
LATENCY_MODES = ("hop", "collective")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
"""The pipeline schedules, by training's names (``dist.pp_schedule``)."""
GBIT = 1e9 / 8
"""Bytes per second in one Gbit/s."""


def _fail(option: str, msg: str) -> ConfigError:
    return ConfigError(f"{option}: {msg}")


def _number(value: Any, option: str) -> float:
    """A finite real number as a plain ``float`` (the type checked as every option's is,
    by :func:`~editrain.errors.plain_scalar`: numpy's numbers taken, bools not)."""
    number = plain_scalar(value, float, option)
    if not math.isfinite(number):
        raise _fail(option, f"must be finite, got {spelled(value)}")
    return number


def _positive(value: Any, option: str) -> float:
    v = _number(value, option)
    if v <= 0:
        raise _fail(option, f"must be > 0, got {spelled(value)}")
    return v


def _non_negative(value: Any, option: str) -> float:
    v = _number(value, option)
    if v < 0:
        raise _fail(option, f"must be >= 0, got {spelled(value)}")
    return v


MAX_GPUS = 10**6
"""The largest cluster :func:`editrain.plan.model.predict` models (its work grows with the
replicas; the largest clusters trained on have about 10**5 GPUs)."""
MAX_LAYERS = 10**5
"""The most transformer blocks a planned model may have (the plan keeps one sync unit per
block; the deepest models have about 10**2)."""


def _count(value: Any, option: str, least: int = 1) -> int:
    """A plain ``int`` of at least ``least`` (:func:`~editrain.errors.plain_count`)."""
    return plain_count(value, option, least)


def _choice(value: Any, option: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise _fail(option, f"must be one of {', '.join(allowed)}, got {spelled(value)}")
    return value


@dataclass
class Cluster:
    """The machines: how many, how fast they compute, how fast they talk.

    A *node* is one machine with ``gpus_per_node`` GPUs; its inter-node link is shared by
    all of them (the simulated link of ``editrain.sim`` works the same way).
    """

    nodes: int
    """Number of nodes."""
    gpus_per_node: int
    """GPUs (ranks) per node."""
    inter_node_gbps: float
    """Inter-node bandwidth per node, Gbit/s, each way (full duplex)."""
    gpu_peak_tflops: float | None = None
    """Peak dense TFLOP/s of one GPU in the training precision (with ``mfu``)."""
    mfu: float | None = None
    """Model FLOPs utilisation in (0, 1]: the share of the peak the compute reaches."""
    step_time_s: float | None = None
    """Measured compute seconds of one training step of one replica (instead of peak and
    MFU); it holds the replica-internal collectives (FSDP2, tp) already. With pipeline
    stages it is the step with every GPU of the replica busy: the plan adds the
    schedule's bubble (calibration from a pipelined run takes it out)."""
    step_time_flops: float | None = None
    """FLOPs per step of one replica of the job ``step_time_s`` was measured on (with
    ``step_time_gpus``; calibration writes its run's). A planned job of other FLOPs per
    step (model, batch, sequence, activation checkpointing) or other GPUs per replica then
    gets ``step_time_s`` scaled to it: the same achieved FLOP/s per GPU. Not given:
    ``step_time_s`` is every planned job's own."""
    step_time_gpus: int | None = None
    """GPUs (ranks) of one replica of the job ``step_time_s`` was measured on (``shard_size
    x tp``; with ``step_time_flops``)."""
    step_overhead_s: float = 0.0
    """Seconds per step outside compute and communication (logging, the engine's step
    boundary; a step's data loading and optimizer step are in its measured compute);
    calibration measures it."""
    gpu_memory_gb: float | None = None
    """Memory of one GPU, GiB; when given, a plan that does not fit fails."""
    intra_node_gbps: float = 1600.0
    """Intra-node bandwidth per GPU, Gbit/s (NVLink; FSDP2 and tp collectives)."""
    intra_node_latency_us: float = 5.0
    """Latency of one intra-node collective step, microseconds."""
    inter_node_latency_ms: float = 0.0
    """Latency of one inter-node message, milliseconds."""
    latency_per: str = "hop"
    """How latency adds up: ``hop`` (ring: one latency per ring step, 2 (R - 1) for an
    all-reduce) or ``collective`` (one per collective, as ``editrain.sim`` charges)."""
    straggler_spread: float = 0.0
    """Per-replica slowdown spread: replica speeds are spaced evenly between 1 and
    1 + spread times the nominal step time (0.1: the slowest is 10% slower)."""
    stall_prob: float = 0.0
    """Probability that a replica stalls in a step (random stalls, independent)."""
    stall_s: float = 0.0
    """Seconds one stall lasts."""
    overlap_cpu_s: float = 0.0
    """Seconds of compute slowdown per sync round that runs beside the compute (layer-wise,
    ``overlap > 0``, eager, non-blocking aedit; not a blocking round): the communication
    thread's CPU work (statistics, quantisation, the outer step, the collectives' own
    copies) taking the cores from the training. 0 on GPUs, whose compute does not share
    the host's cores with the communication; calibration fits it on a CPU machine
    (``docs/planning.md``, section Calibration from a run)."""
    ft_quorum_ms: float = 20.0
    """Milliseconds a torchft quorum costs per sync round (``ft = true`` methods)."""

    def __post_init__(self) -> None:
        self.nodes = _count(self.nodes, "cluster.nodes")
        self.gpus_per_node = _count(self.gpus_per_node, "cluster.gpus_per_node")
        if self.nodes * self.gpus_per_node > MAX_GPUS:
            raise _fail("cluster.nodes", f"{self.nodes:,} nodes x {self.gpus_per_node:,} GPUs "
                        f"is more than the {MAX_GPUS:,} GPUs the planner models (it follows "
                        "every replica)")
        self.inter_node_gbps = _positive(self.inter_node_gbps, "cluster.inter_node_gbps")
        self.intra_node_gbps = _positive(self.intra_node_gbps, "cluster.intra_node_gbps")
        self.inter_node_latency_ms = _non_negative(self.inter_node_latency_ms,
                                                   "cluster.inter_node_latency_ms")
        self.intra_node_latency_us = _non_negative(self.intra_node_latency_us,
                                                   "cluster.intra_node_latency_us")
        self.step_overhead_s = _non_negative(self.step_overhead_s, "cluster.step_overhead_s")
        _choice(self.latency_per, "cluster.latency_per", LATENCY_MODES)
        self.straggler_spread = _non_negative(self.straggler_spread, "cluster.straggler_spread")
        p = self.stall_prob = _non_negative(self.stall_prob, "cluster.stall_prob")
        if p > 1:
            raise _fail("cluster.stall_prob", f"must be <= 1, got {spelled(self.stall_prob)}")
        self.stall_s = _non_negative(self.stall_s, "cluster.stall_s")
        self.overlap_cpu_s = _non_negative(self.overlap_cpu_s, "cluster.overlap_cpu_s")
        self.ft_quorum_ms = _non_negative(self.ft_quorum_ms, "cluster.ft_quorum_ms")
        if self.gpu_memory_gb is not None:
            self.gpu_memory_gb = _positive(self.gpu_memory_gb, "cluster.gpu_memory_gb")
        self._check_measured_job()
        if self.step_time_s is not None:
            self.step_time_s = _positive(self.step_time_s, "cluster.step_time_s")
        else:
            if self.gpu_peak_tflops is None:
                raise _fail("cluster.gpu_peak_tflops", "missing: give gpu_peak_tflops and "
                            "mfu, or a measured step_time_s")
            if self.mfu is None:
                raise _fail("cluster.mfu", "missing: give mfu (with gpu_peak_tflops) or a "
                            "measured step_time_s")
        if self.gpu_peak_tflops is not None:
            self.gpu_peak_tflops = _positive(self.gpu_peak_tflops, "cluster.gpu_peak_tflops")
        if self.mfu is not None:
            m = self.mfu = _positive(self.mfu, "cluster.mfu")
            if m > 1:
                raise _fail("cluster.mfu", f"must be <= 1 (a share of the peak), got {spelled(m)}")

    def _check_measured_job(self) -> None:
        """``step_time_flops`` and ``step_time_gpus`` come together and with the
        ``step_time_s`` they describe."""
        given = [name for name in ("step_time_flops", "step_time_gpus")
                 if getattr(self, name) is not None]
        if not given:
            return
        if self.step_time_s is None:
            raise _fail(f"cluster.{given[0]}", "describes the job step_time_s was measured "
                        "on: give step_time_s with it, or leave it out")
        if len(given) == 1:
            missing = "step_time_gpus" if given[0] == "step_time_flops" else "step_time_flops"
            raise _fail(f"cluster.{missing}", f"missing: give it with {given[0]} (the "
                        "measured job's FLOPs per step and GPUs per replica go together)")
        self.step_time_flops = _positive(self.step_time_flops, "cluster.step_time_flops")
        self.step_time_gpus = _count(self.step_time_gpus, "cluster.step_time_gpus")

    @property
    def gpus(self) -> int:
        """GPUs in the whole cluster."""
        return self.nodes * self.gpus_per_node

    @property
    def inter_bytes_per_s(self) -> float:
        """Inter-node bandwidth per node, bytes per second."""
        return self.inter_node_gbps * GBIT

    @property
    def inter_latency_s(self) -> float:
        """Inter-node latency, seconds."""
        return self.inter_node_latency_ms / 1000.0

    def with_(self, **changes: Any) -> Cluster:
        """A copy with fields replaced (validated again)."""
        return dataclasses.replace(self, **changes)


SHAPE_FIELDS = {"layers": "n_layers", "dim": "dim", "heads": "n_heads",
                "kv_heads": "n_kv_heads", "ffn_hidden": "ffn_hidden",
                "tie_embeddings": "tie_embeddings"}
"""The plan's shape fields and the training option (``model.X``) each one is, for a preset."""
MODEL_SOURCES = ("preset", "hf_config", "init_from", "params")
"""The [model] fields that name which model is planned (exactly one is given)."""


@dataclass
class ModelSpec:
    """The model and the batch. Give ``preset`` (an editrain preset: tiny, small, 350m,
    1b, 3b, 7b; the shape fields override it as training's ``model.n_layers``... do),
    ``hf_config`` (a Hugging Face ``config.json``), ``init_from`` (a Hugging Face model
    directory) or ``params`` and ``layers`` (with ``dim`` for activations). The model is
    the one ``editrain train`` would build from the same options
    (:func:`training_section`)."""

    preset: str | None = None
    """An editrain model preset."""
    hf_config: str | None = None
    """Path of a Hugging Face ``config.json``, as training's ``model.hf_config`` (the
    model, its vocabulary included, is the file's)."""
    init_from: str | None = None
    """A Hugging Face model directory, as training's ``model.init_from``: the shape (its
    vocabulary included) is its ``config.json``'s."""
    params: float | None = None
    """Parameter count (with ``layers``; the blocks hold them, split evenly)."""
    layers: int | None = None
    """Transformer blocks (with a preset: training's ``model.n_layers``)."""
    dim: int | None = None
    """Model width (with a preset: training's ``model.dim``; with ``params``: activations
    and attention FLOPs, default from ``params`` and ``layers``)."""
    vocab_size: int | None = None
    """Vocabulary (presets: their own, or what editrain's tokenizer gives; not with
    hf_config or init_from, whose file sets it)."""
    heads: int | None = None
    """Attention heads (with a preset: training's ``model.n_heads``; with ``params``:
    activation memory)."""
    kv_heads: int | None = None
    """Presets: key/value heads (training's ``model.n_kv_heads``)."""
    ffn_hidden: int | None = None
    """Presets: SwiGLU hidden size (training's ``model.ffn_hidden``)."""
    seq_len: int = 2048
    """Tokens per sequence."""
    batch_size: int = 32
    """Sequences per replica per optimizer step (all of its data-parallel ranks)."""
    micro_batch: int | None = None
    """Sequences per GPU per forward (gradient accumulation); default: all of them."""
    dtype: str = "bf16"
    """Training precision of parameters and gradients (fp32 or bf16; optimizer state is
    fp32 either way)."""
    tie_embeddings: bool | None = None
    """Presets: override whether the output projection reuses the embedding (training's
    ``model.tie_embeddings``)."""
    activation_checkpointing: bool = False
    """Recompute activations in the backward (one layer's kept, 4/3 of the compute)."""

    def __post_init__(self) -> None:
        given = [n for n in MODEL_SOURCES if getattr(self, n) is not None]
        if len(given) != 1:
            raise _fail("model", "give exactly one of preset, hf_config, init_from or params "
                        f"(with layers); got {', '.join(given) or 'none'}")
        for name in ("layers", "dim", "vocab_size", "heads", "kv_heads", "ffn_hidden",
                     "micro_batch"):
            if getattr(self, name) is not None:
                setattr(self, name, _count(getattr(self, name), f"model.{name}"))
        if self.layers is not None and self.layers > MAX_LAYERS:
            raise _fail("model.layers", f"must be at most {MAX_LAYERS:,} (the plan follows "
                        f"every block's sync), got {self.layers:,}")
        if self.preset is not None:
            self._check_preset()
        if self.hf_config is not None or self.init_from is not None:
            self._check_file_shape()
        if self.params is not None:
            self.params = _positive(self.params, "model.params")
            if self.layers is None:
                raise _fail("model.layers", "missing: params needs layers")
            for name in ("kv_heads", "ffn_hidden", "tie_embeddings"):
                if getattr(self, name) is not None:
                    raise _fail(f"model.{name}", "overrides a preset's shape: give preset, "
                                "or leave it out with params")
        self.seq_len = _count(self.seq_len, "model.seq_len")
        self.batch_size = _count(self.batch_size, "model.batch_size")
        _choice(self.dtype, "model.dtype", DTYPES)

    def _check_preset(self) -> None:
        """The preset exists and its overrides make a model training can build."""
        from editrain.config import PRESETS
        from editrain.config.model import section_model_config

        _choice(self.preset, "model.preset", PRESETS)
        section_model_config(training_section(self), self.vocab_size)

    def _check_file_shape(self) -> None:
        """hf_config and init_from: the file exists, and no field overrides its shape
        (training refuses them too: the model is the file's)."""
        option = "hf_config" if self.hf_config is not None else "init_from"
        if self.hf_config is not None and not Path(self.hf_config).exists():
            raise _fail("model.hf_config", f"file not found: {shown(self.hf_config)}")
        if self.init_from is not None and not Path(self.init_from).is_dir():
            raise _fail("model.init_from", f"not a directory: {shown(self.init_from)}")
        for name in (*SHAPE_FIELDS, "vocab_size"):
            if getattr(self, name) is not None:
                raise _fail(f"model.{name}", f"the model's shape comes from model.{option} "
                            "(as training builds it); remove it")

    @property
    def label(self) -> str:
        """The model's name in the plan's header: the preset with its overrides, the file,
        or ``custom``."""
        if self.preset is not None:
            changed = [f"{name}={getattr(self, name)}" for name in SHAPE_FIELDS
                       if getattr(self, name) is not None]
            return self.preset + (f" ({', '.join(changed)})" if changed else "")
        return self.hf_config or self.init_from or "custom"


def training_section(spec: ModelSpec) -> Any:
    """The ``[model]`` section of ``editrain train`` that builds the model of ``spec``
    (a preset with its overrides, ``model.hf_config`` or ``model.init_from``), so that the
    plan reads the shape with training's own functions (:mod:`editrain.config.model`).

    Args:
        spec: a model given by preset, hf_config or init_from (not by params).
    """
    from editrain.config.schema import ModelSection

    shape = {option: getattr(spec, name) for name, option in SHAPE_FIELDS.items()}
    return ModelSection(preset=spec.preset or ModelSection.preset, hf_config=spec.hf_config,
                        init_from=spec.init_from, **shape)


@dataclass
class MethodSpec:
    """One method setting to plan (the ``sync`` options of ``editrain train``)."""

    method: str = "edit"
    """sync, post_local_sgd, diloco, edit or aedit."""
    name: str | None = None
    """Label in the table (default: built from the settings)."""
    H: int = 32
    """Inner steps per round (``sync.local_sgd_sync_interval``)."""
    fragments: int = 1
    """Fragments that take turns (``sync.fragments``)."""
    overlap: int = 0
    """Inner steps a round runs behind (``sync.overlap_steps``)."""
    codec: str = "fp32"
    """Wire format of pseudo-gradients (``sync.comm_dtype``; fp4 for planning only)."""
    error_feedback: bool = True
    """Error feedback buffers with a low-precision codec (``sync.error_feedback``)."""
    cpu_offload: bool = False
    """Anchors and outer state in host memory (``sync.cpu_offload``)."""
    layerwise: bool | None = None
    """Sync unit by unit in the next forward (default: edit and aedit yes, others no)."""
    prefetch_depth: int = 1
    """Units whose reduction may run ahead of the forward (``sync.prefetch_depth``)."""
    shard_size: int | None = None
    """GPUs per replica's FSDP2 group (default: one node's GPUs, over tp)."""
    tp: int = 1
    """Tensor-parallel degree inside a replica."""
    pp: int = 1
    """Pipeline stages per replica (``dist.pp_size``): a replica is ``pp x shard_size x
    tp`` GPUs, each stage a contiguous run of the blocks (the embeddings on the first,
    the final norm and the output on the last) on its own ``shard_size x tp`` GPUs."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule (``dist.pp_schedule``): gpipe, 1f1b or interleaved-1f1b."""
    pp_microbatches: int = 0
    """Microbatches each GPU's forward batch (``model.micro_batch``, training's
    ``train.batch_size``) is split into for the pipeline (``dist.pp_microbatches``; 0:
    ``pp``). A step runs them for each of its accumulation steps, all in one schedule."""
    pp_stages_per_rank: int = 1
    """Chunks of blocks each pipeline rank holds (``dist.pp_stages_per_rank``): >= 2 with
    interleaved-1f1b, 1 with gpipe and 1f1b."""
    sync_time_s: float | None = None
    """aedit: seconds per window (default: H nominal step times)."""
    ft: bool = False
    """torchft fault-tolerant rounds (``--ft``): blocking, with a quorum per round."""
    eager: bool = False
    """The eager merge (``sync.merge = "eager"``, ``docs/streaming.md`` section 3c): a
    round may take a whole inner phase, the Eager Updates paper's one-outer-step overlap."""
    grad_overlap: bool = False
    """sync: reduce each unit's gradient during the backward (DDP-style); editrain's sync
    reduces after the backward (false)."""
    outer_momentum: bool | None = None
    """The outer optimizer keeps a momentum buffer (an fp32 copy of the shard). Default:
    editrain's own outer SGD for the setting (``sync/methods.py``): yes for diloco
    (Nesterov), no for edit and aedit (SGD at lr 1 without momentum), for the sparse codecs
    and for the eager merge."""

    def __post_init__(self) -> None:
        p = "method"
        _choice(self.method, f"{p}.method", METHODS)
        self.H = _count(self.H, f"{p}.H")
        self.fragments = _count(self.fragments, f"{p}.fragments")
        self.overlap = _count(self.overlap, f"{p}.overlap", least=0)
        _choice(self.codec, f"{p}.codec", CODECS)
        self.prefetch_depth = _count(self.prefetch_depth, f"{p}.prefetch_depth", least=0)
        self.tp = _count(self.tp, f"{p}.tp")
        if self.shard_size is not None:
            self.shard_size = _count(self.shard_size, f"{p}.shard_size")
        if self.sync_time_s is not None:
            self.sync_time_s = _positive(self.sync_time_s, f"{p}.sync_time_s")
        self._check_pipeline()
        if self.fragments > self.H:
            raise _fail(f"{p}.fragments", f"must be <= H ({self.H}), got {self.fragments}")
        if self.overlap >= self.H and not self.eager:
            raise _fail(f"{p}.overlap", f"must be < H ({self.H}), got {self.overlap}")
        if self.method == "aedit" and self.fragments != 1:
            raise _fail(f"{p}.fragments", "aedit syncs every unit at once: must be 1")
        if self.method in ("sync", "post_local_sgd") and self.codec != "fp32":
            raise _fail(f"{p}.codec", f"{self.method} reduces in fp32 only, got {self.codec}")
        if self.layerwise is None:
            self.layerwise = self.method in ("edit", "aedit") and not self.ft
        if self.outer_momentum is None:  # the sparse codecs and eager: plain SGD
            self.outer_momentum = (OUTER_SGD.get(self.method, {}).get("momentum", 0) > 0
                                   and not self.eager and not self.codec.startswith("topk"))

    def _check_pipeline(self) -> None:
        """The pipeline options training accepts, as far as they do not depend on the
        model and the batch (:func:`editrain.plan.pipeline.check_pipeline` checks those):
        a schedule it knows, chunks per rank that suit the schedule, and 1F1B's
        microbatches at least the stages."""
        p = "method"
        self.pp = _count(self.pp, f"{p}.pp")
        _choice(self.pp_schedule, f"{p}.pp_schedule", PP_SCHEDULES)
        self.pp_microbatches = _count(self.pp_microbatches, f"{p}.pp_microbatches", least=0)
        self.pp_stages_per_rank = _count(self.pp_stages_per_rank, f"{p}.pp_stages_per_rank")
        v = self.pp_stages_per_rank
        if self.pp == 1:
            if v != 1 or self.pp_microbatches:
                name = "pp_stages_per_rank" if v != 1 else "pp_microbatches"
                raise _fail(f"{p}.{name}", f"needs pipeline stages (method.pp > 1), got "
                            f"{getattr(self, name)} with pp = 1")
            return
        interleaved = self.pp_schedule == "interleaved-1f1b"
        if interleaved and v < 2:
            raise _fail(f"{p}.pp_stages_per_rank", "must be >= 2 with pp_schedule = "
                        f"interleaved-1f1b (each rank holds that many chunks), got {v}")
        if not interleaved and v != 1:
            raise _fail(f"{p}.pp_stages_per_rank", f"must be 1 with pp_schedule = "
                        f"{self.pp_schedule} (one stage per rank; chunks need "
                        f"interleaved-1f1b), got {v}")
        if self.pp_schedule == "1f1b" and self.microbatches < self.pp:
            raise _fail(f"{p}.pp_microbatches", f"pp_schedule = 1f1b needs at least pp "
                        f"({self.pp}) microbatches, got {self.microbatches}; use more "
                        "microbatches or pp_schedule = gpipe")

    @property
    def microbatches(self) -> int:
        """``pp_microbatches`` with its default (0) resolved: ``pp``, as training's."""
        return self.pp_microbatches or self.pp

    @property
    def label(self) -> str:
        """The table's name for this setting."""
        if self.name:
            return self.name
        if self.method == "sync":
            return "sync" + self._pipeline_label()
        parts = [self.method, f"H={self.H}"]
        if self.fragments > 1:
            parts.append(f"P={self.fragments}")
        if self.eager:
            parts.append("eager")
        elif self.overlap:
            parts.append(f"tau={self.overlap}")
        if self.codec != "fp32":
            parts.append(self.codec)
        if self.ft:
            parts.append("ft")
        return " ".join(parts) + self._pipeline_label()

    def _pipeline_label(self) -> str:
        """`` pp=4 1f1b m=8`` (and ``v=2`` interleaved) with stages; empty without."""
        if self.pp == 1:
            return ""
        text = f" pp={self.pp} {self.pp_schedule} m={self.microbatches}"
        return text + (f" v={self.pp_stages_per_rank}" if self.pp_stages_per_rank > 1 else "")

    @property
    def local(self) -> bool:
        """Whether the method syncs every H steps (not every step)."""
        return self.method != "sync"

    @property
    def overlapped_steps(self) -> int:
        """Inner steps a round runs beside after its launch: ``overlap`` (``H`` when eager),
        plus the forward it is merged in when layer-wise; 0 for a blocking round and for
        sync (whose gradient reduction waits for nothing to compute)."""
        if not self.local:
            return 0
        steps = self.H if self.eager else self.overlap
        return steps + (1 if self.layerwise and not self.eager else 0)

    @property
    def overlapping_rounds_per_step(self) -> float:
        """Rounds per inner step that run beside the compute (``fragments / H``; 0 when
        :attr:`overlapped_steps` is 0)."""
        return self.fragments / self.H if self.overlapped_steps else 0.0


def _build(cls: type, data: dict[str, Any], section: str) -> Any:
    """``cls(**data)`` with unknown keys named (one line)."""
    if not isinstance(data, dict):
        raise _fail(section, f"must be a table, got {spelled(data)}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise _fail(f"{section}.{unknown[0]}",
                    f"unknown field; allowed: {', '.join(sorted(names))}")
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    for name in required:
        if name not in data:
            raise _fail(f"{section}.{name}", "missing (required)")
    try:
        return cls(**data)
    except TypeError as e:  # a wrong value type that __post_init__ did not catch
        raise _fail(section, str(e)) from None


def parse_method(spec: str) -> dict[str, Any]:
    """A method setting from the command line: ``edit``, ``edit:H=64,fragments=4,codec=int8``.

    Every entry after the colon is ``key=value`` with both sides given: an empty entry
    (``H=5,,fragments=2``, a trailing comma), a missing key (``=5``) or value (``H=``) is
    refused naming the spec, never skipped. A key given twice keeps its last value, as an
    option given twice does (:mod:`editrain.argv`).

    Args:
        spec: the method name, then optional ``key=value`` pairs after a colon.

    Returns:
        The fields of a :class:`MethodSpec` (values parsed as TOML scalars, bare words as
        strings).

    Raises:
        ConfigError: ``"method: SPEC: ..."`` naming the malformed entry.
    """
    name, colon, rest = spec.partition(":")
    out: dict[str, Any] = {"method": name.strip()}
    if not colon:
        return out
    for item in (x.strip() for x in rest.split(",")):
        key, eq, value = (part.strip() for part in item.partition("="))
        if not (eq and key and value):
            got = f"entry {spelled(item)}" if item else "an empty entry"
            raise _fail("method", f"{spelled(spec)}: expected NAME:key=value,key=value (every "
                                  f"entry a key and its value), got {got}")
        out[key] = parse_scalar(value)
    return out


def parse_scalar(text: str) -> Any:
    """A TOML scalar (``4``, ``0.5``, ``true``), or the text itself
    (:func:`editrain.safe_io.parse_toml_scalar`)."""
    return parse_toml_scalar(text)


@dataclass
class PlanInputs:
    """Everything one plan needs."""

    cluster: Cluster
    model: ModelSpec
    methods: list[MethodSpec] = field(default_factory=list)


PLAN_MAX_BYTES = 16 << 20
"""The largest plan configuration read (one is a few hundred bytes)."""


def load_inputs(path: str | Path | None = None, overrides: dict[str, dict[str, Any]] | None = None,
                methods: list[str] | None = None) -> PlanInputs:
    """Read a plan file and apply command-line values over it.

    Args:
        path: a TOML file with ``[cluster]``, ``[model]`` and ``[[method]]`` tables.
        overrides: ``{"cluster": {...}, "model": {...}}`` applied over the file.
        methods: method specs (:func:`parse_method`) replacing the file's ``[[method]]``.

    Raises:
        ConfigError: naming the field of the first bad value.
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"plan: file not found: {shown(p)}")
        # the user's file: a link to it is followed (their choice), its size bounded
        data = read_toml(p, max_bytes=PLAN_MAX_BYTES, where=f"plan: {shown(p)}", option="plan",
                         error=ConfigError, what="plan configuration", follow=True)
    unknown = sorted(set(data) - {"cluster", "model", "method"})
    if unknown:
        raise _fail(unknown[0], "unknown table; allowed: cluster, model, method")
    overrides = overrides or {}
    cluster_data = {**data.get("cluster", {}), **overrides.get("cluster", {})}
    if not cluster_data:
        raise _fail("cluster", "missing: give a [cluster] table (see `editrain plan --help`)")
    model_data = {**data.get("model", {}), **overrides.get("model", {})}
    if not model_data:
        model_data = {"preset": "1b"}
    cluster = _build(Cluster, cluster_data, "cluster")
    model = _build(ModelSpec, model_data, "model")
    specs = [parse_method(m) for m in methods] if methods else data.get("method", [])
    if isinstance(specs, dict):
        specs = [specs]
    if not specs:
        specs = [{"method": m} for m in ("sync", "diloco", "edit")]
    return PlanInputs(cluster, model, [_build(MethodSpec, s, "method") for s in specs])


__all__ = ["CODECS", "Cluster", "GBIT", "METHODS", "MODEL_SOURCES", "MethodSpec", "ModelSpec",
           "PP_SCHEDULES", "PlanInputs", "SHAPE_FIELDS", "load_inputs", "parse_method", "training_section"]
