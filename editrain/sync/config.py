"""Configuration of the sync engine: one dataclass per concern, named as in the reference.

``SyncConfig`` is what the engine consumes. Its fields that are ``None`` mean "the method's
default" and are filled in by :func:`SyncConfig.resolve`; the per-method defaults live in
:mod:`editrain.sync.methods` so that one table says what each method is.

This module imports no torch (nor does :mod:`editrain.sync`'s package): the configuration
is loaded and checked by commands that never train (``editrain data``). The outer
optimizer's checks import it where a check needs it (:meth:`SyncConfig._check_outer`).
"""

from __future__ import annotations

import math
import numbers
import typing
from dataclasses import dataclass, field, fields, replace
from typing import Any

from editrain.errors import SCALAR_KINDS, as_config_error, plain_scalar, require, spelled
from editrain.sync import codecs as sparse_codec
from editrain.sync.methods import METHOD_DEFAULTS, OUTER_SGD, PLAIN_SGD

METHODS = ("sync", "post_local_sgd", "diloco", "edit", "aedit")
REDUCERS = ("linear", "gta")
CONSENSUS = ("sum", "count")
SPARSIFICATION = ("magnitude", "random", "rescaled_random")
MERGES = ("blend", "keep_local", "eager")
EAGER_OUTER_SGD = PLAIN_SGD
"""The eager merge's outer SGD when ``outer_optim_kwargs`` is unset (docs/streaming.md
section 3c): Nesterov momentum 0.9 on top of the eager proxy oscillated in the convergence
benchmark; without momentum it ended below plain EDiT."""
COMM_DTYPES = ("fp32", "bf16", "int8", "int4", "topk2", "topk1")
SPARSE_CODECS = tuple(sparse_codec.BITS)
COMM_BACKENDS = ("auto", "gloo", "nccl", "default")
"""``dist.comm_backend``: the backend of the sync engine's private groups (see
:func:`editrain.sync.setup.comm_group_backend`)."""
SELF_CHECKED_OUTER = (None, "none", "sgd")
"""Outer optimizer names whose default keyword arguments need no construction to check:
no optimizer, or SGD with a constant of :mod:`editrain.sync.methods` (which torch accepts;
``tests/test_data_no_torch.py`` constructs each)."""


INT_MAX = 2**63 - 1
"""The largest integer any option takes: torch and numpy hold counts, steps and seeds as
int64, and a larger one overflows there (inside the workers) or never ends a loop."""


def check_number(value: Any, option: str) -> None:
    """A number, or every number inside a table or list, is finite and fits an int64.

    Args:
        value: an option's value; dicts and lists are walked (``nan`` inside
            ``sync.outer_optim_kwargs`` would otherwise train to NaN silently).
        option: the option's dotted name; items are named ``option.key`` / ``option[i]``.

    Raises:
        ConfigError: naming the option (or the item) and what is allowed.
    """
    if isinstance(value, bool):
        return
    if isinstance(value, float):
        require(math.isfinite(value), option, f"must be a finite number, got {value}")
    if isinstance(value, int):
        require(value <= INT_MAX, option, f"must be at most 2^63 - 1 ({INT_MAX}), got {value}")
        require(value >= -INT_MAX - 1, option, f"must be at least -2^63, got {value}")
    if isinstance(value, dict):
        for k, v in value.items():
            check_number(v, f"{option}.{k}")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            check_number(v, f"{option}[{i}]")


def check_types(section: Any, prefix: str) -> None:
    """Every bool, int and float field of a config dataclass holds a value of its type
    (``None`` where the field allows it), as the config files' loader checks them, and is
    stored as a plain Python value (see :func:`plain_scalar`: numpy scalars are taken).
    Built in Python, a config is not parsed: a computed ``local_sgd_warmup_steps = 0.05 *
    steps`` of 2.5 would never end the warm-up (the step counter never equals it), an
    interval of 2.5 would sync every 3 steps, and the string "false" would switch a flag on.

    Args:
        section: a config dataclass instance; its scalar fields are replaced by their
            plain values.
        prefix: the section's name, e.g. ``"sync"``.

    Raises:
        ConfigError: naming the option, the type it takes and the value given.
    """
    hints = typing.get_type_hints(type(section))
    for f in fields(section):
        args = typing.get_args(hints[f.name]) or (hints[f.name],)
        scalar = [a for a in args if a is not type(None)]
        if len(scalar) != 1 or scalar[0] not in SCALAR_KINDS:
            continue  # strings, tables, nested sections: checked by their own rules
        value = getattr(section, f.name)
        if value is None and type(None) in args:
            continue
        setattr(section, f.name, plain_scalar(value, scalar[0], f"{prefix}.{f.name}"))


