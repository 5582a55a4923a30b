"""AGD: an auto-switchable optimizer using the stepwise gradient difference.

Reference: Yue et al., "AGD: an auto-switchable optimizer using stepwise gradient
difference as preconditioning matrix", arXiv 2312.01658.

AGD keeps Adam's first moment ``m`` but replaces Adam's second moment of the gradient by
an exponential average ``b`` of the squared *stepwise difference* of the bias-corrected
momentum, ``s_t = m_t / (1 - beta1^t) - m_{t-1} / (1 - beta1^{t-1})``. That difference
is a cheap proxy for the local curvature along the trajectory. The denominator is
``max(sqrt(b_t), delta * sqrt(1 - beta2^t))``: where the curvature proxy is small the
floor wins, the denominator is the same for every such coordinate and AGD takes an SGD
with momentum step; elsewhere it takes an adaptive step.

State per parameter (all tensors, so ``state_dict`` / ``load_state_dict`` round-trip):

- ``step``: float64 scalar tensor on the CPU, the number of steps taken.
- ``exp_avg``: the momentum ``m``.
- ``exp_avg_diff_sq``: the average ``b`` of squared stepwise differences.
- ``max_exp_avg_diff_sq``: running max of ``b`` (only when ``amsgrad``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from editrain.errors import spelled

__all__ = ["AGD"]


def _validate_agd_group(group: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the offending hyper-parameter of one param group."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(
                f"lr must be a number or a one-element tensor, got shape {tuple(lr.shape)}"
            )
    elif not lr >= 0.0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    betas = group["betas"]
    if len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {spelled(betas)}")
    for index, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"betas[{index}] must be in [0, 1), got {beta}")
    if not group["delta"] > 0.0:
        raise ValueError(f"delta must be > 0, got {group['delta']}")
    if not group["weight_decay"] >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {group['weight_decay']}")
    clip = group["clip"]
    if clip is not None and not clip > 0.0:
        raise ValueError(f"clip must be > 0 or None, got {clip}")


class AGD(Optimizer):
    """AGD optimizer (auto-switching between SGD with momentum and an adaptive step).

    Per parameter at step ``t`` with gradient ``g``::

        m_t = beta1 * m_{t-1} + (1 - beta1) * g
        s_t = m_t / (1 - beta1^t) - m_{t-1} / (1 - beta1^{t-1})     (s_1 = m_1 / (1 - beta1))
        b_t = beta2 * b_{t-1} + (1 - beta2) * s_t^2                 (amsgrad: running max)
        u   = clamp(m_t / max(sqrt(b_t), delta * sqrt(1 - beta2^t)), -clip, clip)
        p  <- p - lr * sqrt(1 - beta2^t) / (1 - beta1^t) * u

    Works on plain tensors and on FSDP2 ``DTensor`` parameters: every update is
    element-wise, so each rank updates its own shard and no collective is issued.

    Args:
        params: iterable of parameters or of param-group dicts. Every hyper-parameter
            below may be overridden per group.
        lr: learning rate. For transformers the authors suggest about 1/10 of AdamW's.
        betas: ``(beta1, beta2)``, the decay rates of the momentum and of the
            stepwise-difference average; each in ``[0, 1)``.
        delta: the auto-switch threshold (> 0). Coordinates whose ``sqrt(b_t)`` falls
            below ``delta * sqrt(1 - beta2^t)`` take an SGD-with-momentum step. The
            authors use a much smaller value (e.g. ``1e-14``) for transformers.
        weight_decay: weight decay coefficient (>= 0).
        weight_decouple: if True, decoupled decay ``p <- p * (1 - lr * weight_decay)``
            (AdamW style); if False, L2 decay added to the gradient, ``g <- g + wd * p``.
        fixed_decay: with ``weight_decouple``, decay by ``p * (1 - weight_decay)``
            independently of ``lr``.
        amsgrad: use the running maximum of ``b_t`` in the denominator.
        clip: if set (> 0), clamp every coordinate of ``u`` to ``[-clip, clip]``.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        delta: float = 1e-5,
        weight_decay: float = 0.0,
        weight_decouple: bool = True,
        fixed_decay: bool = False,
        amsgrad: bool = False,
        clip: float | None = None,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            delta=delta,
            weight_decay=weight_decay,
            weight_decouple=weight_decouple,
            fixed_decay=fixed_decay,
            amsgrad=amsgrad,
            clip=clip,
        )
        # Validate the defaults up front so a bad constructor argument fails even when
        # every group overrides it; groups are validated again in add_param_group.
        _validate_agd_group(defaults)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group, validating its hyper-parameters before it is accepted.

        Args:
            param_group: dict with ``params`` and optional per-group hyper-parameters;
                missing ones are taken from the constructor's defaults.
        """
        merged = {**self.defaults, **param_group}
        _validate_agd_group(merged)
        super().add_param_group(param_group)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # Groups saved by an older version may lack newer keys; fill them with defaults.
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    def _init_state(self, p: torch.Tensor, amsgrad: bool) -> dict[str, Any]:
        state = self.state[p]
        if len(state) == 0:
            # The step lives on the CPU in float64: bias corrections such as
            # 1 - 0.999^t lose several digits in float32, and a CPU scalar is read by
            # device kernels without a host-device sync.
            state["step"] = torch.zeros((), dtype=torch.float64)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_diff_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if amsgrad and "max_exp_avg_diff_sq" not in state:
            # Created lazily so amsgrad can also be switched on for a resumed group.
            state["max_exp_avg_diff_sq"] = state["exp_avg_diff_sq"].clone()
        return state

    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimization step.

        Args:
            closure: optional callable that re-evaluates the model and returns the loss;
                it is run with gradients enabled before the update.

        Returns:
            The closure's loss, or None without a closure.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        for group in self.param_groups:
            lr = group["lr"]
            beta1, beta2 = group["betas"]
            delta = group["delta"]
            weight_decay = group["weight_decay"]
            clip = group["clip"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AGD does not support sparse gradients")
                state = self._init_state(p, group["amsgrad"])
                self._update_param(
                    p,
                    p.grad,
                    state,
                    lr=lr,
                    beta1=beta1,
                    beta2=beta2,
                    delta=delta,
                    weight_decay=weight_decay,
                    weight_decouple=group["weight_decouple"],
                    fixed_decay=group["fixed_decay"],
                    amsgrad=group["amsgrad"],
                    clip=clip,
                )
        return loss

    @staticmethod
    def _update_param(
        p: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, Any],
        *,
        lr: float | torch.Tensor,
        beta1: float,
        beta2: float,
        delta: float,
        weight_decay: float,
        weight_decouple: bool,
        fixed_decay: bool,
        amsgrad: bool,
        clip: float | None,
    ) -> None:
        step = state["step"]
        exp_avg = state["exp_avg"]
        exp_avg_diff_sq = state["exp_avg_diff_sq"]

        step += 1
        # Scalar coefficients stay tensors so the hot path never calls .item().
        bias_correction1 = 1.0 - beta1**step
        bias_correction2 = 1.0 - beta2**step
        # 1 / (1 - beta1^(t-1)) is infinite at t = 1, where m_0 = 0 and the previous
        # term must vanish; torch.where picks 0 there instead of forming 0 * inf = nan.
        inv_prev_bias_correction1 = torch.where(
            step > 1, (1.0 - beta1 ** (step - 1)).reciprocal(), torch.zeros_like(step)
        )

        if weight_decay != 0.0:
            if weight_decouple:
                decay = weight_decay if fixed_decay else lr * weight_decay
                p.mul_(1.0 - decay)
            else:
                grad = grad.add(p, alpha=weight_decay)

        # Bias-corrected momentum of the previous step, needed for the difference.
        prev_corrected = exp_avg.mul(inv_prev_bias_correction1)
        exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
        # s_t, written into the buffer of the previous momentum to save memory.
        diff = prev_corrected.neg_().add_(exp_avg.div(bias_correction1))
        exp_avg_diff_sq.mul_(beta2).addcmul_(diff, diff, value=1.0 - beta2)
        del diff

        if amsgrad:
            max_sq = state["max_exp_avg_diff_sq"]
            torch.maximum(max_sq, exp_avg_diff_sq, out=max_sq)
            second = max_sq
        else:
            second = exp_avg_diff_sq

        # D = max(sqrt(b), delta * sqrt(bc2)) = sqrt(bc2) * max(sqrt(b) / sqrt(bc2), delta).
        # Factoring sqrt(bc2) out lets the element-wise max use the plain float delta,
        # which every tensor type (including DTensor) accepts in clamp_min_.
        inv_sqrt_bc2 = bias_correction2.rsqrt()
        denom = second.sqrt().mul_(inv_sqrt_bc2).clamp_min_(delta)
        update = exp_avg.mul(inv_sqrt_bc2).div_(denom)
        del denom
        if clip is not None:
            update.clamp_(-clip, clip)

        step_size = lr * bias_correction2.sqrt() / bias_correction1
        p.sub_(update.mul_(step_size))
