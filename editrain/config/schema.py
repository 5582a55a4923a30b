"""The configuration's schema: one dataclass per section, its defaults and allowed values.

Every field carries a one-line docstring below it (it becomes ``editrain options`` text and
the generated configuration reference, :mod:`editrain.config.describe`). The checks of the
values live in :mod:`editrain.config.validation`; the ``sync`` section is
:class:`editrain.sync.config.SyncConfig`, which checks itself when it is constructed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from editrain.sync.config import SyncConfig

PRESETS = ("tiny", "small", "350m", "1b", "3b", "7b")
PRECISIONS = ("fp32", "bf16")
OPTIMIZERS = ("adamw", "agd", "sgd")
SAMS = ("none", "wsam")
BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")
FAULT_TOLERANCE = ("none", "torchft")
PP_SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b")

SEED_MAX = 2**63 - 1
"""Largest seed: torch, numpy and the data order take a seed as a non-negative int64."""


@dataclass
class ModelSection:
    """Model shape."""

    preset: str = "small"
    """Named shape: tiny, small, 350m, 1b, 3b, 7b."""
    dim: int | None = None
    """Override the preset's hidden size."""
    n_layers: int | None = None
    """Override the preset's number of transformer blocks."""
    n_heads: int | None = None
    """Override the preset's number of attention heads."""
    n_kv_heads: int | None = None
    """Override the preset's number of key/value heads (grouped-query attention)."""
    ffn_hidden: int | None = None
    """Override the preset's SwiGLU hidden size."""
    max_seq_len: int | None = None
    """Override the preset's maximum sequence length."""
    tie_embeddings: bool | None = None
    """Override whether the LM head shares the embedding matrix."""
    hf_config: str | None = None
    """A Hugging Face config.json (or hf:ORG/NAME[@REVISION]: the config of a model in the
    Hugging Face hub cache): train that model from scratch instead (needs transformers)."""
    init_from: str | None = None
    """A local Hugging Face model directory (config.json and model.safetensors, or shards
    with model.safetensors.index.json), or hf:ORG/NAME[@REVISION], a model already in the
    Hugging Face hub cache (HF_HOME; never downloaded): its shape, weights and tokenizer
    files seed step 0 (a LlamaForCausalLM trains as editrain's Llama, other architectures
    through transformers); --resume still restores the run."""

    def overrides(self) -> dict[str, Any]:
        """The preset overrides that were set."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("preset", "hf_config", "init_from")
                and getattr(self, f.name) is not None}


@dataclass
class DataSection:
    """Corpus and tokenizer."""

    path: str | list[str] = "default"
    """Corpus: "default" (the running Python's standard library and pydoc topics), a text
    file, a directory, a .jsonl/.json/.parquet file, a glob, hf:NAME[:CONFIG][@SPLIT] (a
    Hugging Face dataset in the local cache), a save_to_disk directory[@SPLIT], or a list
    of these. Text, .jsonl and .json files may be compressed (.gz, .bz2, .xz, .zst)."""
    text_field: str = "text"
    """Field or column holding the text in .jsonl, .json, .parquet and datasets; input_ids reads a .parquet or save_to_disk dataset as pre-tokenised rows of ids."""
    eos: str = "append"
    """End-of-text token between documents: append (after each), prepend (before each) or
    none (documents concatenated; a data.tokenizer without an end-of-text token needs
    it)."""
    separator: str | None = None
    """Text that separates documents inside text files (e.g. "<|endoftext|>" for a corpus
    concatenated into one file, "\n\n" for paragraphs): each file is read in chunks and
    cut there, so memory holds one document at a time, and documents are held out and
    deduplicated one by one; none (default): every text file is one document."""
    tokenizer: str | None = None
    """A tokenizer.json, or a model directory holding one (its tokenizer_config.json names
    the end-of-text token; hf:ORG/NAME[@REVISION]: one in the Hugging Face hub cache), to
    use instead of training a byte-level BPE on the corpus (default with model.init_from:
    that directory's tokenizer, where it has one)."""
    vocab_size: int = 8192
    """Vocabulary size of the trained BPE tokenizer (>= 257)."""
    val_fraction: float = 0.01
    """Share of the corpus (bytes) held out for validation, in (0, 0.5); whole documents,
    near-duplicate families kept on one side."""
    val_tokens: int = 65_536
    """Hold out at least this many validation tokens (at most 30% of the corpus)."""
    split_seed: int = 0
    """Seed of the choice of validation documents (0 to 2^63 - 1)."""
    max_bytes: int | str | None = "auto"
    """Read at most this many bytes of the corpus: a number, none (all of it) or auto (all of
    a corpus data.path names, 8000000 of the embedded default corpus)."""
    cache_dir: str = "~/.cache/editrain"
    """Where tokenised corpora and tokenizers are cached, keyed by content."""


@dataclass
class TrainSection:
    """The inner training loop."""

    steps: int = 80
    """Inner optimizer steps per replica (the token budget of this many synchronous steps)."""
    batch_size: int = 8
    """Sequences per micro-batch, per rank."""
    seq_len: int = 64
    """Tokens per training sequence."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per inner optimizer step."""
    lr: float = 3e-3
    """Peak learning rate of the inner optimizer."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine schedule, as a fraction of lr."""
    warmup_steps: int = 20
    """Linear learning-rate warm-up steps."""
    weight_decay: float = 0.1
    """Decoupled weight decay of the inner optimizer."""
    beta1: float = 0.9
    """Inner optimizer first-moment coefficient."""
    beta2: float = 0.95
    """Inner optimizer second-moment coefficient."""
    grad_clip: float = 1.0
    """Clip the gradient norm to this value (0: off)."""
    eval_every: int = 20
    """Evaluate validation loss about every this many steps (at the next sync for local SGD)."""
    eval_tokens: int = 8192
    """Evaluate at the start and during the run on about this many validation tokens, whole
    windows spread over the split (0: all of it)."""
    final_eval_tokens: int = 0
    """Evaluate at the end of the run (and at an elastic resume) on about this many
    validation tokens (0: the whole held-out split, the figure to compare runs by)."""
    log_every: int = 1
    """Write a metrics row every this many steps."""
    wandb: str = "off"
    """Weights & Biases: off, offline (the run in RUN_DIR/wandb; wandb sync uploads it) or
    online (pip install 'editrain[wandb]'; WANDB_MODE, if set, wins)."""
    wandb_project: str = "editrain"
    """The W&B project of the run (WANDB_PROJECT, if set, wins)."""
    seed: int = 0
    """Seed of model init, data order and every random choice (0 to 2^63 - 1)."""
    precision: str = "fp32"
    """Compute precision: fp32 or bf16 (parameters and anchors stay fp32)."""


@dataclass
class OptimSection:
    """Inner optimizer."""

    name: str = "adamw"
    """Inner optimizer: adamw, agd or sgd."""
    momentum: float = 0.9
    """SGD momentum."""
    agd_delta: float = 1e-14
    """AGD auto-switch threshold delta."""
    sam: str | None = None
    """Wrap the inner optimizer with sharpness-aware minimisation: none or wsam."""
    rho: float = 0.05
    """WSAM neighbourhood size."""
    gamma: float = 0.9
    """WSAM sharpness weight (alpha = gamma / (1 - gamma))."""
    adaptive: bool = False
    """WSAM: scale the perturbation by |p| (adaptive SAM)."""
    decouple: bool = True
    """WSAM: apply the sharpness term separately from the base optimizer step."""


@dataclass
class DistSection:
    """Processes and topology."""

    nproc: int = 4
    """Local worker processes started by `editrain train` (ignored under torchrun)."""
    shard_size: int = 2
    """FSDP2 ranks per replica (the shard group); shard_size x tp_size must divide the
    world size."""
    tp_size: int = 1
    """Tensor-parallel ranks per shard (Megatron split of every block over a "tp" mesh
    dimension; a replica is shard_size x tp_size ranks); must divide the model's query and
    key/value heads. 1: no tensor parallelism."""
    pp_size: int = 1
    """Pipeline stages per replica (each stage a contiguous run of the model's blocks on
    its own shard_size x tp_size ranks; a replica is pp_size x shard_size x tp_size ranks);
    at most the model's layers, untied embeddings: the built-in Llama or a model.hf_config
    model of model_type llama, mistral, qwen2 or qwen3. 1: no pipeline."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule: 1f1b (backwards start as soon as the last stage has a loss;
    needs pp_microbatches >= pp_size), gpipe (every forward, then every backward) or
    interleaved-1f1b (1F1B over pp_stages_per_rank >= 2 chunks of blocks per rank, rank r
    holding chunks r, r + pp_size, ...: a smaller bubble; pp_microbatches a multiple of
    max(1, pp_microbatches // pp_size))."""
    pp_microbatches: int = 0
    """Microbatches each step's batch is split into for the pipeline (must divide
    train.batch_size; 0: pp_size). With gradient accumulation every micro-batch is split
    alike, so a step runs gradient_accumulation_steps x pp_microbatches of them."""
    pp_stages_per_rank: int = 1
    """Chunks of blocks each pipeline rank holds: >= 2 with pp_schedule =
    interleaved-1f1b (the model is split into pp_size x pp_stages_per_rank chunks, at most
    its layers), 1 with gpipe and 1f1b."""
    backend: str = "auto"
    """Process group backend: auto (nccl on CUDA, gloo on CPU), gloo or nccl."""
    device: str = "auto"
    """Device type: auto, cpu or cuda."""
    max_restarts: int = 0
    """Restart all local workers this many times when one fails (torch elastic)."""
    threads_per_proc: int = 0
    """Intra-op threads per worker (0: cores / local processes, at least 1)."""
    comm_backend: str = "auto"
    """Backend of the sync engine's own cross-replica and statistics groups: auto (gloo;
    on CUDA staged through pinned host memory, so NCCL only ever runs the main thread's
    collectives: docs/architecture.md), gloo, nccl or default (the process group's)."""
    fault_tolerance: str = "none"
    """none (one torch.distributed job; a dead worker stops it) or torchft (every replica a
    job of its own meeting through a torchft lighthouse: a replica can die and rejoin
    while the others train on; docs/fault_tolerance.md). `editrain train --ft` sets it."""
    ft_replicas: int = 0
    """torchft: replica groups in the run (0: dist.nproc / (pp_size x shard_size x
    tp_size), the local launcher's groups). Under torchrun each group is its own job: set it, with
    ft_replica_id and ft_lighthouse."""
    ft_replica_id: int = -1
    """torchft: this job's replica group, 0 .. ft_replicas - 1 (-1: $EDITRAIN_FT_REPLICA,
    which `editrain train --ft` sets)."""
    ft_lighthouse: str = ""
    """torchft: lighthouse address, http://HOST:PORT ("": $TORCHFT_LIGHTHOUSE, or a
    lighthouse `editrain train --ft` starts)."""
    ft_min_replicas: int = 1
    """torchft: a sync commits only with at least this many replicas present."""
    ft_heartbeat_timeout_s: float = 5.0
    """torchft: a replica silent for this long is dropped from the next quorum (the
    survivors' next sync waits at most this long after a replica dies)."""
    ft_heartbeat_interval_s: float = 0.1
    """torchft: how often each replica group tells the lighthouse it is alive, and how
    often the lighthouse re-checks a pending quorum (at most half the heartbeat timeout)."""
    ft_join_timeout_s: float = 60.0
    """torchft: how long a quorum waits for replicas that are alive but not yet at the
    sync (also how long a lone restarted replica waits for the others)."""
    ft_timeout_s: float = 60.0
    """torchft: cross-replica collectives, commit votes and state transfers fail after
    this long."""

    @property
    def replica_size(self) -> int:
        """Ranks of one replica (``pp_size x shard_size x tp_size``): with ``--ft``, one
        replica group's job."""
        return self.pp_size * self.shard_size * self.tp_size

    @property
    def microbatches(self) -> int:
        """``pp_microbatches``, its default (0) resolved: ``pp_size``."""
        return self.pp_microbatches or self.pp_size


@dataclass
class SimSection:
    """Simulated cluster heterogeneity (all off by default)."""

    link_bandwidth: str | None = None
    """Cross-replica link bandwidth, e.g. 100MB/s or 1Gbit/s, from 1B/s to 1PB/s (none:
    unlimited)."""
    link_latency: str | None = None
    """Cross-replica link latency per message, e.g. 5ms, from 0 to 3600 s."""
    straggler: list[str] = field(default_factory=list)
    """Slow replicas: REPLICA=FACTOR or REPLICA=FACTOR@FROM-TO (steps), FACTOR from 1 to
    1000."""
    random_stall: str | None = None
    """Random stalls: PROB,SECONDS (each step of each replica stalls with probability PROB
    in [0, 1] for SECONDS, from 0 to 3600)."""
    corrupt_replica: list[str] = field(default_factory=list)
    """Corrupt a replica's update at a sync: REPLICA@SYNC or REPLICA@SYNC:SCALE (SCALE from
    -1e6 to 1e6, default 30)."""
    fail: str | None = None
    """Kill a worker on the first attempt: RANK@STEP (abrupt exit after that step) or
    RANK@STEP:checkpoint (exit in the middle of writing that step's checkpoint). RANK is a
    data rank, replica x dist.shard_size + shard (its tensor-parallel peers and pipeline
    stages die with it), STEP
    from 1 to train.steps. With --ft the worker's whole replica group dies and restarts
    after sim.fail_restart_s. A --resume of the run does not fail again unless told so."""
    fail_restart_s: float = 0.0
    """--ft: seconds before a replica group killed by sim.fail is started again (0 to
    3600)."""
    step_schedule: list[int] = field(default_factory=list)
    """A-EDiT: replica r syncs after step_schedule[r] steps instead of on the clock
    (reproducible experiments and tests)."""
    replica_offset: int = 0
    """Replica r of this run is replica r + replica_offset of the simulated cluster (its
    stragglers and random-stall stream): a single-replica run then measures one replica of
    a larger simulated run alone (the benchmarks' solo runs)."""


@dataclass
class CheckpointSection:
    """Checkpoints."""

    every: int = 0
    """Save a checkpoint about every this many steps (0: only at the end if `final` is
    set); local SGD saves at the first sync at or after each point, where the replicas
    agree (none before the first sync)."""
    keep: int = 2
    """Keep this many most recent checkpoints."""
    final: bool = True
    """Save a checkpoint at the end of the run."""
    export_final: bool = False
    """At the end of the run, export the global model as a Hugging Face directory into
    RUN_DIR/export (what `editrain export` writes)."""


@dataclass
class Config:
    """A complete run configuration."""

    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    optim: OptimSection = field(default_factory=OptimSection)
    dist: DistSection = field(default_factory=DistSection)
    sync: SyncConfig = field(default_factory=SyncConfig)
    sim: SimSection = field(default_factory=SimSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    run_dir: str | None = None
    """Run directory (default runs/<timestamp>)."""
    overwrite: bool = False
    """Allow writing into a run directory that holds a different run."""
    quiet: bool = False
    """No progress bar; log only warnings and the final summary."""
    resume: str | None = None
    """Resume from a run directory (its latest complete checkpoint) or a checkpoint path."""


SECTIONS = ("model", "data", "train", "optim", "dist", "sync", "sim", "checkpoint")
"""The sections of :class:`Config`, in the order they are checked and written."""