def plain_numbers(value: Any) -> Any:
    """``value`` with every numpy (or other ``numbers``) integer and real inside its dicts,
    lists and tuples replaced by a plain ``int`` / ``float`` (bools, strings, tensors and
    anything else kept as they are): ``sync.outer_optim_kwargs`` as a Python user builds it
    (``{"lr": np.float32(0.7)}``), so that its range checks see a number and the outer
    optimizer's state saves plain values."""
    if isinstance(value, dict):
        return {k: plain_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_numbers(v) for v in value]
    if isinstance(value, tuple):  # e.g. betas
        return tuple(plain_numbers(v) for v in value)
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


def check_finite(section: Any, prefix: str) -> None:
    """Every number of a config dataclass, also inside its tables and lists, is finite
    (``inf`` and ``nan`` parse as floats, and would train on silently, e.g. ``train.lr =
    inf``) and fits an int64 (see :func:`check_number`).

    Args:
        section: a config dataclass instance (nested dataclasses are left to their own
            checks).
        prefix: the section's name, e.g. ``"train"``.
    """
    for f in fields(section):
        check_number(getattr(section, f.name), f"{prefix}.{f.name}")


OUTER_KWARG_RANGES: dict[str, tuple[Any, str]] = {
    "lr": (lambda v: v > 0, "must be > 0 (0 never moves the global model)"),
    "momentum": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "dampening": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "weight_decay": (lambda v: v >= 0, "must be >= 0"),
}
"""Ranges of outer optimizer arguments that torch's own checks leave open (it accepts lr 0
and a momentum of 1 or more, which diverges)."""


def check_outer_kwargs(kwargs: dict[str, Any]) -> None:
    """The outer optimizer's numeric arguments are in range (see
    :data:`OUTER_KWARG_RANGES`; every number was already checked to be finite).

    Args:
        kwargs: ``sync.outer_optim_kwargs`` as given.

    Raises:
        ConfigError: naming ``sync.outer_optim_kwargs.KEY`` and the allowed range.
    """
    for key, value in kwargs.items():
        if key in OUTER_KWARG_RANGES and isinstance(value, int | float) and not isinstance(
                value, bool):
            ok, allowed = OUTER_KWARG_RANGES[key]
            require(ok(value), f"sync.outer_optim_kwargs.{key}", f"{allowed}, got {value}")


@dataclass
class GTAConfig:
    """Optional GTA reducer (sparsification + sign consensus) over pseudo-gradients."""

    reducer: str | None = None
    """Reducer: none/"linear" (weighted mean) or "gta"."""
    consensus_method: str = "sum"
    """GTA sign consensus: "sum" (sign of the weighted sum) or "count" (majority of signs)."""
    sparsification_method: str | None = None
    """GTA sparsification: none, "magnitude", "random" or "rescaled_random"."""
    normalize: bool = True
    """GTA: divide by the summed weights of the replicas that kept each entry."""
    density: float = 1.0
    """GTA: fraction of entries kept by sparsification, in (0, 1]."""
    int8_mask: bool = False
    """GTA: keep masks as int8 to save memory (no numeric change)."""

    def __post_init__(self) -> None:
        check_types(self, "sync.gta")
        check_finite(self, "sync.gta")
        if self.reducer is not None:
            require(self.reducer in REDUCERS, "sync.gta.reducer",
                    f"unknown reducer {spelled(self.reducer)}; allowed: none, "
                    f"{', '.join(REDUCERS)}")
        require(self.consensus_method in CONSENSUS, "sync.gta.consensus_method",
                f"unknown method {spelled(self.consensus_method)}; allowed: {', '.join(CONSENSUS)}")
        if self.sparsification_method is not None:
            require(self.sparsification_method in SPARSIFICATION,
                    "sync.gta.sparsification_method",
                    f"unknown method {spelled(self.sparsification_method)}; allowed: none, "
                    f"{', '.join(SPARSIFICATION)}")
        require(0.0 < self.density <= 1.0, "sync.gta.density",
                f"must be in (0, 1], got {self.density}")


