"""Which option applies where: one table over every option of the configuration.

An option that does nothing under the chosen method or mode (``sync.local_sgd_sync_time``
with ``sync.method = edit``, ``optim.momentum`` with AdamW, ``dist.ft_timeout_s`` without
``--ft``) is refused when it is set to anything but its default, naming the option and
where it applies, instead of being silently ignored. :data:`APPLIES` has one entry per
option of :class:`~editrain.config.schema.Config` (a test holds it to that); the ``sync``
section's entries come from the methods' own table,
:data:`editrain.sync.methods.SYNC_OPTION_METHODS`.

Only the command line's configuration is held to it: the library API builds a
``SyncConfig`` from the EDiT reference's classes, which always carry every field.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from editrain.config.schema import SECTIONS, Config
from editrain.errors import require, spelled
from editrain.sync.config import METHODS, GTAConfig
from editrain.sync.methods import METHOD_DEFAULTS, SYNC_OPTION_METHODS


@dataclass(frozen=True)
class Rule:
    """Where an option applies: ``test(cfg)``, described as ``where`` for the refusal."""

    test: Callable[[Config], bool]
    where: str
    """The condition in words, e.g. ``sync.method = aedit``."""
    now: Callable[[Config], str]
    """The setting that holds instead, e.g. ``sync.method is 'edit'``."""


ALWAYS = Rule(lambda cfg: True, "always", lambda cfg: "")
"""An option that does something in every run."""


def _methods(names: tuple[str, ...]) -> Rule:
    """Applies under the sync methods ``names``."""
    if set(names) == set(METHODS):
        return ALWAYS
    return Rule(lambda cfg: cfg.sync.method in names,
                f"sync.method = {' or '.join(names)}",
                lambda cfg: f"sync.method is {spelled(cfg.sync.method)}")


def _when(option: str, values: tuple[Any, ...]) -> Rule:
    """Applies where ``option`` (dotted) holds one of ``values``."""
    section, _, key = option.partition(".")

    def get(cfg: Config) -> Any:
        return getattr(getattr(cfg, section), key)

    return Rule(lambda cfg: get(cfg) in values,
                f"{option} = {' or '.join(str(v) for v in values)}",
                lambda cfg: f"{option} is {spelled(get(cfg))}")


def _both(first: Rule, then: Rule) -> Rule:
    """Applies where ``first`` and ``then`` both do (``now``: the one that does not)."""
    return Rule(lambda cfg: first.test(cfg) and then.test(cfg), f"{first.where} and {then.where}",
                lambda cfg: first.now(cfg) if not first.test(cfg) else then.now(cfg))


def _sync_value(cfg: Any, key: str) -> Any:
    """``sync.<key>`` as the run resolves it: the value set, else the method's own default
    (:data:`~editrain.sync.methods.METHOD_DEFAULTS`), else the schema's."""
    value = getattr(cfg.sync, key)
    if value is None:
        value = METHOD_DEFAULTS.get(cfg.sync.method, {}).get(key, value)
    return value


def _sync_on(key: str, why: str) -> Rule:
    """Applies where the run's ``sync.<key>`` (resolved per method) is on; ``why``: what
    it switches on."""
    return Rule(lambda cfg: bool(_sync_value(cfg, key)), f"sync.{key} is on ({why})",
                lambda cfg: f"sync.{key} is {spelled(_sync_value(cfg, key))} for sync.method = "
                            f"{cfg.sync.method}")


def _gta_fields_apply(cfg: Any) -> bool:
    """The GTA table's fields other than ``reducer`` apply where the reducer is GTA (the
    table may be a dict: :func:`drop_inapplicable`'s raw options)."""
    gta = cfg.sync.gta
    if isinstance(gta, dict):
        fields = gta
    elif dataclasses.is_dataclass(gta):
        fields = dataclasses.asdict(gta)
    else:  # not a table: the schema's type check refuses it
        return True
    if fields.get("reducer") == "gta":
        return True
    return all(v == getattr(GTAConfig(), k) for k, v in fields.items() if k != "reducer")


