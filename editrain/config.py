"""Run configuration: dataclasses per section, TOML files, ``--section.key=value`` overrides.

Every field carries a one-line docstring (it becomes ``--help`` text and the generated
configuration reference). Every value is validated before any process starts, with a
message that names the option and what is allowed.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from editrain.errors import ConfigError
from editrain.sync.config import SyncConfig


def _req(cond: bool, option: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{option}: {msg}")


PRESETS = ("tiny", "small", "350m", "1b", "3b", "7b")
PRECISIONS = ("fp32", "bf16")
OPTIMIZERS = ("adamw", "agd", "sgd")
SAMS = ("none", "wsam")
BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")
FAULT_TOLERANCE = ("none", "torchft")


def _positive(section: Any, prefix: str, names: tuple[str, ...], least: int = 1) -> None:
    for name in names:
        value = getattr(section, name)
        _req(value >= least, f"{prefix}.{name}", f"must be {'> 0' if least == 1 else '>= 0'}"
             f", got {value}")


SEED_MAX = 2**63 - 1
"""Largest seed: torch, numpy and the data order take a seed as a non-negative int64."""


def _seed(value: int, option: str) -> None:
    _req(0 <= value <= SEED_MAX, option, f"must be in [0, 2^63 - 1] ({SEED_MAX}), got {value}")


def cuda_device_count() -> int:
    """CUDA devices this process can use (respects CUDA_VISIBLE_DEVICES); tests replace it."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


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
    """A Hugging Face config.json: train that model from scratch instead (needs transformers)."""

    def validate(self) -> None:
        """The preset exists (shape overrides are checked with the preset's config)."""
        _req(self.preset in PRESETS, "model.preset",
             f"unknown preset {self.preset!r}; allowed: {', '.join(PRESETS)}")

    def overrides(self) -> dict[str, Any]:
        """The preset overrides that were set."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("preset", "hf_config") and getattr(self, f.name) is not None}


@dataclass
class DataSection:
    """Corpus and tokenizer."""

    path: str | list[str] = "default"
    """Corpus: "default" (the running Python's standard library and pydoc topics), a text
    file, a directory, a .jsonl/.json/.parquet file, a glob, hf:NAME[:CONFIG][@SPLIT] (a
    Hugging Face dataset in the local cache), a save_to_disk directory[@SPLIT], or a list
    of these."""
    text_field: str = "text"
    """Field or column holding the text in .jsonl, .json, .parquet and datasets."""
    eos: str = "append"
    """End-of-text token between documents: append (after each), prepend (before each) or
    none (documents concatenated)."""
    tokenizer: str | None = None
    """A tokenizer.json to use instead of training a byte-level BPE on the corpus."""
    vocab_size: int = 8192
    """Vocabulary size of the trained BPE tokenizer (>= 257)."""
    val_fraction: float = 0.01
    """Share of the corpus (bytes) held out for validation, in (0, 0.5); whole documents,
    near-duplicate families kept on one side."""
    val_tokens: int = 65_536
    """Hold out at least this many validation tokens (at most 30% of the corpus)."""
    split_seed: int = 0
    """Seed of the choice of validation documents (0 to 2^63 - 1)."""
    max_bytes: int | None = 8_000_000
    """Read at most this many bytes of the corpus (none: all of it)."""
    cache_dir: str = "~/.cache/editrain"
    """Where tokenised corpora and tokenizers are cached, keyed by content."""

    def validate(self) -> None:
        """Sources exist and are of a supported kind, options in range (no data is read)."""
        from editrain.data import check_data_options

        try:
            check_data_options(self.path, self.text_field, self.eos)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        _req(self.vocab_size >= 257, "data.vocab_size",
             f"must be >= 257 (256 bytes + end-of-text), got {self.vocab_size}")
        _req(0 < self.val_fraction < 0.5, "data.val_fraction",
             f"must be in (0, 0.5), got {self.val_fraction}")
        _positive(self, "data", ("val_tokens",), least=0)
        _seed(self.split_seed, "data.split_seed")
        if self.max_bytes is not None:
            _req(self.max_bytes > 0, "data.max_bytes", f"must be > 0, got {self.max_bytes}")


@dataclass
class TrainSection:
    """The inner training loop."""

    steps: int = 200
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
    eval_every: int = 50
    """Evaluate validation loss about every this many steps (at the next sync for local SGD)."""
    eval_tokens: int = 0
    """Evaluate on about this many validation tokens, spread over the split (0: all of it)."""
    log_every: int = 1
    """Write a metrics row every this many steps."""
    seed: int = 0
    """Seed of model init, data order and every random choice (0 to 2^63 - 1)."""
    precision: str = "fp32"
    """Compute precision: fp32 or bf16 (parameters and anchors stay fp32)."""

    def validate(self) -> None:
        """Counts positive, rates and coefficients in range."""
        _positive(self, "train", ("steps", "batch_size", "seq_len",
                                  "gradient_accumulation_steps", "eval_every", "log_every"))
        _positive(self, "train", ("warmup_steps", "eval_tokens"), least=0)
        _seed(self.seed, "train.seed")
        _req(self.lr > 0, "train.lr", f"must be > 0, got {self.lr}")
        _req(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio",
             f"must be in [0, 1], got {self.min_lr_ratio}")
        _req(self.weight_decay >= 0, "train.weight_decay",
             f"must be >= 0, got {self.weight_decay}")
        _req(self.grad_clip >= 0, "train.grad_clip", f"must be >= 0, got {self.grad_clip}")
        for b in ("beta1", "beta2"):
            _req(0 <= getattr(self, b) < 1, f"train.{b}",
                 f"must be in [0, 1), got {getattr(self, b)}")
        _req(self.precision in PRECISIONS, "train.precision",
             f"allowed: {', '.join(PRECISIONS)}; got {self.precision!r}")


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

    def validate(self) -> None:
        """A known optimizer and SAM wrapper, WSAM coefficients in range."""
        _req(self.name in OPTIMIZERS, "optim.name",
             f"allowed: {', '.join(OPTIMIZERS)}; got {self.name!r}")
        _req(self.sam is None or self.sam in SAMS, "optim.sam",
             f"allowed: {', '.join(SAMS)}; got {self.sam!r}")
        _req(self.rho > 0, "optim.rho", f"must be > 0, got {self.rho}")
        _req(0 <= self.gamma < 1, "optim.gamma", f"must be in [0, 1), got {self.gamma}")


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
    """torchft: replica groups in the run (0: dist.nproc / (shard_size x tp_size), the
    local launcher's groups). Under torchrun each group is its own job: set it, with
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
        """Ranks of one replica (``shard_size x tp_size``): with ``--ft``, one replica
        group's job."""
        return self.shard_size * self.tp_size

    def validate(self) -> None:
        """Known backends and devices, and the devices they need: nccl and cuda need as
        many CUDA devices as local processes (``dist.nproc``, or torchrun's
        ``LOCAL_WORLD_SIZE``)."""
        import os

        from editrain.sync.setup import COMM_BACKENDS

        for name in ("nproc", "shard_size", "tp_size"):
            _req(getattr(self, name) >= 1, f"dist.{name}",
                 f"must be >= 1, got {getattr(self, name)}")
        _positive(self, "dist", ("max_restarts", "threads_per_proc", "ft_replicas"), least=0)
        _req(self.fault_tolerance in FAULT_TOLERANCE, "dist.fault_tolerance",
             f"allowed: {', '.join(FAULT_TOLERANCE)}; got {self.fault_tolerance!r}")
        _req(self.ft_replica_id >= -1, "dist.ft_replica_id",
             f"must be >= 0 (or -1: from $EDITRAIN_FT_REPLICA), got {self.ft_replica_id}")
        _positive(self, "dist", ("ft_min_replicas",), least=1)
        for name in ("ft_heartbeat_timeout_s", "ft_heartbeat_interval_s", "ft_join_timeout_s",
                     "ft_timeout_s"):
            _req(getattr(self, name) > 0, f"dist.{name}",
                 f"must be > 0 seconds, got {getattr(self, name)}")
        _req(self.ft_heartbeat_interval_s * 2 <= self.ft_heartbeat_timeout_s,
             "dist.ft_heartbeat_interval_s",
             f"must be at most half of dist.ft_heartbeat_timeout_s "
             f"({self.ft_heartbeat_timeout_s:g} s: a live replica must get two heartbeats "
             f"in), got {self.ft_heartbeat_interval_s:g}")
        if self.fault_tolerance == "torchft":
            from editrain.sync.ft import torchft_available

            _req(torchft_available(), "dist.fault_tolerance",
                 "torchft is not installed; pip install 'editrain[ft]' (or torchft)")
        for name, allowed in (("backend", BACKENDS), ("device", DEVICES),
                              ("comm_backend", COMM_BACKENDS)):
            value = getattr(self, name)
            _req(value in allowed, f"dist.{name}",
                 f"allowed: {', '.join(allowed)}; got {value!r}")
        needs = [f"dist.{n}={v}" for n, v in (("backend", self.backend),
                                              ("device", self.device),
                                              ("comm_backend", self.comm_backend))
                 if v in ("nccl", "cuda")]
        if needs:
            local = int(os.environ.get("LOCAL_WORLD_SIZE", self.nproc))
            have = cuda_device_count()
            _req(have >= local, needs[0],
                 f"needs CUDA with one device per local process ({local}), but this machine "
                 f"has {have}; use gloo / cpu (or auto) here")


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
    data rank, replica x dist.shard_size + shard (tensor-parallel peers die with it), STEP
    from 1 to train.steps. With --ft the worker's whole replica group dies and restarts
    after sim.fail_restart_s."""
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

    def validate(self) -> None:
        """Every spec parses (typos fail before any process starts)."""
        from editrain import sim

        try:
            sim.parse_sim(self)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        _positive(self, "sim", ("replica_offset",), least=0)
        if self.step_schedule:
            _req(min(self.step_schedule) >= 1, "sim.step_schedule",
                 f"steps per window must be >= 1, got {self.step_schedule}")


@dataclass
class CheckpointSection:
    """Checkpoints."""

    every: int = 0
    """Save a checkpoint every this many steps (0: only at the end if `final` is set)."""
    keep: int = 2
    """Keep this many most recent checkpoints."""
    final: bool = True
    """Save a checkpoint at the end of the run."""

    def validate(self) -> None:
        """Intervals and counts in range."""
        _positive(self, "checkpoint", ("every",), least=0)
        _req(self.keep >= 1, "checkpoint.keep", f"must be >= 1, got {self.keep}")


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
SHORTHANDS = {
    "--steps": "train.steps",
    "--nproc": "dist.nproc",
    "--shard-size": "dist.shard_size",
    "--tp-size": "dist.tp_size",
    "--method": "sync.method",
    "--seed": "train.seed",
    "--run-dir": "run_dir",
    "--resume": "resume",
    "--max-restarts": "dist.max_restarts",
}
FLAGS: dict[str, str | tuple[str, Any]] = {
    "--quiet": "quiet", "--overwrite": "overwrite",
    "--ft": ("dist.fault_tolerance", "torchft"),
}
"""Flags without a value: the option they set to True, or (option, value)."""


# ---------------------------------------------------------------------------- parsing
def _coerce(value: Any, tp: Any, option: str) -> Any:
    """Check/convert ``value`` against a field's annotated type."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None or (isinstance(value, str) and value.lower() == "none"
                             and type(None) in args):
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, option)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{option}: bad value {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"{option}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{option}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{option}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{option}: expected a string, got {value!r}")
        return value
    if origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, str):  # "a,b" from the command line; items typed like values
            value = [v if item is str else _parse_scalar(v) for v in value.split(",") if v]
        if not isinstance(value, list):
            raise ConfigError(f"{option}: expected a list, got {value!r}")
        return [_coerce(v, item, option) for v in value]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{option}: expected a table such as {{lr = 0.7}}, got {value!r}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{option}: expected a table, got {value!r}")
        return value
    return value


