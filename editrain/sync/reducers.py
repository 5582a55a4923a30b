"""Cross-replica reduction of weighted pseudo-gradients.

Implements docs/algorithm.md section 5 step 6 (weighted mean) and section 7 (GTA).

A reducer turns this rank's shard of one unit's pseudo-gradient ``Delta_i``
and its replica weight ``w_i`` into the reduced pseudo-gradient ``Delta_bar``,
identical on every rank of the sync group. The reducers never touch
``torch.distributed`` themselves: the sync engine passes an
:data:`AllReduceSum` callable (an in-place sum over the sync group, issued on
its communication thread), which keeps the reducers testable in one process.

Every rank of a sync group must call :meth:`Reducer.reduce` with the same
reducer configuration and shard shape, because the collectives it issues are
matched by order across ranks. An excluded replica (``weight == 0``) still
issues them, contributing zeros.

Available reducers:

- :class:`MeanReducer`: ``sum_j w_j Delta_j``, one collective.
- :class:`GTAReducer`: sparsify, sign consensus, normalised sum (TIES-style
  merging of the replicas' pseudo-gradients), two collectives.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

__all__ = [
    "AllReduceSum",
    "CONSENSUS_METHODS",
    "GTAReducer",
    "MeanReducer",
    "REDUCERS",
    "Reducer",
    "SPARSIFICATION_METHODS",
    "build_reducer",
]

AllReduceSum = Callable[[Tensor], None]
"""In-place sum of a tensor across the ``R`` ranks of the sync group."""

CONSENSUS_METHODS = ("sum", "count")
SPARSIFICATION_METHODS = (None, "magnitude", "random", "rescaled_random")
REDUCERS = (None, "linear", "mean", "gta")

# Divisors (sum of agreeing weights) below this are replaced by 1 so entries nobody kept
# stay 0 instead of becoming 0/0.
_MIN_DIVISOR = 1e-8


@runtime_checkable
class Reducer(Protocol):
    """Reduces one unit's weighted pseudo-gradient shards across the sync group."""

    def reduce(
        self,
        delta: Tensor,
        weight: float,
        all_reduce: AllReduceSum,
        *,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Return the reduced pseudo-gradient shard, the same on every replica.

        Args:
            delta: this rank's local shard of ``Delta_i = A - theta`` (fp32,
                any shape). Not modified.
            weight: this replica's weight ``w_i >= 0`` for the unit. 0 means
                excluded: ``delta`` is then treated as zero, even if it holds
                NaN/Inf.
            all_reduce: in-place sum over the sync group.
            generator: RNG for random sparsification (ignored otherwise); on
                ``delta``'s device. None uses torch's default generator.

        Returns:
            A new tensor shaped and typed like ``delta``.
        """
        ...


def _check_weight(weight: float) -> float:
    weight = float(weight)
    if not math.isfinite(weight) or weight < 0.0:
        raise ValueError(f"replica weight must be finite and >= 0, got {weight!r}")
    return weight


def _weighted(delta: Tensor, weight: float) -> Tensor:
    """``weight * delta`` as a new tensor, exactly zero when the replica is excluded."""
    if weight == 0.0:
        # 0 * NaN is NaN: an excluded replica's delta must not be read at all.
        return torch.zeros_like(delta)
    return delta * weight


class MeanReducer:
    """Weighted sum ``sum_j w_j Delta_j`` (plain weighted averaging).

    The weights already sum to 1 over the included replicas
    (:func:`editrain.sync.penalty.compute_weights`), so the sum is the
    weighted mean. One collective per call.
    """

    collectives_per_call = 1

    def reduce(
        self,
        delta: Tensor,
        weight: float,
        all_reduce: AllReduceSum,
        *,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Weighted sum across the sync group; see :meth:`Reducer.reduce`.

        Args:
            delta: this rank's shard of the pseudo-gradient.
            weight: this replica's weight (0 = excluded).
            all_reduce: in-place sum over the sync group.
            generator: unused.
        """
        x = _weighted(delta, _check_weight(weight))
        all_reduce(x)
        return x

    def __repr__(self) -> str:
        return "MeanReducer()"


def _keep_count(density: float, numel: int) -> int:
    """``ceil(density * numel)`` without floating-point overshoot, at least 1 if numel > 0."""
    if numel == 0:
        return 0
    product = density * numel
    nearest = round(product)
    # 0.3 * 10 == 3.0000000000000004 in binary; a plain ceil would keep 4 entries, not 3.
    k = nearest if abs(product - nearest) <= 1e-12 * max(1.0, product) else math.ceil(product)
    return min(numel, max(1, k))


