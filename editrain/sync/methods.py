"""The methods editrain offers, as configurations of one engine.

Every method is the same layer-wise sync machinery with different switches:

=============== ============= ============ ========== =========================
method          outer         penalty      layer-wise trigger
=============== ============= ============ ========== =========================
sync            --            --           --         warm-up that never ends
post_local_sgd  none (mean)   off          no         every H inner steps
diloco          Nesterov SGD  off          no         every H inner steps
edit            Nesterov SGD  on           yes        every H inner steps
aedit           Nesterov SGD  on           yes        every local_sgd_sync_time s
=============== ============= ============ ========== =========================
"""

from __future__ import annotations

from typing import Any

_LOCAL_SGD_COMMON: dict[str, Any] = {"local_sgd_sync_interval": 10}

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
        **_LOCAL_SGD_COMMON,
        "outer_optim_class": "sgd",
        "layerwise": True,
        "clip_pseudo_grad": 10.0,
        "pseudo_gradnorm_reduce": True,
        "skip_anomaly": True,
    },
    "aedit": {
        **_LOCAL_SGD_COMMON,
        "outer_optim_class": "sgd",
        "layerwise": True,
        "clip_pseudo_grad": 10.0,
        "pseudo_gradnorm_reduce": True,
        "skip_anomaly": True,
    },
}
"""Per-method values for the ``SyncConfig`` fields a user left unset (``None``)."""