def _parse_scalar(text: str) -> Any:
    """Parse a CLI value as TOML (numbers, booleans, lists, inline tables), else a string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _is_text_option(dotted: str) -> bool:
    """Whether ``dotted`` names a string (or list-of-strings) option of :class:`Config`."""
    tp: Any = Config
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(tp):
            return False
        tp = typing.get_type_hints(tp).get(part)
    args = (typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType)
            else (tp,))
    return any(a is str or a == list[str] for a in args)


def _parse_value(dotted: str, text: str) -> Any:
    """A CLI value for option ``dotted``: TOML, except that a string option keeps the text as
    typed (``--run-dir 2024-01-01`` or ``--sim.link_latency 0.005`` are not a date/number)."""
    value = _parse_scalar(text)
    if not isinstance(value, str | list) and _is_text_option(dotted):
        return text
    return value


def _set_path(raw: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = raw
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--{dotted}: {p} is not a section")
    node[parts[-1]] = value


def _build(cls: type, raw: dict[str, Any], prefix: str) -> Any:
    """Instantiate dataclass ``cls`` from nested dict ``raw``, validating keys and types."""
    fmap = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        option = f"{prefix}{key}"
        if key not in fmap:
            close = [k for k in fmap if k.startswith(key[:3])]
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(
                f"unknown option {option!r}{hint}; allowed in "
                f"[{prefix.rstrip('.') or 'top level'}]: {', '.join(fmap)}"
            )
        tp = hints[key]
        value = _coerce(value, tp, option)
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            value = _build(tp, value, option + ".")
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None


def parse_overrides(argv: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Turn ``--section.key=value`` / ``--section.key value`` / shorthands into a nested dict.

    Returns the nested overrides and the arguments that were not options (positional).
    """
    raw: dict[str, Any] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--"):
            rest.append(arg)
            continue
        name, eq, value = arg.partition("=")
        if name in FLAGS and isinstance(FLAGS[name], tuple):
            path, fixed = FLAGS[name]
            _set_path(raw, path, fixed)
            if eq:
                raise ConfigError(f"{name} takes no value (it sets {path}={fixed})")
            continue
        if name in FLAGS:
            _set_path(raw, FLAGS[name], True if not eq else _parse_scalar(value))
            continue
        dotted = SHORTHANDS.get(name, name[2:].replace("-", "_"))
        if not eq:
            if i >= len(argv):
                raise ConfigError(f"{name}: missing value")
            value = argv[i]
            i += 1
        _set_path(raw, dotted, _parse_value(dotted, value))
    return raw, rest


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Build a validated :class:`Config` from an optional TOML file and CLI overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"--config: file not found: {p}")
        try:
            raw = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"--config: {p} is not valid TOML: {e}") from None
    raw = _merge(raw, overrides or {})
    cfg = _build(Config, raw, "")
    validate(cfg)
    return cfg


