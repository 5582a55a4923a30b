"""Checks of a configuration before any process starts: each names the option and what is allowed.

One error type (:class:`~editrain.errors.ConfigError`) and one style: every check is a
:func:`~editrain.errors.require` of a condition, the option's dotted name and what is
allowed (with the value given); a lower layer's own check (the data sources, the simulation
specs, the mesh arithmetic, the Hugging Face config) raises ``ValueError`` naming the option
and is re-raised as ``ConfigError``. :func:`validate` runs each section's checks, then those
that span sections; :func:`validate_world` those that need the world size. The ``sync``
section checks itself when it is constructed (:class:`editrain.sync.config.SyncConfig`).

Nothing here imports torch at import time, nor does a check that only needs names and
numbers: ``editrain data`` validates the whole configuration and never imports torch.
A check that needs it (CUDA devices, a model built on the meta device, torchft, the mesh,
a Hugging Face config) imports it inside, where it runs.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

from editrain.argv import env_int
from editrain.config.model import (
    heads,
    hf_option,
    hf_source,
    init_llama,
    meta_hf_model,
    meta_model,
    model_config,
    sync_units,
    tokenizer_source,
)
from editrain.config.schema import (
    BACKENDS,
    DEVICES,
    FAULT_TOLERANCE,
    OPTIMIZERS,
    PP_SCHEDULES,
    PRECISIONS,
    PRESETS,
    SAMS,
    SECTIONS,
    SEED_MAX,
    CheckpointSection,
    Config,
    DataSection,
    DistSection,
    ModelSection,
    OptimSection,
    SimSection,
    TrainSection,
)
from editrain.data import check_data_options
from editrain.errors import ConfigError, as_config_error, require, spelled
from editrain.models.hf_dir import hf_int, read_config
from editrain.paths import shown
from editrain.safe_io import quote
from editrain.sim import check_replicas, parse_sim
from editrain.sync.config import COMM_BACKENDS, check_finite
from editrain.tracking import WANDB_MODES


def cuda_device_count() -> int:
    """CUDA devices this process can use (respects CUDA_VISIBLE_DEVICES); tests replace it."""
    import torch  # only where dist.* asks for nccl or cuda

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _counts(section: Any, prefix: str, names: tuple[str, ...], least: int = 1) -> None:
    """Each of ``names`` is at least ``least``, worded as every count of the configuration
    and of the Python API (:func:`editrain.errors.plain_count`): ``must be >= 1, got 0``."""
    for name in names:
        value = getattr(section, name)
        require(value >= least, f"{prefix}.{name}", f"must be >= {least}, got {value}")


def _one_of(value: Any, allowed: tuple[str, ...], option: str) -> None:
    require(value in allowed, option, f"allowed: {', '.join(allowed)}; got {spelled(value)}")


def _seed(value: int, option: str) -> None:
    require(0 <= value <= SEED_MAX, option,
            f"must be in [0, 2^63 - 1] ({SEED_MAX}), got {value}")


# ---------------------------------------------------------------------------- sections
def check_model(m: ModelSection) -> None:
    """The preset exists (shape overrides are checked with the preset's config)."""
    require(m.preset in PRESETS, "model.preset",
            f"unknown preset {spelled(m.preset)}; allowed: {', '.join(PRESETS)}")


def check_data(d: DataSection) -> None:
    """Sources exist and are of a supported kind, options in range (no data is read)."""
    with as_config_error():
        check_data_options(d.path, d.text_field, d.eos, d.separator)
    require(d.vocab_size >= 257, "data.vocab_size",
            f"must be >= 257 (256 bytes + end-of-text), got {d.vocab_size}")
    require(0 < d.val_fraction < 0.5, "data.val_fraction",
            f"must be in (0, 0.5), got {d.val_fraction}")
    _counts(d, "data", ("val_tokens",), least=0)
    _seed(d.split_seed, "data.split_seed")
    if isinstance(d.max_bytes, str):
        require(d.max_bytes == "auto", "data.max_bytes",
                f"must be a number > 0, none or auto, got {spelled(d.max_bytes)}")
    elif d.max_bytes is not None:
        require(d.max_bytes > 0, "data.max_bytes", f"must be > 0, got {d.max_bytes}")


def check_train(t: TrainSection) -> None:
    """Counts positive, rates and coefficients in range."""
    _counts(t, "train", ("steps", "batch_size", "seq_len", "gradient_accumulation_steps",
                         "eval_every", "log_every"))
    _counts(t, "train", ("warmup_steps", "eval_tokens", "final_eval_tokens"), least=0)
    _seed(t.seed, "train.seed")
    require(t.lr > 0, "train.lr", f"must be > 0, got {t.lr}")
    require(0 <= t.min_lr_ratio <= 1, "train.min_lr_ratio",
            f"must be in [0, 1], got {t.min_lr_ratio}")
    require(t.weight_decay >= 0, "train.weight_decay", f"must be >= 0, got {t.weight_decay}")
    require(t.grad_clip >= 0, "train.grad_clip", f"must be >= 0, got {t.grad_clip}")
    for b in ("beta1", "beta2"):
        require(0 <= getattr(t, b) < 1, f"train.{b}", f"must be in [0, 1), got {getattr(t, b)}")
    _one_of(t.precision, PRECISIONS, "train.precision")
    _one_of(t.wandb, WANDB_MODES, "train.wandb")
    if t.wandb != "off":
        require(importlib.util.find_spec("wandb") is not None, "train.wandb",
                f"{spelled(t.wandb)} needs the wandb package: pip install 'editrain[wandb]'")
        require(bool(t.wandb_project.strip()), "train.wandb_project", "must not be empty")


def check_optim(o: OptimSection) -> None:
    """A known optimizer and SAM wrapper, WSAM coefficients in range."""
    _one_of(o.name, OPTIMIZERS, "optim.name")
    if o.sam is not None:
        _one_of(o.sam, SAMS, "optim.sam")
    require(o.rho > 0, "optim.rho", f"must be > 0, got {o.rho}")
    require(0 <= o.gamma < 1, "optim.gamma", f"must be in [0, 1), got {o.gamma}")


def check_dist(d: DistSection) -> None:
    """Sizes and timeouts in range, known backends and devices, and the devices they need:
    nccl and cuda need as many CUDA devices as local processes (``dist.nproc``, or
    torchrun's ``LOCAL_WORLD_SIZE``)."""
    for name in ("nproc", "shard_size", "tp_size", "pp_size"):
        require(getattr(d, name) >= 1, f"dist.{name}", f"must be >= 1, got {getattr(d, name)}")
    _counts(d, "dist", ("max_restarts", "threads_per_proc", "ft_replicas", "pp_microbatches"),
            least=0)
    _counts(d, "dist", ("pp_stages_per_rank",))
    _one_of(d.pp_schedule, PP_SCHEDULES, "dist.pp_schedule")
    _one_of(d.fault_tolerance, FAULT_TOLERANCE, "dist.fault_tolerance")
    require(d.ft_replica_id >= -1, "dist.ft_replica_id",
            f"must be >= 0 (or -1: from $EDITRAIN_FT_REPLICA), got {d.ft_replica_id}")
    _counts(d, "dist", ("ft_min_replicas",))
    for name in ("ft_heartbeat_timeout_s", "ft_heartbeat_interval_s", "ft_join_timeout_s",
                 "ft_timeout_s"):
        require(getattr(d, name) > 0, f"dist.{name}",
                f"must be > 0 seconds, got {getattr(d, name)}")
    require(d.ft_heartbeat_interval_s * 2 <= d.ft_heartbeat_timeout_s,
            "dist.ft_heartbeat_interval_s",
            f"must be at most half of dist.ft_heartbeat_timeout_s "
            f"({d.ft_heartbeat_timeout_s:g} s: a live replica must get two heartbeats "
            f"in), got {d.ft_heartbeat_interval_s:g}")
    if d.fault_tolerance == "torchft":
        from editrain.sync.ft import torchft_available

        require(torchft_available(), "dist.fault_tolerance",
                "torchft is not installed; pip install 'editrain[ft]' (or torchft)")
    for name, allowed in (("backend", BACKENDS), ("device", DEVICES),
                          ("comm_backend", COMM_BACKENDS)):
        _one_of(getattr(d, name), allowed, f"dist.{name}")
    needs = [f"dist.{n}={v}" for n, v in (("backend", d.backend), ("device", d.device),
                                          ("comm_backend", d.comm_backend))
             if v in ("nccl", "cuda")]
    if needs:
        local = env_int("LOCAL_WORLD_SIZE", d.nproc, minimum=1)
        have = cuda_device_count()
        require(have >= local, needs[0],
                f"needs CUDA with one device per local process ({local}), but this machine "
                f"has {have}; use gloo / cpu (or auto) here")


def check_sim(s: SimSection) -> None:
    """Every spec parses (typos fail before any process starts)."""
    with as_config_error():
        parse_sim(s)
    _counts(s, "sim", ("replica_offset",), least=0)
    if s.step_schedule:
        require(min(s.step_schedule) >= 1, "sim.step_schedule",
                f"steps per window must be >= 1, got {s.step_schedule}")


def check_checkpoint(c: CheckpointSection) -> None:
    """Intervals and counts in range."""
    _counts(c, "checkpoint", ("every",), least=0)
    require(c.keep >= 1, "checkpoint.keep", f"must be >= 1, got {c.keep}")
    require(c.final or not c.export_final, "checkpoint.export_final",
            "exports the final checkpoint, so it needs checkpoint.final = true")


SECTION_CHECKS: dict[str, Callable[[Any], None]] = {
    "model": check_model, "data": check_data, "train": check_train, "optim": check_optim,
    "dist": check_dist, "sim": check_sim, "checkpoint": check_checkpoint,
}
"""Each section's own checks (``sync`` checks itself when it is constructed)."""


# ---------------------------------------------------------------------------- whole config
def validate(cfg: Config) -> None:
    """Every section's own checks (first: every number finite and within int64, also
    inside tables and lists), then the checks that span sections; nothing here needs a
    process group."""
    for name in SECTIONS:
        section = getattr(cfg, name)
        check_finite(section, name)
        if name in SECTION_CHECKS:
            SECTION_CHECKS[name](section)
    t, s = cfg.train, cfg.sync
    if s.is_local_sgd:
        require(s.local_sgd_warmup_steps < t.steps, "sync.local_sgd_warmup_steps",
                f"must be smaller than train.steps ({t.steps}), got {s.local_sgd_warmup_steps}")
    if cfg.sim.step_schedule:
        require(s.method == "aedit", "sim.step_schedule", "only applies to sync.method=aedit")
    require(0 <= cfg.sim.fail_restart_s <= 3600, "sim.fail_restart_s",
            f"must be in [0, 3600] seconds, got {cfg.sim.fail_restart_s}")
    fail = parse_sim(cfg.sim).fail  # (rank, step, phase); parsed in check_sim
    if fail is not None:
        require(1 <= fail[1] <= t.steps, "sim.fail",
                f"step {fail[1]} never comes: STEP must be in [1, train.steps = {t.steps}] "
                f"(the worker dies after that step), got {spelled(cfg.sim.fail)}")
    if cfg.model.init_from is not None:  # first: the checks below read its config.json
        _check_init_from(cfg)
    if cfg.dist.tp_size > 1 and hf_source(cfg) is not None:
        from editrain.models.hf import read_hf_config
        from editrain.models.tensor_parallel import HF_MODEL_TYPES

        with as_config_error(FileNotFoundError):
            kind = read_hf_config(hf_source(cfg), hf_option(cfg))["model_type"]
        require(kind in HF_MODEL_TYPES, "dist.tp_size",
                f"tensor parallelism splits Hugging Face models of the types editrain checks "
                f"it on ({', '.join(HF_MODEL_TYPES)}), not {quote(kind)} of {hf_option(cfg)} (its "
                f"attention may reshape by the whole model's head count or norm across heads); "
                f"train it with FSDP alone (dist.tp_size = 1)")
    if cfg.dist.tp_size > 1:
        q, kv = heads(cfg)
        require(q % cfg.dist.tp_size == 0 and kv % cfg.dist.tp_size == 0, "dist.tp_size",
                f"must divide the model's query heads ({q}) and key/value heads ({kv}), "
                f"got {cfg.dist.tp_size}")
    if cfg.dist.pp_size > 1:
        _check_pipeline(cfg)
    else:
        require(cfg.dist.pp_stages_per_rank == 1, "dist.pp_stages_per_rank",
                f"chunks per pipeline rank need pipeline stages (dist.pp_size > 1 with "
                f"dist.pp_schedule = 'interleaved-1f1b'), got {cfg.dist.pp_stages_per_rank}")
    if cfg.dist.fault_tolerance == "torchft":
        from editrain.sync.setup import check_fault_tolerant

        with as_config_error():
            check_fault_tolerant(s.resolve(), 1)
    if hf_source(cfg) is not None:
        _check_hf(cfg)
    if tokenizer_source(cfg)[1] is not None:
        _check_kept_ids(cfg)
    if hf_source(cfg) is None:
        mcfg = model_config(cfg)
        how = (f"max_position_embeddings of the model.init_from directory "
               f"{shown(cfg.model.init_from)}; lower train.seq_len" if init_llama(cfg) else
               "raise model.max_seq_len or lower train.seq_len")
        require(t.seq_len <= mcfg.max_seq_len, "train.seq_len",
                f"{t.seq_len} exceeds the model's maximum sequence length {mcfg.max_seq_len} "
                f"({how})")
    if s.is_local_sgd and s.fragments > max(1, _blocks(cfg)):  # else every block is one
        units = sync_units(cfg)  # built on the meta device, for the message
        blocks = [n for n in units if n.startswith("block")]
        named = ", ".join(units)
        if len(blocks) > 2:  # a deep model's blocks as block0 .. blockN-1
            named = named.replace(", ".join(blocks), f"{blocks[0]} .. {blocks[-1]}")
        require(s.fragments <= len(units), "sync.fragments",
                f"must be <= the number of sync units of the model ({len(units)}: {named}), "
                f"got {s.fragments}")


def _blocks(cfg: Config) -> int:
    """The model's transformer blocks (each a sync unit) as its configuration says, without
    building it (0 when a Hugging Face config does not say)."""
    source = hf_source(cfg)
    if source is None:
        return model_config(cfg).n_layers
    from editrain.config.size import hf_layers
    from editrain.models.hf import read_hf_config

    return hf_layers(read_hf_config(source, hf_option(cfg)))


def _check_pipeline(cfg: Config) -> None:
    """``dist.pp_size > 1``: the built-in Llama or a Llama-family ``model.hf_config`` model,
    with untied embeddings and at least as many blocks as stages, microbatches that divide
    the batch and suit the schedule, and none of the features the pipelined trainer does
    not wire (each refused by name)."""
    d, t = cfg.dist, cfg.train
    p = d.pp_size
    if hf_source(cfg) is not None:
        n_layers, tied = _hf_pipeline_shape(cfg)
        tied_option = hf_option(cfg)
        tied_what = "tie_word_embeddings = false in the config file"
    else:
        mcfg = model_config(cfg)
        n_layers, tied = mcfg.n_layers, mcfg.tie_embeddings
        tied_option, tied_what = "model.tie_embeddings", "model.tie_embeddings = false"
    require(n_layers >= p, "dist.pp_size",
            f"must be at most the model's number of layers ({n_layers}): every stage "
            f"holds at least one block; got {p}")
    require(not tied, tied_option,
            f"dist.pp_size = {p} needs untied embeddings ({tied_what}): "
            f"the first and last stage would share the embedding matrix")
    require(cfg.optim.sam in (None, "none"), "optim.sam",
            f"{spelled(cfg.optim.sam)} is not supported with pipeline stages (dist.pp_size = {p}): "
            f"its closure would run the pipeline twice per step; use optim.sam = none")
    from editrain.pipeline import check_microbatches

    if d.pp_microbatches == 0:
        require(t.batch_size % p == 0, "dist.pp_microbatches",
                f"0 means dist.pp_size ({p}) microbatches, which must divide the batch size "
                f"(train.batch_size = {t.batch_size}); set it to a divisor of the batch size")
    v = d.pp_stages_per_rank
    with as_config_error():
        check_microbatches(t.batch_size, d.microbatches, d.pp_schedule, p, v,
                           accumulation=t.gradient_accumulation_steps)
    require(n_layers >= p * v, "dist.pp_stages_per_rank",
            f"dist.pp_size x dist.pp_stages_per_rank ({p} x {v}) must be at most the "
            f"model's number of layers ({n_layers}): every chunk holds at least one block")


def _hf_pipeline_shape(cfg: Config) -> tuple[int, bool]:
    """(layers, tied embeddings) of a ``model.hf_config`` model split into stages, whose
    ``model_type`` must be one :class:`editrain.pipeline.HFStage` splits. A config file
    without ``tie_word_embeddings`` takes its model type's default (transformers' config
    class is imported for that only)."""
    from editrain.models.hf import read_hf_config
    from editrain.pipeline import check_hf_pipeline

    _check_hf(cfg)  # the file, transformers, the sequence length: first
    source = hf_source(cfg)
    data = read_hf_config(source, hf_option(cfg))
    with as_config_error():
        check_hf_pipeline(data["model_type"])
    n_layers = data.get("num_hidden_layers")
    require(isinstance(n_layers, int) and not isinstance(n_layers, bool) and n_layers >= 1,
            hf_option(cfg), f"num_hidden_layers must be a positive integer in "
            f"{shown(source)} to split the model into stages, got {quote(n_layers)}")
    tied = data.get("tie_word_embeddings")
    if tied is None:
        from transformers import AutoConfig  # optional dependency, checked by _check_hf

        fields = {k: v for k, v in data.items() if k != "model_type"}
        tied = AutoConfig.for_model(data["model_type"], **fields).tie_word_embeddings
    return n_layers, bool(tied)


def _check_hf(cfg: Config) -> None:
    """``model.hf_config``: the file exists and is a config.json, transformers is installed,
    the sequence length fits, and no preset override is set alongside it."""
    from editrain.models.hf import check_hf_config

    shape = sorted(cfg.model.overrides())
    require(not shape, hf_option(cfg), f"the model shape comes from the config file; "
            f"remove {', '.join('model.' + k for k in shape)}")
    with as_config_error(FileNotFoundError):
        check_hf_config(hf_source(cfg), cfg.train.seq_len, hf_option(cfg))
    if cfg.model.hf_config is not None:  # model.init_from's is built by _check_init_from
        _hf_meta_model(cfg)


def _hf_meta_model(cfg: Config) -> Any:
    """The ``model.hf_config`` or ``model.init_from`` model of another architecture than
    Llama on the meta device, before any process starts: an architecture editrain cannot
    train is refused here in one line naming the option and what it trains, not in every
    rank once the corpus is tokenised.

    Raises:
        ConfigError: transformers builds no causal LM from the file (an encoder-decoder
            such as T5, an unknown ``model_type``), or the model keeps its layers where
            :func:`editrain.units.find_blocks` does not look (Mamba's ``backbone.layers``,
            BERT's ``bert.encoder.layer``): EDiT syncs block by block.
    """
    from editrain.models.hf import HFCausalLM, check_required_fields, config_path, read_hf_config

    option, source = hf_option(cfg), hf_source(cfg)
    with as_config_error(FileNotFoundError):  # a null transformers refuses: ours, one line
        check_required_fields(read_hf_config(source, option),
                              f"{option}: {shown(config_path(source, option))}")
    try:
        hf_model = meta_hf_model(source, option)
    except Exception as e:  # transformers' own refusal of a model_type or architecture
        raise ConfigError(f"{option}: {shown(source)} describes no causal LM transformers can build "
                          f"({str(e).splitlines()[0]}); editrain trains the decoder-only "
                          f"models AutoModelForCausalLM builds") from None
    with as_config_error():
        return HFCausalLM.checked(hf_model, f"{option}: {shown(source)}")


def _check_kept_ids(cfg: Config) -> None:
    """The special-token ids the run keeps for ``editrain export`` (a ``model.init_from``
    directory's own, a tokenizer directory's special tokens, a kept
    ``generation_config.json``) are tokens of the model's vocabulary: a file that names one
    past it (GPT-2's 50256 in a smaller vocabulary) is refused before the run trains, not by
    the export after it (or by ``checkpoint.export_final`` at its end)."""
    from editrain.models.hf_tokens import check_kept_ids

    tok_dir, init = tokenizer_source(cfg)[1], cfg.model.init_from
    if init is not None:
        vocab = hf_int(read_config(init), "vocab")
    elif cfg.model.hf_config is not None:  # torch, as _check_hf imported it already
        from editrain.models.hf import read_hf_config

        vocab = hf_int(read_hf_config(cfg.model.hf_config, "model.hf_config"), "vocab")
    else:  # editrain's Llama: its embedding is sized to the tokenizer (read without torch)
        vocab = _tokenizer_vocab(cfg)[0]
    own = init is not None and Path(tok_dir).resolve() == Path(init).expanduser().resolve()
    with as_config_error():
        check_kept_ids(tok_dir, init, vocab, "model.init_from" if own else "data.tokenizer")


def _check_init_from(cfg: Config) -> None:
    """``model.init_from``: a Hugging Face directory whose weights fit the model of its own
    config.json, no pickle, no link out of it, no corrupt safetensors header, a tokenizer
    whose ids the embedding covers (every file is read only for its headers)."""
    from editrain.config.size import check_weights_match
    from editrain.models.hf_dir import check_tensors, hf_parameters, inspect_weights, read_config

    m = cfg.model
    require(m.hf_config is None, "model.init_from",
            "takes the model from the directory's config.json; remove model.hf_config")
    shape = sorted(m.overrides())
    require(not shape, "model.init_from", f"the model shape comes from the directory's "
            f"config.json; remove {', '.join('model.' + k for k in shape)}")
    with as_config_error():
        llama = init_llama(cfg)  # the directory and its config.json first
        weights = inspect_weights(m.init_from)
        # Before the model is built from the file: a config.json that claims more layers
        # than its weights hold (10**9) would take hours to build on the meta device.
        check_weights_match(read_config(m.init_from), weights.tensors,
                            shown(Path(m.init_from) / "config.json"))
    if not llama:
        require(importlib.util.find_spec("transformers") is not None, "model.init_from",
                f"{shown(m.init_from)} is not a LlamaForCausalLM, and other architectures need the "
                "transformers package: pip install 'editrain[hf]'")
    model = meta_model(cfg) if llama else _hf_meta_model(cfg)
    expected = {n: tuple(p.shape) for n, p in hf_parameters(model).items()}
    with as_config_error():
        check_tensors(weights, expected)
    # Without the model's tokenizer the run would train a new BPE, whose ids mean nothing
    # to the pretrained embedding.
    require(tokenizer_source(cfg)[0] is not None, "model.init_from",
            f"{shown(m.init_from)} has no tokenizer.json, and a new tokenizer's ids would mean "
            f"nothing to its weights: name the model's tokenizer with data.tokenizer (its "
            f"tokenizer.json, its model directory or hf:ORG/NAME)")
    vocab = int(model.config.vocab_size)
    tok_vocab, option = _tokenizer_vocab(cfg)
    require(tok_vocab <= vocab, option, f"the tokenizer has {tok_vocab} ids, more than the "
            f"embedding of model.init_from {shown(m.init_from)} has rows ({vocab})")


def _tokenizer_vocab(cfg: Config) -> tuple[int, str]:
    """The id space of the tokenizer the run will use, and the option that chose it:
    ``data.tokenizer`` (or the ``model.init_from`` directory's), else the BPE it will train
    (``data.vocab_size``)."""
    from editrain.data import load_tokenizer, tokenizer_vocab_size

    path = tokenizer_source(cfg)[0]
    if path is None:
        return cfg.data.vocab_size, "data.vocab_size"
    with as_config_error(FileNotFoundError):
        return tokenizer_vocab_size(load_tokenizer(path)), "data.tokenizer"


def validate_world(cfg: Config, world_size: int) -> None:
    """Checks that need the world size (known before spawning, or from torchrun's env)."""
    from editrain.config.size import check_fits
    from editrain.topology import Topology

    d = cfg.dist
    with as_config_error():  # the mesh's own rank arithmetic says what divides what
        topo = Topology(world_size, d.shard_size, d.tp_size, d.pp_size)
    # A model too large for this machine's memory, before a worker spends minutes on it.
    check_fits(cfg, min(world_size, env_int("LOCAL_WORLD_SIZE", world_size, minimum=1)))
    # Replica indices in sim.* must exist (checked here, before any worker starts).
    replicas = topo.num_replicas
    if d.fault_tolerance == "torchft" and d.ft_replicas:
        replicas = d.ft_replicas  # this job is one replica group of several
    plan = parse_sim(cfg.sim)
    with as_config_error():
        check_replicas(plan, replicas + cfg.sim.replica_offset)
    if plan.fail is not None:
        # A worker dies by its data rank (replica x shard_size + shard; tp peers share it).
        data_ranks = replicas * d.shard_size
        require(plan.fail[0] < data_ranks, "sim.fail",
                f"rank {plan.fail[0]} does not exist: RANK is a data rank, replica x "
                f"dist.shard_size + shard, from 0 to {data_ranks - 1} ({replicas} replicas x "
                f"{d.shard_size} shards), got {spelled(cfg.sim.fail)}")
