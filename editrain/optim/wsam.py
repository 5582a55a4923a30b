"""WSAM: weighted sharpness-aware minimization wrapped around any base optimizer.

Reference: Yue et al., "Sharpness-Aware Minimization Revisited: Weighted Sharpness as a
Regularization Term", KDD 2023, arXiv 2305.15817.

SAM minimizes the loss at a worst-case perturbation of radius ``rho``. WSAM instead adds
the sharpness ``L(w + e) - L(w)`` as a regularizer with weight ``alpha = gamma / (1 -
gamma)``, so its gradient is ``g0 + alpha * (g1 - g0)`` where ``g0`` is the clean gradient
and ``g1`` the gradient at the perturbed point. With ``decouple=True`` only ``g0`` goes
through the base optimizer (so its moments see clean gradients) and the sharpness term is
applied afterwards as a plain SGD step.

Who reduces what:

- Gradients are averaged across data-parallel replicas by the *closure* (that is, by the
  trainer's forward/backward, e.g. FSDP2's reduce-scatter), never by WSAM: only the
  caller knows which ranks hold replicas of the same parameters at that moment.
- WSAM itself issues exactly one collective per gradient-norm computation: the sum of
  squares of the local shards of sharded ``DTensor`` gradients is all-reduced over
  ``norm_group``, the process group across which the parameters are sharded (the FSDP
  shard group). It never touches the world group on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial
from torch.optim import Optimizer

from editrain.optim.hooks import StateDictHooks

__all__ = ["WSAM", "WeightedSAM", "global_norm"]

# Added to the gradient norm before dividing by it when clipping; the same guard as
# torch.nn.utils.clip_grad_norm_ so clipping behaves like the usual trainer clipping.
_CLIP_EPS = 1e-6

# Hyper-parameters WSAM adds to (and reads from) every param group of the base optimizer.
_GROUP_KEYS = ("rho", "gamma", "sam_eps", "adaptive", "decouple")


def _validate_wsam_group(group: dict[str, Any]) -> None:
    """Raise ``ValueError`` naming the offending WSAM hyper-parameter of one group."""
    if not group["rho"] >= 0.0:
        raise ValueError(f"rho must be >= 0, got {group['rho']}")
    if not 0.0 <= group["gamma"] < 1.0:
        raise ValueError(
            f"gamma must be in [0, 1) (alpha = gamma / (1 - gamma)), got {group['gamma']}"
        )
    if not group["sam_eps"] > 0.0:
        raise ValueError(f"sam_eps must be > 0, got {group['sam_eps']}")


def _shard_count(t: DTensor) -> int:
    """Number of ranks that each hold a different piece of ``t`` (1 if replicated)."""
    count = 1
    for mesh_dim, placement in enumerate(t.placements):
        if isinstance(placement, Partial):
            # A pending reduction means the closure returned before gradients were
            # reduced; the norm of such a gradient is meaningless.
            raise RuntimeError(
                "WSAM got a gradient with a Partial placement; the closure must finish the "
                "gradient reduction (e.g. FSDP2 backward) before returning"
            )
        if not placement.is_replicate():  # Shard, and FSDP2's strided shards over tp
            count *= t.device_mesh.size(mesh_dim)
    return count


class WSAM(StateDictHooks, Optimizer):
    """Weighted sharpness-aware minimization around a base optimizer.

    ``step(closure)`` does, per the paper:

    1. ``loss = closure()`` gives the clean gradient ``g0`` (clipped if ``max_norm``).
    2. ``gn = || w * g0 ||`` over all parameters, ``w = |p|`` if ``adaptive`` else 1.
    3. ``e = w^2 * g0 * rho / (gn + sam_eps)``; ``p <- p + e``.
    4. ``closure()`` again gives ``g1`` (clipped if ``max_norm``); ``p`` is restored.
    5. ``decouple=True``: base step with ``g0``, then ``p <- p - lr * alpha * (g1 - g0)``;
       ``decouple=False``: base step with ``alpha * g1 + (1 - alpha) * g0``.
    6. Returns the clean loss.

    The wrapper shares the base optimizer's param groups (``self.param_groups is
    base_optimizer.param_groups``) and state, and adds ``rho``, ``gamma``, ``sam_eps``,
    ``adaptive`` and ``decouple`` to every group, so they can be set per group (also by
    putting them in the base optimizer's group dicts) and LR schedulers work unchanged.

    The closure must itself zero the gradients, run forward and backward (including any
    gradient averaging across data-parallel replicas) and return the loss; it is called
    exactly twice per step. It must not scale or accumulate gradients across calls.

    ``state_dict()`` is the base optimizer's ``state_dict()`` (WSAM has no state that
    outlives a step), so checkpoints are interchangeable with the base optimizer's; state-dict
    hooks registered on the wrapper run around it (torch runs them inside the
    ``Optimizer.state_dict`` this class overrides: :class:`StateDictHooks` runs them). For
    ``torch.distributed.checkpoint`` helpers that may call ``step()`` without a closure
    to initialize state, pass ``wsam.base_optimizer`` instead.

    Args:
        params_or_model: the parameters being optimized, or the module owning them. Only
            used to check that they match ``base_optimizer``'s parameters (trainable
            parameters of a module that the base optimizer does not hold are an error).
        base_optimizer: the optimizer that takes the actual steps (AdamW, SGD, AGD, ...).
        rho: perturbation radius (>= 0).
        gamma: sharpness weight in ``[0, 1)``; ``alpha = gamma / (1 - gamma)``.
        sam_eps: added to the gradient norm before dividing by it (> 0).
        adaptive: scale the perturbation element-wise by ``p^2`` (ASAM style).
        decouple: apply the sharpness term outside the base optimizer (see above).
        max_norm: if set (> 0), clip ``g0`` and ``g1`` to this global norm before use.
        norm_group: process group over which the parameters are sharded (e.g. the FSDP2
            shard mesh's group), used to reduce squared norms of sharded ``DTensor``
            gradients; None for plain tensors or unsharded runs.
    """

    def __init__(
        self,
        params_or_model: nn.Module | Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        base_optimizer: Optimizer,
        rho: float = 0.05,
        gamma: float = 0.9,
        sam_eps: float = 1e-12,
        adaptive: bool = False,
        decouple: bool = True,
        max_norm: float | None = None,
        norm_group: dist.ProcessGroup | None = None,
    ) -> None:
        if not isinstance(base_optimizer, Optimizer):
            raise ValueError(
                f"base_optimizer must be a torch.optim.Optimizer, got {type(base_optimizer).__name__}"
            )
        if isinstance(base_optimizer, WSAM):
            raise ValueError("base_optimizer must not itself be a WSAM")
        if max_norm is not None and not max_norm > 0.0:
            raise ValueError(f"max_norm must be > 0 or None, got {max_norm}")
        defaults = dict(rho=rho, gamma=gamma, sam_eps=sam_eps, adaptive=adaptive, decouple=decouple)
        _validate_wsam_group(defaults)

        params = self._collect_params(params_or_model)
        self._check_same_params(params, base_optimizer)

        self.base_optimizer = base_optimizer
        self.max_norm = max_norm
        self.norm_group = norm_group
        # Optimizer.__init__ builds throw-away groups from `params` (it insists on some);
        # they are replaced right after by the base optimizer's groups.
        super().__init__(params, defaults)
        self._share_base_groups()

    # ------------------------------------------------------------------ construction

    @staticmethod
    def _collect_params(params_or_model: Any) -> list[torch.Tensor]:
        if isinstance(params_or_model, nn.Module):
            return [p for p in params_or_model.parameters() if p.requires_grad]
        params: list[torch.Tensor] = []
        for item in params_or_model:
            if isinstance(item, dict):
                params.extend(item["params"])
            else:
                params.append(item)
        if not params:
            raise ValueError("params_or_model holds no parameters")
        return params

    @staticmethod
    def _check_same_params(params: list[torch.Tensor], base_optimizer: Optimizer) -> None:
        given = {id(p) for p in params}
        held = {id(p) for group in base_optimizer.param_groups for p in group["params"]}
        if given != held:
            raise ValueError(
                "params_or_model must hold the same parameters as base_optimizer: "
                f"{len(given - held)} given but not in base_optimizer, "
                f"{len(held - given)} in base_optimizer but not given"
            )

    def _share_base_groups(self) -> None:
        # Sharing the list (not copies) keeps LR schedulers, the base optimizer and WSAM
        # looking at the same hyper-parameters; sharing the state dict keeps
        # `wsam.state` meaningful for tools that inspect it.
        self.param_groups = self.base_optimizer.param_groups
        self.state = self.base_optimizer.state
        for group in self.param_groups:
            for key in _GROUP_KEYS:
                group.setdefault(key, self.defaults[key])
            _validate_wsam_group(group)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group to the base optimizer (and hence to this wrapper).

        Args:
            param_group: dict with ``params``, optional base-optimizer hyper-parameters
                and optional WSAM hyper-parameters (``rho``, ``gamma``, ...).
        """
        if getattr(self, "base_optimizer", None) is None or (
            self.param_groups is not self.base_optimizer.param_groups
        ):
            # Only reached from Optimizer.__init__, while building the throw-away groups.
            super().add_param_group(param_group)
            return
        for key in _GROUP_KEYS:
            param_group.setdefault(key, self.defaults[key])
        _validate_wsam_group(param_group)
        self.base_optimizer.add_param_group(param_group)

    # ------------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """Return the base optimizer's state dict (its groups carry WSAM's keys too), with
        the state-dict hooks registered on this wrapper run around it."""
        return self._state_dict_with_hooks(self.base_optimizer.state_dict)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict produced by :meth:`state_dict` (or by the base optimizer).

        Args:
            state_dict: the dict to load; WSAM keys missing from its groups take this
                wrapper's defaults.
        """
        self._load_state_dict_with_hooks(state_dict, self._load_into_base)

    def _load_into_base(self, state_dict: dict[str, Any]) -> None:
        self.base_optimizer.load_state_dict(state_dict)
        # Optimizer.load_state_dict replaces the group list and state object, so the
        # sharing has to be re-established.
        self._share_base_groups()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients of every parameter (delegates to the base optimizer).

        Args:
            set_to_none: set gradients to None instead of filling them with zeros.
        """
        self.base_optimizer.zero_grad(set_to_none=set_to_none)

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:  # type: ignore[override]
        """Perform one WSAM step (two forward/backward passes, one base step).

        Args:
            closure: callable that zeros the gradients, runs forward and backward and
                returns the loss. Required.

        Returns:
            The loss of the first (clean) closure call.
        """
        if closure is None:
            raise RuntimeError(
                "WSAM.step requires a closure that zeros the gradients, runs forward and "
                "backward and returns the loss; it is called twice per step"
            )
        closure = torch.enable_grad()(closure)

        loss = closure()
        entries = [
            (group, p) for group in self.param_groups for p in group["params"] if p.grad is not None
        ]
        clean_grads = [p.grad.detach().clone() for _, p in entries]
        if self.max_norm is not None:
            self._clip_(clean_grads)

        saved_params = self._perturb(entries, clean_grads)
        closure()
        perturbed_grads = [
            p.grad if p.grad is not None else torch.zeros_like(p) for _, p in entries
        ]
        if self.max_norm is not None:
            self._clip_(perturbed_grads)
        # Restoring the saved copy undoes `p + e` exactly, without rounding drift.
        for (_, p), saved in zip(entries, saved_params):
            p.copy_(saved)
        del saved_params

        corrections = self._set_base_grads(entries, clean_grads, perturbed_grads)
        self.base_optimizer.step()
        for group, p, diff in corrections:
            # Read lr after the base step: it is the lr the base optimizer just used.
            p.sub_(diff.mul_(group["lr"] * self._alpha(group)))
        return loss

    @staticmethod
    def _alpha(group: dict[str, Any]) -> float:
        return group["gamma"] / (1.0 - group["gamma"])

    def _perturb(
        self, entries: list[tuple[dict[str, Any], torch.Tensor]], clean_grads: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Move every parameter to ``p + e`` and return copies of the clean values."""
        grad_norm = self._global_norm(
            g.mul(p.abs()) if group["adaptive"] else g
            for (group, p), g in zip(entries, clean_grads)
        )
        saved = []
        for (group, p), g in zip(entries, clean_grads):
            saved.append(p.detach().clone())
            e = g.mul(group["rho"] / (grad_norm + group["sam_eps"]))
            if group["adaptive"]:
                e.mul_(p).mul_(p)
            p.add_(e)
        return saved

    def _set_base_grads(
        self,
        entries: list[tuple[dict[str, Any], torch.Tensor]],
        clean_grads: list[torch.Tensor],
        perturbed_grads: list[torch.Tensor],
    ) -> list[tuple[dict[str, Any], torch.Tensor, torch.Tensor]]:
        """Put the gradient the base optimizer must see into ``p.grad``.

        Returns the ``(group, param, g1 - g0)`` triples still to be applied after the
        base step for decoupled groups.
        """
        corrections = []
        for (group, p), g0, g1 in zip(entries, clean_grads, perturbed_grads):
            alpha = self._alpha(group)
            if group["decouple"]:
                corrections.append((group, p, g1.sub_(g0)))
                p.grad = g0
            else:
                p.grad = g1.mul_(alpha).add_(g0, alpha=1.0 - alpha)
        return corrections

    def _clip_(self, grads: list[torch.Tensor]) -> None:
        """Scale ``grads`` in place so that their global norm is at most ``max_norm``."""
        total = self._global_norm(iter(grads))
        # A tensor clamp instead of a Python `if` keeps the step free of host syncs.
        coef = (self.max_norm / (total + _CLIP_EPS)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef)

    def _global_norm(
        self, tensors: Iterator[torch.Tensor] | Iterable[torch.Tensor]
    ) -> torch.Tensor:
        """L2 norm over all ``tensors`` as one vector, across shards (see
        :func:`global_norm`)."""
        return global_norm(tensors, self.norm_group)


def _sum_sq(t: torch.Tensor) -> torch.Tensor:
    # Accumulate in at least float32 so bf16 gradients do not lose the norm.
    dtype = torch.promote_types(t.dtype, torch.float32)
    return torch.linalg.vector_norm(t, dtype=dtype).square()


def global_norm(tensors: Iterable[torch.Tensor],
                norm_group: dist.ProcessGroup | None) -> torch.Tensor:
    """L2 norm over all ``tensors`` (gradients) as one vector, across the ranks that hold
    one model copy between them.

    Sharded ``DTensor``s contribute the sum of squares of their local shard, all-reduced
    over ``norm_group``, the ranks the parameters are spread over (the FSDP2 shard group;
    with tensor parallelism the replica's shard x tp ranks). A tensor cut into fewer pieces
    than the group has ranks (with tensor parallelism: a norm weight sharded by FSDP2 only,
    held alike by the tp peers) is counted once: its sum is scaled by pieces / ranks.
    Plain tensors and fully replicated ``DTensor``s contribute their full sum of squares
    once, without reduction.

    Raises:
        RuntimeError: sharded gradients without a ``norm_group``, or a group whose size is
            not a multiple of their pieces.
    """
    sharded: list[torch.Tensor] = []
    whole: list[torch.Tensor] = []
    for t in tensors:
        if isinstance(t, DTensor):
            shards = _shard_count(t)
            local = t.to_local()
            if shards > 1:
                ranks = _check_norm_group(norm_group, shards)
                sq = _sum_sq(local)
                sharded.append(sq if shards == ranks else sq * (shards / ranks))
                continue
            whole.append(_sum_sq(local))
        else:
            whole.append(_sum_sq(t))
    partials = sharded + whole
    if not partials:
        raise RuntimeError("WSAM found no gradients after the closure")
    dtype = torch.float64 if any(s.dtype == torch.float64 for s in partials) else torch.float32
    device = partials[0].device

    total_sharded = torch.zeros((), dtype=dtype, device=device)
    if sharded:
        total_sharded = torch.stack([s.to(dtype) for s in sharded]).sum()
    if norm_group is not None:
        # Every rank of the group must join the collective, even one that happens to
        # hold no sharded gradient, or the others would hang.
        dist.all_reduce(total_sharded, op=dist.ReduceOp.SUM, group=norm_group)
    total = total_sharded
    if whole:
        total = total + torch.stack([s.to(dtype) for s in whole]).sum()
    return total.sqrt()


def _check_norm_group(norm_group: dist.ProcessGroup | None, shards: int) -> int:
    """The ranks of ``norm_group``, checked against gradients cut into ``shards`` pieces."""
    if norm_group is None:
        raise RuntimeError(
            f"WSAM got DTensor gradients sharded over {shards} ranks but norm_group is "
            "None; pass the shard process group (e.g. mesh.get_group()) as norm_group "
            "so the gradient norm covers the whole model"
        )
    group_size = dist.get_world_size(norm_group)
    if group_size % shards:
        raise RuntimeError(
            f"norm_group has {group_size} ranks but the gradients are sharded over "
            f"{shards}; norm_group must be the ranks the parameters are spread over "
            "(a multiple of their pieces)"
        )
    return group_size


WeightedSAM = WSAM