@dataclass
class SyncConfig:
    """The training method and every local-SGD option (names follow the EDiT reference)."""

    method: str = "edit"
    """Method: sync (HSDP), post_local_sgd, diloco, edit (layer-wise) or aedit (time-based)."""
    local_sgd_sync_interval: int | None = None
    """H: inner steps between syncs (edit, diloco, post_local_sgd). Default per method: 20
    for edit, 10 for diloco and post_local_sgd."""
    local_sgd_warmup_steps: int = 0
    """Synchronous (HSDP) steps before the local phase starts; anchors are created after them."""
    outer_optim_class: str | None = None
    """Outer optimizer over the anchors: "sgd", "adam", "adamw", "agd", a dotted class path in
    torch.optim or editrain.optim (no other module is imported: pass another class itself
    through the Python API), or "none" for plain model averaging. Default per method."""
    outer_optim_kwargs: dict[str, Any] | None = None
    """Keyword arguments of the outer optimizer (default for sgd: edit and aedit lr 1, no
    momentum (the tuning study's recipe); diloco lr 0.7, momentum 0.9, nesterov (DiLoCo's);
    with comm_dtype topk2 / topk1: lr 2, no momentum, the decayed error feedback standing
    in for it; else with merge = "eager": lr 1, no momentum)."""
    cpu_offload: bool = False
    """Keep anchors and outer optimizer state in CPU memory between syncs."""
    prefetch_depth: int = 1
    """Layer-wise sync: how many units ahead the collectives run (0 = no overlap)."""
    layerwise: bool | None = None
    """Sync unit by unit during the next forward (True) or all at once at the step boundary."""
    clip_pseudo_grad: float | None = None
    """Clip each unit's reduced pseudo-gradient to this norm (0 or none: off)."""
    pseudo_gradnorm_reduce: bool | None = None
    """Weight replicas by softmax(-norm / T) of their pseudo-gradient norms, per unit."""
    weight_softmax_temperature: float = 1.0
    """T of the pseudo-gradient norm softmax (> 0)."""
    skip_anomaly: bool | None = None
    """Exclude replicas whose pseudo-gradient norm is an EWMA outlier, per unit."""
    ewma_alpha: float = 0.02
    """Anomaly detector: EWMA smoothing factor in (0, 1]."""
    ewma_warmup_steps: int = 120
    """Anomaly detector: syncs observed before it may flag anything."""
    ewma_threshold: float = 3.0
    """Anomaly detector: z-score threshold (> 0)."""
    local_sgd_sync_time: float = 600.0
    """A-EDiT: wall-clock seconds between syncs."""
    min_total_global_steps: int = 1
    """A-EDiT: skip a sync (and restart clocks) when replicas did fewer steps in total (never
    the sync that reaches the train.steps budget: the run ends there)."""
    use_step_weight: bool = True
    """A-EDiT: mix step-count weights (steps since the last sync) into the replica weights."""
    step_weight_ratio: float = 0.5
    """A-EDiT: share r of the step weights in (1 - r) * w + r * s, in [0, 1]."""
    overlap_steps: int = 0
    """Streaming: inner steps a fragment's reduction runs behind training before its outer
    update is merged (tau; 0 = the sync of before, waited for in the next forward). A-EDiT:
    > 0 makes the sync non-blocking (the rendezvous runs behind training too)."""
    fragments: int = 1
    """Streaming: number of fragments (units strided over depth) that sync at staggered
    steps, H / fragments apart; 1 = every unit at once."""
    merge: str = "keep_local"
    """Streaming (overlap_steps > 0): "keep_local" (theta <- global + local progress since
    the launch), "blend" (theta <- lerp(global, theta, merge_alpha)), or "eager" (a whole
    round in flight, overlap_steps = H: each replica applies its own pseudo-gradient at once
    and the others' one round later); keep_local lost less loss than blend in the
    convergence benchmark."""
    merge_alpha: float = 0.0
    """Streaming, merge = "blend": share of the local parameters kept, in [0, 1]; a value
    > 0 needs merge = "blend" and overlap_steps > 0 (it is refused where it would be
    ignored)."""
    comm_dtype: str = "fp32"
    """Pseudo-gradients on the wire: fp32 (all-reduce), bf16, int8 or int4 (per-128-value
    scales), or sparse: topk2 / topk1 (the topk_k largest of every topk_chunk values, 2 or
    1 bits each plus packed positions; 1/128 of fp32 by default); all but fp32 are gathered
    and summed in fp32."""
    error_feedback: bool = True
    """Quantised comm_dtype: add each round's quantisation residual to the next
    pseudo-gradient."""
    error_decay: float | None = None
    """Error feedback: e <- decay * e + delta before encoding, in (0, 1]; none: 0.95 for
    topk2 / topk1 (SparseLoCo's), 1 for bf16 / int8 / int4."""
    topk_chunk: int | None = None
    """topk2 / topk1: values per chunk (none: 4096)."""
    topk_k: int | None = None
    """topk2 / topk1: values kept per full chunk, 1 .. topk_chunk (none: 64, 1.56%)."""
    split_root: bool = True
    """Trainer: shard embeddings and output head as units of their own (sync units too)."""
    gta: GTAConfig = field(default_factory=GTAConfig)
    """GTA reducer options."""

    def __post_init__(self) -> None:
        if isinstance(self.gta, dict):
            self.gta = GTAConfig(**self.gta)
        check_types(self, "sync")
        # First: numpy numbers inside would pass the finiteness and range checks unseen.
        self.outer_optim_kwargs = plain_numbers(self.outer_optim_kwargs)
        check_finite(self, "sync")
        require(self.method in METHODS, "sync.method",
                f"unknown method {spelled(self.method)}; allowed: {', '.join(METHODS)}")
        if self.local_sgd_sync_interval is not None:
            require(self.local_sgd_sync_interval >= 1, "sync.local_sgd_sync_interval",
                    f"must be >= 1, got {self.local_sgd_sync_interval}")
        require(self.local_sgd_warmup_steps >= 0, "sync.local_sgd_warmup_steps",
                f"must be >= 0, got {self.local_sgd_warmup_steps}")
        require(self.prefetch_depth >= 0, "sync.prefetch_depth",
                f"must be >= 0, got {self.prefetch_depth}")
        if self.clip_pseudo_grad is not None:
            require(self.clip_pseudo_grad >= 0, "sync.clip_pseudo_grad",
                    f"must be > 0 (or 0/none to disable), got {self.clip_pseudo_grad}")
        require(self.weight_softmax_temperature > 0, "sync.weight_softmax_temperature",
                f"must be > 0, got {self.weight_softmax_temperature}")
        require(0.0 < self.ewma_alpha <= 1.0, "sync.ewma_alpha",
                f"must be in (0, 1], got {self.ewma_alpha}")
        require(self.ewma_warmup_steps >= 0, "sync.ewma_warmup_steps",
                f"must be >= 0, got {self.ewma_warmup_steps}")
        require(self.ewma_threshold > 0, "sync.ewma_threshold",
                f"must be > 0, got {self.ewma_threshold}")
        require(self.local_sgd_sync_time > 0, "sync.local_sgd_sync_time",
                f"must be > 0 seconds, got {self.local_sgd_sync_time}")
        require(self.min_total_global_steps >= 0, "sync.min_total_global_steps",
                f"must be >= 0, got {self.min_total_global_steps}")
        require(0.0 <= self.step_weight_ratio <= 1.0, "sync.step_weight_ratio",
                f"must be in [0, 1], got {self.step_weight_ratio}")
        if self.outer_optim_kwargs is not None:
            require(isinstance(self.outer_optim_kwargs, dict), "sync.outer_optim_kwargs",
                    "must be a table, e.g. {lr = 0.7, momentum = 0.9, nesterov = true}")
        self._check_outer()
        self._check_streaming()

    def _check_outer(self) -> None:
        """The outer optimizer exists and accepts its keyword arguments (constructed once on
        a dummy parameter), for the method's default class too.

        No keyword arguments given and no optimizer or SGD (every method's default): its
        kwargs are the documented constants, nothing can fail, and torch is not imported
        (the construction cost ``editrain data`` about 1.35 s of torch.optim imports)."""
        name = self.outer_optim_class
        if name is None:
            name = METHOD_DEFAULTS[self.method].get("outer_optim_class")
        if self.outer_optim_kwargs is None and (
                name is None or (isinstance(name, str) and name.lower() in SELF_CHECKED_OUTER)):
            return
        from editrain.sync.outer import check_outer, outer_kwargs, resolve_optimizer_class

        with as_config_error():  # the optimizer module's own checks name the option
            cls = resolve_optimizer_class(name)
            check_outer(cls, outer_kwargs(cls, self.outer_optim_kwargs))
        if cls is not None:
            check_outer_kwargs(self.outer_optim_kwargs or {})

    def _check_streaming(self) -> None:
        # The types were checked by check_types (errors.plain_scalar); the ranges here are
        # worded as every other count's.
        require(self.overlap_steps >= 0, "sync.overlap_steps",
                f"must be >= 0, got {self.overlap_steps}")
        require(self.fragments >= 1, "sync.fragments", f"must be >= 1, got {self.fragments}")
        require(self.merge in MERGES, "sync.merge",
                f"unknown rule {spelled(self.merge)}; allowed: {', '.join(MERGES)}")
        require(isinstance(self.merge_alpha, (int, float)) and 0.0 <= self.merge_alpha <= 1.0,
                "sync.merge_alpha", f"must be in [0, 1], got {spelled(self.merge_alpha)}")
        if self.merge_alpha:
            # Only a delayed merge blends; anywhere else alpha would be silently ignored.
            require(self.merge == "blend", "sync.merge_alpha",
                    f"is the share of the local parameters in merge = \"blend\", but the merge "
                    f"is {spelled(self.merge)}: set sync.merge = \"blend\" or merge_alpha = 0")
            require(self.overlap_steps > 0, "sync.merge_alpha",
                    f"blends a delayed merge (sync.overlap_steps > 0); with overlap_steps = 0 "
                    f"the round's global model is taken as it is: set overlap_steps >= 1 or "
                    f"merge_alpha = 0, got merge_alpha = {self.merge_alpha}")
        require(self.comm_dtype in COMM_DTYPES, "sync.comm_dtype",
                f"unknown dtype {spelled(self.comm_dtype)}; allowed: {', '.join(COMM_DTYPES)}")
        streaming = self.overlap_steps > 0 or self.fragments > 1
        # Checked here, at construction, not in resolve(): before any data or run directory.
        h = self.local_sgd_sync_interval or METHOD_DEFAULTS[self.method].get(
            "local_sgd_sync_interval")
        eager = self.merge == "eager"
        if self.is_local_sgd and h is not None and not self.use_async:
            if eager:
                require(self.overlap_steps == h, "sync.overlap_steps",
                        f"must be local_sgd_sync_interval ({h}) with sync.merge = 'eager' "
                        f"(a whole round in flight), got {self.overlap_steps}")
            else:
                require(self.overlap_steps < h, "sync.overlap_steps",
                        f"must be < local_sgd_sync_interval ({h}), got {self.overlap_steps} "
                        f"(= {h} only with sync.merge = 'eager')")
            require(self.fragments <= h, "sync.fragments",
                    f"must be <= local_sgd_sync_interval ({h}), got {self.fragments}")
        if eager:
            require(self.is_local_sgd, "sync.merge",
                    "'eager' delays outer updates of a local-SGD method; sync (HSDP) has "
                    "none: use another method or merge = 'keep_local'")
            require(self.overlap_steps > 0, "sync.merge",
                    "'eager' needs a round in flight: set sync.overlap_steps (= "
                    "local_sgd_sync_interval, or >= 1 with aedit)")
            if self.use_async:
                require(self.min_total_global_steps <= 1, "sync.min_total_global_steps",
                        f"must be 0 or 1 with sync.merge = 'eager' (a replica applies its own "
                        f"pseudo-gradient at launch, so a round cannot be skipped once it "
                        f"has steps), got {self.min_total_global_steps}")
        if self.method == "sync":
            require(not streaming and self.comm_dtype == "fp32", "sync.method",
                    "sync (HSDP) averages gradients every step: overlap_steps, fragments and "
                    "comm_dtype apply to the local-SGD methods only")
        if self.method == "aedit":
            require(self.fragments == 1, "sync.fragments",
                    "aedit syncs every unit at once (on a wall-clock schedule): fragments must "
                    "be 1 (overlap_steps > 0 makes its sync non-blocking)")
        if self.comm_dtype != "fp32":
            require(self.gta.reducer in (None, "linear"), "sync.comm_dtype",
                    f"{self.comm_dtype} needs the linear reducer (sync.gta.reducer = "
                    f"{spelled(self.gta.reducer)} sends fp32 only)")
        self._check_codec()

    def _check_codec(self) -> None:
        """The sparse codecs' and the error feedback's options: in range, and refused where
        the codec would ignore them."""
        sparse = self.comm_dtype in SPARSE_CODECS
        for name in ("topk_chunk", "topk_k"):
            value = getattr(self, name)
            if value is None:
                continue
            require(sparse, f"sync.{name}",
                    f"applies to the sparse codecs (sync.comm_dtype = topk2 or topk1), but "
                    f"comm_dtype is {spelled(self.comm_dtype)}: leave it unset")
            require(value >= 1, f"sync.{name}", f"must be >= 1, got {value}")
        require(self.sparse_k <= self.sparse_chunk, "sync.topk_k",
                f"must be <= sync.topk_chunk ({self.sparse_chunk}), got {self.sparse_k}")
        if self.error_decay is not None:
            require(isinstance(self.error_decay, (int, float))
                    and not isinstance(self.error_decay, bool)
                    and 0.0 < self.error_decay <= 1.0, "sync.error_decay",
                    f"must be in (0, 1], got {spelled(self.error_decay)}")
            require(self.comm_dtype != "fp32" and self.error_feedback, "sync.error_decay",
                    "decays the error feedback of a quantised or sparse comm_dtype (with "
                    "sync.error_feedback = true); it would be ignored here: leave it unset")

    # ------------------------------------------------------------------ derived views
    @property
    def use_async(self) -> bool:
        """A-EDiT's time-based trigger (the reference's ``use_async``)."""
        return self.method == "aedit"

    @property
    def is_local_sgd(self) -> bool:
        """Whether the run ever leaves synchronous training."""
        return self.method != "sync"

    @property
    def streaming(self) -> bool:
        """Whether replicas may hold different models at every step boundary (delayed
        outer updates or staggered fragments)."""
        return self.overlap_steps > 0 or self.fragments > 1

    @property
    def sparse_chunk(self) -> int:
        """Values per chunk of the sparse codecs."""
        return sparse_codec.CHUNK if self.topk_chunk is None else self.topk_chunk

    @property
    def sparse_k(self) -> int:
        """Values kept per full chunk of the sparse codecs."""
        return sparse_codec.K if self.topk_k is None else self.topk_k

    @property
    def ef_decay(self) -> float:
        """The error feedback's decay (``error_decay``, or the codec's default)."""
        if self.error_decay is not None:
            return float(self.error_decay)
        return sparse_codec.DECAY if self.comm_dtype in SPARSE_CODECS else 1.0

    @property
    def penalty_enabled(self) -> bool:
        """Whether per-unit statistics are needed (any penalty part is on)."""
        return bool(self.skip_anomaly or self.pseudo_gradnorm_reduce)

    def resolve(self) -> SyncConfig:
        """A copy with every per-method default filled in (see ``methods.METHOD_DEFAULTS``)."""
        defaults = METHOD_DEFAULTS[self.method]
        updates = {
            f.name: defaults[f.name]
            for f in fields(self)
            if getattr(self, f.name) is None and f.name in defaults
        }
        out = replace(self, **updates)
        import torch  # the engine's side: resolving the optimizer class imports it anyway

        from editrain.sync.outer import outer_kwargs, resolve_optimizer_class

        cls = resolve_optimizer_class(out.outer_optim_class)
        given = out.outer_optim_kwargs
        if given is None and cls is torch.optim.SGD and out.comm_dtype in SPARSE_CODECS:
            given = dict(sparse_codec.OUTER_SGD)  # the sparse codecs' recipe (section 4b)
        elif given is None and cls is torch.optim.SGD and out.merge == "eager":
            given = dict(EAGER_OUTER_SGD)  # the eager merge's recipe (section 3c)
        elif given is None and cls is torch.optim.SGD and out.method in OUTER_SGD:
            given = dict(OUTER_SGD[out.method])  # the method's own (sync/methods.py)
        out.outer_optim_kwargs = outer_kwargs(cls, given)
        return out
