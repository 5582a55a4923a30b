"""Optimizers for editrain: AGD, WSAM and small factories used by the trainer.

``build_optimizer`` builds an inner or outer optimizer by name and ``wrap_sam`` optionally
wraps it in WSAM, so a config only needs two strings.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from editrain.errors import spelled
from editrain.optim.agd import AGD
from editrain.optim.wsam import WSAM, WeightedSAM

__all__ = [
    "AGD",
    "WSAM",
    "WeightedSAM",
    "build_optimizer",
    "wrap_sam",
    "OPTIMIZERS",
    "SAM_WRAPPERS",
]

# Name -> optimizer class. Frozen on purpose: adding a name is an API change.
OPTIMIZERS: dict[str, Callable[..., Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "sgd": torch.optim.SGD,
    "agd": AGD,
}

# Names accepted by wrap_sam; None is accepted too and means "none".
SAM_WRAPPERS: tuple[str, ...] = ("none", "wsam")


def build_optimizer(name: str, params: Iterable[Any], **kwargs: Any) -> Optimizer:
    """Build an optimizer by name.

    Args:
        name: one of ``adamw``, ``sgd``, ``agd`` (case-insensitive).
        params: parameters or param-group dicts, as for any ``torch.optim.Optimizer``.
        **kwargs: hyper-parameters forwarded to the optimizer's constructor.

    Returns:
        The optimizer.

    Raises:
        ValueError: if ``name`` is unknown (the message lists the allowed names), or if
            the optimizer rejects a hyper-parameter.
    """
    key = name.lower() if isinstance(name, str) else name
    if key not in OPTIMIZERS:
        raise ValueError(f"optimizer name must be one of {', '.join(sorted(OPTIMIZERS))}, "
                         f"got {spelled(name)}")
    return OPTIMIZERS[key](params, **kwargs)


def wrap_sam(name: str | None, optimizer: Optimizer, **kwargs: Any) -> Optimizer:
    """Optionally wrap ``optimizer`` in a sharpness-aware wrapper.

    Args:
        name: ``None`` or ``"none"`` to return ``optimizer`` unchanged, or ``"wsam"``
            (case-insensitive).
        optimizer: the base optimizer.
        **kwargs: WSAM arguments (``rho``, ``gamma``, ``sam_eps``, ``adaptive``,
            ``decouple``, ``max_norm``, ``norm_group``); must be empty for ``"none"``.

    Returns:
        ``optimizer`` itself, or a ``WSAM`` sharing its param groups and state.

    Raises:
        ValueError: on an unknown name, or on WSAM arguments given with ``"none"``.
    """
    key = "none" if name is None else (name.lower() if isinstance(name, str) else name)
    if key not in SAM_WRAPPERS:
        raise ValueError(
            f"SAM wrapper name must be null or one of {', '.join(SAM_WRAPPERS)}, got {spelled(name)}"
        )
    if key == "none":
        if kwargs:
            # Silently dropping rho etc. would hide a config mistake.
            raise ValueError(f"SAM arguments {sorted(kwargs)} given but the SAM wrapper is 'none'")
        return optimizer
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return WSAM(params, optimizer, **kwargs)