class GTAReducer:
    """Sparsify, elect a sign per entry, and merge only agreeing entries.

    Per call, on every rank of the sync group (docs/algorithm.md section 7):

    1. Sparsify this rank's ``delta``:

       - ``None``: keep everything;
       - ``"magnitude"``: keep the ``ceil(density * numel)`` entries of largest
         ``|delta|``. The top-k is taken over *this rank's local shard*, not
         the whole unit (as in the reference implementation, which works on
         FSDP flat shards): it needs no extra collective, and with even
         sharding each shard keeps the same fraction. Ties at the cut-off are
         broken by ``torch.topk``;
       - ``"random"``: keep each entry independently with probability
         ``density``; the mask is ``torch.rand(numel, generator) < density``
         over the flattened shard, so it is reproducible from ``generator``
         (which is advanced only when ``weight > 0`` and ``density < 1``);
       - ``"rescaled_random"``: the same mask, kept values divided by
         ``density`` (unbiased in expectation).

    2. ``x = w_i * delta_sparse`` (zeros for an excluded replica).
    3. Sign election, ties (and all-zero entries) count as ``+``:
       ``"sum"``: sign of ``sum_j x_j``; ``"count"``: sign of
       ``sum_j sign(x_j)``. ``mask_i = (x_i != 0) & (sign(x_i) == elected)``:
       dropped and excluded entries never count.
    4. ``numerator = sum_j x_j * mask_j``; with ``normalize``,
       ``divisor = sum_j w_j * mask_j`` (replaced by 1 where below 1e-8) and
       the result is ``numerator / divisor``, the weighted mean of the
       agreeing pseudo-gradients; otherwise the result is ``numerator``.

    Collectives per call: 2. The election needs one all-reduce of a
    ``numel``-sized tensor; the numerator and (with ``normalize``) the
    divisor are packed into one all-reduce of ``2 * numel`` (``numel``
    without ``normalize``).

    Args:
        consensus_method: ``"sum"`` or ``"count"``.
        sparsification_method: None, ``"magnitude"``, ``"random"`` or
            ``"rescaled_random"``.
        normalize: divide by the sum of agreeing weights.
        density: kept fraction in (0, 1]; must be 1 when
            ``sparsification_method`` is None.
        int8_mask: keep the masks as 1-byte bool tensors instead of tensors of
            ``delta``'s dtype; saves memory and changes no value.
    """

    collectives_per_call = 2

    def __init__(
        self,
        consensus_method: str = "sum",
        sparsification_method: str | None = None,
        normalize: bool = True,
        density: float = 1.0,
        int8_mask: bool = False,
    ) -> None:
        if consensus_method not in CONSENSUS_METHODS:
            raise ValueError(
                f"consensus_method must be one of {list(CONSENSUS_METHODS)}, "
                f"got {consensus_method!r}"
            )
        if sparsification_method not in SPARSIFICATION_METHODS:
            raise ValueError(
                f"sparsification_method must be one of {list(SPARSIFICATION_METHODS)}, "
                f"got {sparsification_method!r}"
            )
        if isinstance(density, bool) or not isinstance(density, (int, float)):
            raise ValueError(f"density must be a number in (0, 1], got {density!r}")
        if not (0.0 < density <= 1.0):
            raise ValueError(f"density must be in (0, 1], got {density!r}")
        if sparsification_method is None and density != 1.0:
            # Silently ignoring a density the user set would hide a config mistake.
            raise ValueError(
                f"density={density!r} has no effect without a sparsification_method; "
                f"set sparsification_method to one of {list(SPARSIFICATION_METHODS[1:])} "
                f"or density to 1.0"
            )
        self.consensus_method = consensus_method
        self.sparsification_method = sparsification_method
        self.normalize = bool(normalize)
        self.density = float(density)
        self.int8_mask = bool(int8_mask)

    def _mask_dtype(self, delta: Tensor) -> torch.dtype:
        return torch.bool if self.int8_mask else delta.dtype

    def _sparsify(self, flat: Tensor, generator: torch.Generator | None) -> Tensor:
        """Sparsified copy of the flattened shard (step 1)."""
        method = self.sparsification_method
        if method is None or self.density == 1.0:
            # density 1 keeps every entry for all three methods; skip the mask work.
            return flat
        mask_dtype = self._mask_dtype(flat)
        if method == "magnitude":
            k = _keep_count(self.density, flat.numel())
            keep = torch.zeros(flat.shape, dtype=mask_dtype, device=flat.device)
            if k > 0:
                idx = torch.topk(flat.abs(), k, sorted=False).indices
                keep[idx] = 1
            return flat * keep
        draw = torch.rand(flat.shape, generator=generator, dtype=torch.float32, device=flat.device)
        keep = (draw < self.density).to(mask_dtype)
        del draw
        sparse = flat * keep
        if method == "rescaled_random":
            sparse.div_(self.density)
        return sparse

    def reduce(
        self,
        delta: Tensor,
        weight: float,
        all_reduce: AllReduceSum,
        *,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """GTA merge across the sync group; see the class docstring and :meth:`Reducer.reduce`.

        Args:
            delta: this rank's shard of the pseudo-gradient.
            weight: this replica's weight (0 = excluded).
            all_reduce: in-place sum over the sync group; called twice.
            generator: RNG for ``"random"`` / ``"rescaled_random"``.
        """
        weight = _check_weight(weight)
        flat = delta.detach().reshape(-1)
        if weight == 0.0:
            x = torch.zeros_like(flat)
        else:
            x = self._sparsify(flat, generator) * weight

        # -- collective 1: sign election ------------------------------------
        if self.consensus_method == "sum":
            elect = x.clone()
        else:
            elect = torch.sign(x)
        all_reduce(elect)
        positive = elect >= 0  # ties and zeros vote +
        del elect
        # Keeps x_i > 0 where + won and x_i < 0 where - won; x_i == 0 never counts.
        agree = torch.where(positive, x > 0, x < 0)
        del positive
        mask = agree.to(self._mask_dtype(x))
        del agree

        # -- collective 2: numerator (and divisor), packed ------------------
        rows = 2 if self.normalize else 1
        packed = torch.empty((rows, flat.numel()), dtype=x.dtype, device=x.device)
        torch.mul(x, mask, out=packed[0])
        if self.normalize:
            # Copy first, then scale in x's dtype: a bool mask times a Python float would
            # be computed in the default dtype and round the weight for float64 deltas.
            packed[1].copy_(mask)
            packed[1].mul_(weight)
        del x, mask
        all_reduce(packed)

        if self.normalize:
            divisor = packed[1]
            divisor.masked_fill_(divisor < _MIN_DIVISOR, 1.0)
            result = packed[0] / divisor
        else:
            result = packed[0].clone()
        return result.reshape(delta.shape)

    def __repr__(self) -> str:
        return (
            f"GTAReducer(consensus_method={self.consensus_method!r}, "
            f"sparsification_method={self.sparsification_method!r}, "
            f"normalize={self.normalize}, density={self.density}, int8_mask={self.int8_mask})"
        )


# Values of the GTA options that mean "not set", accepted alongside the mean reducer.
_GTA_DEFAULTS = {
    "consensus_method": "sum",
    "sparsification_method": None,
    "normalize": True,
    "density": 1.0,
    "int8_mask": False,
}


def build_reducer(reducer: str | None, **gta_kwargs: object) -> Reducer:
    """Build the reducer named by the config.

    Args:
        reducer: None, ``"linear"`` or ``"mean"`` for :class:`MeanReducer`;
            ``"gta"`` for :class:`GTAReducer`.
        **gta_kwargs: :class:`GTAReducer` options (``consensus_method``,
            ``sparsification_method``, ``normalize``, ``density``,
            ``int8_mask``). With the mean reducer they may be passed only with
            their default value or None, so a GTA setting is never silently
            ignored.

    Raises:
        ValueError: unknown reducer, invalid GTA option values, or GTA options
            set while the mean reducer is selected.
        TypeError: unknown option names.
    """
    unknown = sorted(set(gta_kwargs) - set(_GTA_DEFAULTS))
    if unknown:
        raise TypeError(f"unknown GTA reducer options: {unknown}")
    if reducer in (None, "linear", "mean"):
        ignored = sorted(
            name
            for name, value in gta_kwargs.items()
            if value is not None and value != _GTA_DEFAULTS[name]
        )
        if ignored:
            raise ValueError(
                f"options {ignored} only apply to reducer='gta', but reducer={reducer!r}; "
                f"set reducer='gta' or remove them"
            )
        return MeanReducer()
    if reducer == "gta":
        return GTAReducer(**gta_kwargs)  # type: ignore[arg-type]
    raise ValueError(f"reducer must be one of {list(REDUCERS)}, got {reducer!r}")
