"""The methods editrain offers, as configurations of one engine.

Every method is the same layer-wise sync machinery with different switches:

=============== ================ ======= ========== ========================= ====
method          outer            penalty layer-wise trigger                   H
=============== ================ ======= ========== ========================= ====
sync            --               --      --         warm-up that never ends   1
post_local_sgd  none (mean)      off     no         every H inner steps       10
diloco          Nesterov SGD     off     no         every H inner steps       10
edit            SGD lr 1, no     on      yes        every H inner steps       20
                momentum
aedit           as edit          on      yes        every local_sgd_sync_time --
=============== ================ ======= ========== ========================= ====

DiLoCo keeps its paper's outer optimizer (Nesterov SGD, lr 0.7, momentum 0.9: the same as
torchft's, so the two can be compared). EDiT's and A-EDiT's defaults are the recipe of the
tuning study (``editrain bench tune``, docs/benchmarks.md "tune"): at equal tokens EDiT's
gap to synchronous training's validation loss was +4.7% with Nesterov SGD (lr 0.7, momentum
0.9) and H = 10; outer SGD at lr 1 without momentum alone took it to +0.0%, H = 20 alone to
+3.3%, and both with a synchronous warm-up (and a higher inner learning rate) to -0.2%. A synchronous warm-up (``local_sgd_warmup_steps``, a
quarter of the run in the study) helps too but is a number of steps, so it is left to the
run (``examples/configs/recipe.toml``).
"""

from __future__ import annotations

from typing import Any

_LOCAL_SGD_COMMON: dict[str, Any] = {"local_sgd_sync_interval": 10}
_EDIT_COMMON: dict[str, Any] = {"local_sgd_sync_interval": 20}

NESTEROV_SGD: dict[str, Any] = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
"""DiLoCo's outer SGD."""
PLAIN_SGD: dict[str, Any] = {"lr": 1.0, "momentum": 0.0, "nesterov": False}
"""Outer SGD at lr 1 without momentum: the anchor moves to the (penalised) replica mean."""
OUTER_SGD: dict[str, dict[str, Any]] = {
    "diloco": NESTEROV_SGD,
    "edit": PLAIN_SGD,
    "aedit": PLAIN_SGD,
}
"""Per method, the outer SGD's keyword arguments when the outer optimizer is SGD and
``sync.outer_optim_kwargs`` is unset (the sparse codecs and the eager merge have their own,
``sync/config.py``)."""

METHOD_DEFAULTS: dict[str, dict[str, Any]] = {
    "sync": {
        "local_sgd_sync_interval": 1,
        "outer_optim_class": "none",
        "layerwise": False,
        "clip_pseudo_grad": 0.0,
        "pseudo_gradnorm_reduce": False,
        "skip_anomaly": False,
    },
    "post_local_sgd": {
        **_LOCAL_SGD_COMMON,
        "outer_optim_class": "none",
        "layerwise": False,
        "clip_pseudo_grad": 0.0,
        "pseudo_gradnorm_reduce": False,
        "skip_anomaly": False,
    },
    "diloco": {
        **_LOCAL_SGD_COMMON,
        "outer_optim_class": "sgd",
        "layerwise": False,
        "clip_pseudo_grad": 0.0,
        "pseudo_gradnorm_reduce": False,
        "skip_anomaly": False,
    },
    "edit": {
        **_EDIT_COMMON,
        "outer_optim_class": "sgd",
        "layerwise": True,
        "clip_pseudo_grad": 10.0,
        "pseudo_gradnorm_reduce": True,
        "skip_anomaly": True,
    },
    "aedit": {
        **_EDIT_COMMON,
        "outer_optim_class": "sgd",
        "layerwise": True,
        "clip_pseudo_grad": 10.0,
        "pseudo_gradnorm_reduce": True,
        "skip_anomaly": True,
    },
}
"""Per-method values for the ``SyncConfig`` fields a user left unset (``None``)."""

_ALL = ("sync", "post_local_sgd", "diloco", "edit", "aedit")
_LOCAL = ("post_local_sgd", "diloco", "edit", "aedit")
_INTERVAL = ("post_local_sgd", "diloco", "edit")
SYNC_OPTION_METHODS: dict[str, tuple[str, ...]] = {
    "method": _ALL,
    "local_sgd_sync_interval": _INTERVAL,
    "local_sgd_warmup_steps": _LOCAL,
    "outer_optim_class": _LOCAL,
    "outer_optim_kwargs": _LOCAL,
    "cpu_offload": _LOCAL,
    "prefetch_depth": _LOCAL,
    "layerwise": _LOCAL,
    "clip_pseudo_grad": _LOCAL,
    "pseudo_gradnorm_reduce": _LOCAL,
    "weight_softmax_temperature": _LOCAL,
    "skip_anomaly": _LOCAL,
    "ewma_alpha": _LOCAL,
    "ewma_warmup_steps": _LOCAL,
    "ewma_threshold": _LOCAL,
    "local_sgd_sync_time": ("aedit",),
    "min_total_global_steps": ("aedit",),
    "use_step_weight": ("aedit",),
    "step_weight_ratio": ("aedit",),
    "overlap_steps": _LOCAL,
    "fragments": _INTERVAL,
    "merge": _LOCAL,
    "merge_alpha": _LOCAL,
    "comm_dtype": _LOCAL,
    "error_feedback": _LOCAL,
    "error_decay": _LOCAL,
    "topk_chunk": _LOCAL,
    "topk_k": _LOCAL,
    "split_root": _ALL,
    "gta": _LOCAL,
}
"""Per ``SyncConfig`` field, the methods it does something under: sync (HSDP) has no
rounds, so nothing of a round applies to it; the step interval and staggered fragments
are the step-triggered methods' (A-EDiT syncs on the clock, every unit at once), and the
clock, its skip rule and its step weights are A-EDiT's. The command line refuses a field
set away from its default where it does not apply (:mod:`editrain.config.applicability`)."""