# ---------------------------------------------------------------------------- validation
def validate(cfg: Config) -> None:
    """Every section's own checks (first: every number finite and within int64, also
    inside tables and lists), then the checks that span sections; nothing here needs a
    process group."""
    from editrain.sync.config import check_finite

    for name in SECTIONS:
        section = getattr(cfg, name)
        try:
            check_finite(section, name)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if hasattr(section, "validate"):
            section.validate()
    t, s = cfg.train, cfg.sync
    if s.is_local_sgd:
        _req(s.local_sgd_warmup_steps < t.steps, "sync.local_sgd_warmup_steps",
             f"must be smaller than train.steps ({t.steps}), got {s.local_sgd_warmup_steps}")
    if cfg.sim.step_schedule:
        _req(s.method == "aedit", "sim.step_schedule", "only applies to sync.method=aedit")
    _req(0 <= cfg.sim.fail_restart_s <= 3600, "sim.fail_restart_s",
         f"must be in [0, 3600] seconds, got {cfg.sim.fail_restart_s}")
    from editrain.sim import parse_sim

    fail = parse_sim(cfg.sim).fail  # (rank, step, phase); parsed in SimSection.validate
    if fail is not None:
        _req(1 <= fail[1] <= t.steps, "sim.fail",
             f"step {fail[1]} never comes: STEP must be in [1, train.steps = {t.steps}] "
             f"(the worker dies after that step), got {cfg.sim.fail!r}")
    if cfg.dist.tp_size > 1:
        heads = _heads(cfg)
        _req(all(h % cfg.dist.tp_size == 0 for h in heads), "dist.tp_size",
             f"must divide the model's query heads ({heads[0]}) and key/value heads "
             f"({heads[1]}), got {cfg.dist.tp_size}")
    if cfg.dist.fault_tolerance == "torchft":
        from editrain.sync.setup import check_fault_tolerant

        try:
            check_fault_tolerant(s.resolve(), 1)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if cfg.model.hf_config is not None:
        _validate_hf(cfg)
    else:
        mcfg = model_config(cfg)
        _req(t.seq_len <= mcfg.max_seq_len, "train.seq_len",
             f"{t.seq_len} exceeds the model's maximum sequence length {mcfg.max_seq_len} "
             f"(raise model.max_seq_len or lower train.seq_len)")
    if s.is_local_sgd and s.fragments > 1:
        units = sync_units(cfg)
        blocks = [n for n in units if n.startswith("block")]
        named = ", ".join(units)
        if len(blocks) > 2:  # a deep model's blocks as block0 .. blockN-1
            named = named.replace(", ".join(blocks), f"{blocks[0]} .. {blocks[-1]}")
        _req(s.fragments <= len(units), "sync.fragments",
             f"must be <= the number of sync units of the model ({len(units)}: {named}), "
             f"got {s.fragments}")


