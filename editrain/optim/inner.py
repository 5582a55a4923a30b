"""The trainer's inner optimizer from a run's configuration, and its gradient clipping.

``optim.name`` picks AdamW, AGD or SGD with the ``train`` section's hyper-parameters;
``optim.sam`` optionally wraps it in WSAM. Its learning rate follows
:mod:`editrain.optim.schedule`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from editrain.optim import build_optimizer, wrap_sam
from editrain.optim.wsam import global_norm


def uses_sam(cfg: Any) -> bool:
    """Whether ``optim.sam`` wraps the inner optimizer (its ``step`` then takes a closure)."""
    return cfg.optim.sam not in (None, "none")


def build_inner_optimizer(cfg: Any, params: Sequence[torch.nn.Parameter],
                          norm_group: dist.ProcessGroup | None) -> Optimizer:
    """The inner optimizer that ``cfg.optim`` and ``cfg.train`` describe.

    Args:
        cfg: the run's configuration.
        params: the (sharded) model's parameters.
        norm_group: the ranks holding one model copy between them: WSAM's gradient norm
            is summed over them.
    """
    o, t = cfg.optim, cfg.train
    params = list(params)
    if o.name == "adamw":
        opt = build_optimizer("adamw", params, lr=t.lr, betas=(t.beta1, t.beta2),
                              weight_decay=t.weight_decay)
    elif o.name == "agd":
        opt = build_optimizer("agd", params, lr=t.lr, betas=(t.beta1, t.beta2),
                              weight_decay=t.weight_decay, delta=o.agd_delta)
    else:
        opt = build_optimizer("sgd", params, lr=t.lr, momentum=o.momentum,
                              weight_decay=t.weight_decay)
    if not uses_sam(cfg):
        return opt
    return wrap_sam(o.sam, opt, rho=o.rho, gamma=o.gamma, adaptive=o.adaptive,
                    decouple=o.decouple, max_norm=t.grad_clip or None, norm_group=norm_group)


def clip_gradients(model: torch.nn.Module, max_norm: float, tp_size: int,
                   norm_group: dist.ProcessGroup | None, stage_size: int | None = None
                   ) -> None:
    """``train.grad_clip``: torch's clipping, or under tensor parallelism the norm over
    the replica's shard x tp ranks (``norm_group``) with every piece counted once
    (:func:`editrain.optim.wsam.global_norm`: the tensors split over different meshes
    there are beyond ``clip_grad_norm_``).

    With pipeline stages (``stage_size``: the ranks of one stage, shard x tp) ``model`` is
    this rank's stage and ``norm_group`` the whole replica, every stage: each rank's sum of
    squares, every local piece divided by the ranks of its stage holding it alike, is
    summed over ``norm_group``, so the norm is the whole model's."""
    if stage_size is not None:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        total = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads
                            else next(model.parameters()).device)
        for g in grads:
            pieces = 1
            if isinstance(g, DTensor):
                for dim, placement in enumerate(g.placements):
                    if not placement.is_replicate():
                        pieces *= g.device_mesh.size(dim)
                local = g.to_local()
            else:
                local = g
            copies = max(1, stage_size // pieces)
            total += local.detach().float().square().sum() / copies
        if norm_group is not None:
            dist.all_reduce(total, group=norm_group)
        coef = (max_norm / (total.sqrt() + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
        return
    if tp_size == 1:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    coef = (max_norm / (global_norm(grads, norm_group) + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