_GTA = Rule(_gta_fields_apply, "sync.gta.reducer = gta (its other fields tune GTA)",
            lambda cfg: "sync.gta.reducer is not gta")
_DEPENDS_ON = {
    "ewma_alpha": _sync_on("skip_anomaly", "the anomaly detector they tune"),
    "ewma_warmup_steps": _sync_on("skip_anomaly", "the anomaly detector they tune"),
    "ewma_threshold": _sync_on("skip_anomaly", "the anomaly detector they tune"),
    "weight_softmax_temperature": _sync_on("pseudo_gradnorm_reduce",
                                           "the norm softmax it tempers"),
    "step_weight_ratio": _sync_on("use_step_weight", "the step weights it mixes in"),
    "prefetch_depth": _sync_on("layerwise", "rounds synced unit by unit in the forward"),
    "outer_optim_kwargs": Rule(
        lambda cfg: _sync_value(cfg, "outer_optim_class") not in ("none", None),
        "sync.outer_optim_class is not none (the outer optimizer they configure)",
        lambda cfg: f"the outer optimizer is none for sync.method = {cfg.sync.method}"),
    "merge": Rule(lambda cfg: (cfg.sync.overlap_steps or 0) > 0,
                  "sync.overlap_steps > 0 (a delayed merge)",
                  lambda cfg: "sync.overlap_steps is 0: rounds are merged as they end"),
    "gta": _GTA,
    "local_sgd_sync_time": Rule(
        lambda cfg: not cfg.sim.step_schedule,
        "sim.step_schedule is unset (the wall-clock trigger it replaces)",
        lambda cfg: f"sim.step_schedule is {spelled(list(cfg.sim.step_schedule))}: replicas sync "
                    f"after fixed step counts, never on the clock"),
}
"""``sync`` options that also depend on another option's value (set or the method's
default), beyond the methods they apply under: a tuning of a part that is off."""


_PIPELINE = Rule(lambda cfg: cfg.dist.pp_size > 1, "dist.pp_size > 1",
                 lambda cfg: f"dist.pp_size is {cfg.dist.pp_size}")
_FT = _when("dist.fault_tolerance", ("torchft",))
_OWN_SHAPE = Rule(lambda cfg: cfg.model.hf_config is None, "model.hf_config is unset",
                  lambda cfg: "the model's shape comes from model.hf_config")
_LOCAL_SGD = _methods(tuple(m for m in METHODS if m != "sync"))

APPLIES: dict[str, Rule] = {
    **{f"model.{k}": _OWN_SHAPE for k in ("preset", "dim", "n_layers", "n_heads",
                                          "n_kv_heads", "ffn_hidden", "max_seq_len",
                                          "tie_embeddings")},
    "model.hf_config": ALWAYS,
    "model.init_from": ALWAYS,
    **{f"data.{k}": ALWAYS for k in ("path", "text_field", "eos", "tokenizer", "val_fraction",
                                     "val_tokens", "split_seed", "max_bytes", "cache_dir",
                                     "separator")},
    "data.vocab_size": Rule(lambda cfg: cfg.data.tokenizer is None, "data.tokenizer is unset "
                            "(the size of the BPE tokenizer editrain trains)",
                            lambda cfg: "data.tokenizer is set (its vocabulary is the file's)"),
    **{f"train.{k}": ALWAYS for k in ("steps", "batch_size", "seq_len",
                                      "gradient_accumulation_steps", "lr", "min_lr_ratio",
                                      "warmup_steps", "weight_decay", "beta1", "beta2",
                                      "grad_clip", "eval_every", "eval_tokens",
                                      "final_eval_tokens", "log_every", "wandb", "seed",
                                      "precision")},
    "train.wandb_project": _when("train.wandb", ("offline", "online")),
    "optim.name": ALWAYS,
    "optim.sam": ALWAYS,
    "optim.momentum": _when("optim.name", ("sgd",)),
    "optim.agd_delta": _when("optim.name", ("agd",)),
    **{f"optim.{k}": _when("optim.sam", ("wsam",)) for k in ("rho", "gamma", "adaptive",
                                                             "decouple")},
    **{f"dist.{k}": ALWAYS for k in ("nproc", "shard_size", "tp_size", "pp_size", "backend",
                                     "device", "max_restarts", "threads_per_proc",
                                     "comm_backend", "fault_tolerance")},
    **{f"dist.{k}": _PIPELINE for k in ("pp_schedule", "pp_microbatches",
                                        "pp_stages_per_rank")},
    **{f"dist.{k}": _FT for k in ("ft_replicas", "ft_replica_id", "ft_lighthouse",
                                  "ft_min_replicas", "ft_heartbeat_timeout_s",
                                  "ft_heartbeat_interval_s", "ft_join_timeout_s",
                                  "ft_timeout_s")},
    **{f"sync.{k}": (_both(_methods(v), _DEPENDS_ON[k]) if k in _DEPENDS_ON
                     else _methods(v)) for k, v in SYNC_OPTION_METHODS.items()},
    **{f"sim.{k}": ALWAYS for k in ("link_bandwidth", "link_latency", "straggler",
                                    "random_stall", "fail", "replica_offset")},
    "sim.corrupt_replica": _LOCAL_SGD,
    "sim.step_schedule": _methods(("aedit",)),
    "sim.fail_restart_s": _FT,
    **{f"checkpoint.{k}": ALWAYS for k in ("every", "keep", "final", "export_final")},
    **{k: ALWAYS for k in ("run_dir", "overwrite", "quiet", "resume")},
}
"""Every option (dotted) and where it applies."""