def sync_units(cfg: Config) -> list[str]:
    """The names of the model's sync units, as the sync engine counts them: the root (when
    it holds parameters), every transformer block and, with ``sync.split_root``, the
    embeddings and an untied output head. The model is built on the meta device (no
    memory, no weights) and counted with the engine's own functions.

    Args:
        cfg: a configuration whose model section is valid.

    Returns:
        One name per unit, in the engine's order ("root", "block0", ...).
    """
    import torch

    from editrain.sync.setup import find_root_params, unit_modules

    with torch.device("meta"):
        if cfg.model.hf_config is not None:
            from transformers import AutoConfig, AutoModelForCausalLM

            from editrain.models.hf import HFCausalLM, read_hf_config

            data = dict(read_hf_config(cfg.model.hf_config))
            hf_config = AutoConfig.for_model(data.pop("model_type"), **data)
            model = HFCausalLM(AutoModelForCausalLM.from_config(hf_config))
        else:
            from editrain.models import Llama

            model = Llama(model_config(cfg))
    modules = unit_modules(model, model.blocks(), cfg.sync.split_root)
    root = find_root_params(model, [m for _, m in modules])
    return (["root"] if root else []) + [n for n, _ in modules]


def _heads(cfg: Config) -> tuple[int, int]:
    """(query heads, key/value heads) of the configured model."""
    if cfg.model.hf_config is not None:
        from editrain.models.hf import read_hf_config

        data = read_hf_config(cfg.model.hf_config)
        q = int(data.get("num_attention_heads") or 1)
        return q, int(data.get("num_key_value_heads") or q)
    mcfg = model_config(cfg)
    return mcfg.n_heads, mcfg.n_kv_heads or mcfg.n_heads


