"""The inner learning-rate schedule: linear warm-up, then cosine decay to a floor.

The trainer sets the rate before every step from its progress in synchronous-step
equivalents (:attr:`editrain.sync.SyncEngine.progress_steps`); the torchft peer of the
``peers`` benchmark follows the same schedule.
"""

from __future__ import annotations

import math
from typing import Any

from torch.optim import Optimizer


def lr_at(step: float, cfg: Any) -> float:
    """Linear warm-up then cosine decay to ``min_lr_ratio * lr`` over ``train.steps``.

    Args:
        step: progress, in (possibly fractional) steps.
        cfg: the run's configuration (its ``train`` section: ``lr``, ``warmup_steps``,
            ``steps``, ``min_lr_ratio``).
    """
    t = cfg.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def set_lr(optimizer: Optimizer, lr: float) -> None:
    """Set every param group of ``optimizer`` to learning rate ``lr``."""
    for group in optimizer.param_groups:
        group["lr"] = lr