def option_names() -> list[str]:
    """Every option of :class:`Config`, dotted, in schema order (``sync.gta`` is one
    option: its table applies or not as a whole)."""
    names = []
    for f in dataclasses.fields(Config):
        if f.name in SECTIONS:
            names += [f"{f.name}.{g.name}" for g in dataclasses.fields(getattr(Config(), f.name))]
        else:
            names.append(f.name)
    return names


@functools.cache
def _defaults() -> Config:
    """The default configuration (built once: the sync section checks itself)."""
    return Config()


@functools.cache
def _default(option: str) -> Any:
    """The schema's default of ``option``."""
    node: Any = _defaults()
    for part in option.split("."):
        node = getattr(node, part)
    return node


def check_applicable(cfg: Config) -> None:
    """Refuse an option set away from its default where it does nothing (see
    :data:`APPLIES`).

    Raises:
        ConfigError: ``OPTION: applies only where WHERE (here NOW); leave it unset``.
    """
    for option, rule in APPLIES.items():
        if rule is ALWAYS:
            continue
        node: Any = cfg
        for part in option.split("."):
            node = getattr(node, part)
        if node != _default(option) and not rule.test(cfg):
            require(False, option, f"applies only where {rule.where} (here "
                    f"{rule.now(cfg)}); leave it unset")


def drop_inapplicable(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` (nested option dicts, as overrides) without the options that do not apply
    to the settings it holds itself (defaults for what it leaves out): for callers that
    lay one set of options over runs of several methods or modes, such as the benchmark
    scenarios (a sync interval given to every method, A-EDiT's run included).

    Args:
        raw: ``{"sync": {...}, "dist": {...}, ...}``; not changed.

    Returns:
        A copy without the inapplicable options.
    """
    defaults = _defaults()
    view = types.SimpleNamespace(**{
        f.name: (types.SimpleNamespace(**{**{g.name: getattr(getattr(defaults, f.name), g.name)
                                             for g in dataclasses.fields(getattr(defaults,
                                                                                 f.name))},
                                          **raw.get(f.name, {})})
                 if f.name in SECTIONS else raw.get(f.name, getattr(defaults, f.name)))
        for f in dataclasses.fields(Config)})
    out = {k: dict(v) if isinstance(v, dict) and k in SECTIONS else v for k, v in raw.items()}
    for option, rule in APPLIES.items():
        section, _, key = option.partition(".")
        if rule is ALWAYS or not key or key not in out.get(section, {}):
            continue
        if not rule.test(view):  # type: ignore[arg-type]
            del out[section][key]
    return out