def _validate_hf(cfg: Config) -> None:
    """``model.hf_config``: the file exists and is a config.json, transformers is installed,
    the sequence length fits, and no preset override is set alongside it."""
    from editrain.models.hf import check_hf_config

    shape = sorted(cfg.model.overrides())
    _req(not shape, "model.hf_config", f"the model shape comes from the config file; remove "
         f"{', '.join('model.' + k for k in shape)}")
    try:
        check_hf_config(cfg.model.hf_config, cfg.train.seq_len)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(str(e)) from None


def model_config(cfg: Config, vocab_size: int | None = None):
    """The model's :class:`~editrain.models.LlamaConfig` from the preset and its overrides."""
    from editrain.models import preset_config

    try:
        return preset_config(cfg.model.preset, vocab_size=vocab_size or cfg.data.vocab_size,
                             **cfg.model.overrides())
    except ValueError as e:
        raise ConfigError(f"model: {e}") from None


def validate_world(cfg: Config, world_size: int) -> None:
    """Checks that need the world size (known before spawning, or from torchrun's env)."""
    from editrain.topology import Topology

    d = cfg.dist
    try:  # the mesh's own rank arithmetic says what divides what
        topo = Topology(world_size, d.shard_size, d.tp_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    # Replica indices in sim.* must exist (checked here, before any worker starts).
    from editrain import sim

    replicas = topo.num_replicas
    if d.fault_tolerance == "torchft" and d.ft_replicas:
        replicas = d.ft_replicas  # this job is one replica group of several
    plan = sim.parse_sim(cfg.sim)
    try:
        sim.check_replicas(plan, replicas + cfg.sim.replica_offset)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if plan.fail is not None:
        # A worker dies by its data rank (replica x shard_size + shard; tp peers share it).
        data_ranks = replicas * d.shard_size
        _req(plan.fail[0] < data_ranks, "sim.fail",
             f"rank {plan.fail[0]} does not exist: RANK is a data rank, replica x "
             f"dist.shard_size + shard, from 0 to {data_ranks - 1} ({replicas} replicas x "
             f"{d.shard_size} shards), got {cfg.sim.fail!r}")


# ---------------------------------------------------------------------------- output
def to_dict(obj: Any) -> Any:
    """Plain nested dict of a config (None values kept)."""
    return dataclasses.asdict(obj)


def toml_value(v: Any) -> str:
    """One value written as TOML (``None`` has no TOML form)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()
                                if x is not None) + "}"
    raise TypeError(f"cannot write {v!r} as TOML")


def dumps_toml(data: dict[str, Any]) -> str:
    """Serialise a nested dict of plain values as TOML.

    TOML has no null: an option set to ``None`` is written as ``"none"`` (which
    :func:`load_config` reads back as ``None``; omitting it would bring back a non-None
    default such as ``data.max_bytes``). ``None`` inside inline tables is omitted.
    """
    lines: list[str] = []
    tables: list[tuple[str, dict[str, Any]]] = []
    for k, v in data.items():
        if isinstance(v, dict) and k in SECTIONS + ("gta",):
            tables.append((k, v))
        else:
            lines.append(f"{k} = {toml_value('none' if v is None else v)}")

    def emit(name: str, table: dict[str, Any]) -> None:
        lines.append("")
        lines.append(f"[{name}]")
        subs = []
        for k, v in table.items():
            if isinstance(v, dict) and k == "gta":
                subs.append((f"{name}.{k}", v))
            else:
                lines.append(f"{k} = {toml_value('none' if v is None else v)}")
        for sub_name, sub in subs:
            emit(sub_name, sub)

    for name, table in tables:
        emit(name, table)
    return "\n".join(lines).lstrip("\n") + "\n"



# ---------------------------------------------------------------------------- documentation
def field_docs(cls: type) -> dict[str, str]:
    """The one-line docstrings written under each field of a config dataclass."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for prev, node in zip(body, body[1:]):
        if (isinstance(prev, ast.AnnAssign) and isinstance(prev.target, ast.Name)
                and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            docs[prev.target.id] = " ".join(node.value.value.split())
    return docs


def describe_options() -> list[tuple[str, str, Any, str]]:
    """``(option, type, default, help)`` for every configurable key, in section order."""
    out: list[tuple[str, str, Any, str]] = []

    def walk(cls: type, prefix: str) -> None:
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        defaults = cls()
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{f.name}.")
                continue
            tname = getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
            out.append((prefix + f.name, str(tname), getattr(defaults, f.name),
                        docs.get(f.name, "")))

    walk(Config, "")
    return out
