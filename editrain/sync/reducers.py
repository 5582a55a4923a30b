"""Cross-replica reduction of weighted pseudo-gradients.

Implements docs/algorithm.md section 5 step 6 (weighted mean) and section 7 (GTA).

A reducer turns this rank's shard of one unit's pseudo-gradient ``Delta_i``
and its replica weight ``w_i`` into the reduced pseudo-gradient ``Delta_bar``,
identical on every rank of the sync group. The reducers never touch
``torch.distributed`` themselves: the sync engine passes an
:data:`AllReduceSum` callable (an in-place sum over the sync group) and an
:data:`AllGather` callable (every replica's tensor, in replica order), both
issued on its communication thread, which keeps the reducers testable in one
process.

Every rank of a sync group must call :meth:`Reducer.reduce` with the same
reducer configuration, shard shape and ``weights`` list, because the
collectives it issues are matched by order across ranks. An excluded replica
(``weight == 0``) still issues them, contributing zeros.

Available reducers:

- :class:`MeanReducer`: ``sum_j w_j Delta_j``, one all-reduce.
- :class:`GTAReducer`: sparsify, sign consensus, normalised sum (TIES-style
  merging of the replicas' pseudo-gradients). Without sparsification two
  all-reduces; with it (``density < 1``) one all-gather of compact messages
  (the kept positions, packed, and the kept values), two for the random
  methods (the kept counts first), the arithmetic done locally.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from editrain.errors import spelled
from editrain.sync.sparse import index_bits, largest_positions, pack_bits, unpack_bits

__all__ = [
    "AllGather",
    "AllReduceSum",
    "CONSENSUS_METHODS",
    "GTAReducer",
    "MeanReducer",
    "REDUCERS",
    "Reducer",
    "SPARSIFICATION_METHODS",
    "build_reducer",
    "gta_message_bytes",
]

AllReduceSum = Callable[[Tensor], None]
"""In-place sum of a tensor across the ``R`` ranks of the sync group."""

AllGather = Callable[[Tensor], Tensor]
"""Every rank's tensor (the same shape on every rank) gathered over the sync group: a new
tensor ``[R, *shape]`` whose row ``j`` is replica ``j``'s, in the order of ``weights``."""

CONSENSUS_METHODS = ("sum", "count")
SPARSIFICATION_METHODS = (None, "magnitude", "random", "rescaled_random")
REDUCERS = (None, "linear", "mean", "gta")

# Divisors (sum of agreeing weights) below this are replaced by 1 so entries nobody kept
# stay 0 instead of becoming 0/0.
_MIN_DIVISOR = 1e-8

# Positions are packed this many at a time (a multiple of 8: every block ends on a byte),
# which bounds pack_bits' temporaries to a few MB whatever the number of kept values.
_PACK_BLOCK = 1 << 16


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
        weights: Sequence[float] | None = None,
        all_gather: AllGather | None = None,
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
            weights: every replica's weight, in the order of ``all_gather``'s rows
                (``weights[j]`` of this replica is ``weight``); needed by reducers that
                gather (GTA with sparsification).
            all_gather: gathers a tensor from every replica of the sync group.

        Returns:
            A new tensor shaped and typed like ``delta``.
        """
        ...


def _check_weight(weight: float) -> float:
    weight = float(weight)
    if not math.isfinite(weight) or weight < 0.0:
        raise ValueError(f"replica weight must be finite and >= 0, got {spelled(weight)}")
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
        weights: Sequence[float] | None = None,
        all_gather: AllGather | None = None,
    ) -> Tensor:
        """Weighted sum across the sync group; see :meth:`Reducer.reduce`.

        Args:
            delta: this rank's shard of the pseudo-gradient.
            weight: this replica's weight (0 = excluded).
            all_reduce: in-place sum over the sync group.
            generator: unused.
            weights: unused.
            all_gather: unused.
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


def _position_bits(numel: int) -> int:
    """Bits of one position in a shard of ``numel`` entries (one chunk of the whole shard)."""
    return index_bits(numel, numel)


def gta_message_bytes(numel: int, slots: int, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of one replica's GTA message: ``slots`` positions in a shard of ``numel``
    entries, packed ``max(1, ceil(log2(numel)))`` bits each (LSB first, padded to a whole
    byte), then ``slots`` values of ``dtype`` (4 bytes each in fp32)."""
    return -(-slots * _position_bits(numel) // 8) + slots * dtype.itemsize


def _largest(a: Tensor, k: int) -> Tensor:
    """Positions (ascending) of the ``k`` largest entries of ``a``; among entries equal to
    the ``k``-th largest value, the lower positions are kept (the sparse codecs' rule)."""
    n = a.numel()
    return largest_positions(a.reshape(1, n), min(k, n)).reshape(-1)


def _pack_positions(pos: Tensor, bits: int) -> Tensor:
    """:func:`pack_bits` block by block (the bytes are the same as in one call)."""
    if pos.numel() <= _PACK_BLOCK:
        return pack_bits(pos, bits)
    return torch.cat([pack_bits(pos[i:i + _PACK_BLOCK], bits)
                      for i in range(0, pos.numel(), _PACK_BLOCK)])


def _unpack_positions(packed: Tensor, count: int, bits: int) -> Tensor:
    """The first ``count`` positions of :func:`_pack_positions`' bytes."""
    step = _PACK_BLOCK * bits // 8  # bytes of one full block
    parts = []
    for start in range(0, count, _PACK_BLOCK):
        size = min(_PACK_BLOCK, count - start)
        offset = start // _PACK_BLOCK * step
        parts.append(unpack_bits(packed[offset:offset + -(-size * bits // 8)], size, bits))
    if not parts:
        return torch.zeros(0, dtype=torch.int64, device=packed.device)
    return torch.cat(parts)


def _encode(pos: Tensor, values: Tensor, numel: int, slots: int) -> Tensor:
    """One replica's message (``uint8``, :func:`gta_message_bytes` long): ``slots``
    positions packed, then ``slots`` values; slots past ``len(pos)`` hold position 0 and
    value 0 (a zero is never counted)."""
    padded_pos = torch.zeros(slots, dtype=torch.int64, device=values.device)
    padded_pos[:pos.numel()] = pos
    padded = torch.zeros(slots, dtype=values.dtype, device=values.device)
    padded[:values.numel()] = values
    return torch.cat([_pack_positions(padded_pos, _position_bits(numel)),
                      padded.view(torch.uint8)])


def _decode(message: Tensor, count: int, numel: int, slots: int, dtype: torch.dtype
            ) -> tuple[Tensor, Tensor]:
    """The first ``count`` positions and values of a message from :func:`_encode`."""
    bits = _position_bits(numel)
    index_bytes = -(-slots * bits // 8)
    pos = _unpack_positions(message[:index_bytes], count, bits)
    # The values may start at any byte: copy them before viewing them as dtype.
    raw = message[index_bytes:index_bytes + count * dtype.itemsize].clone()
    return pos, raw.view(dtype)


class GTAReducer:
    """Sparsify, elect a sign per entry, and merge only agreeing entries.

    Per call, on every rank of the sync group (docs/algorithm.md section 7):

    1. Sparsify this rank's ``delta``:

       - ``None``: keep everything;
       - ``"magnitude"``: keep the ``ceil(density * numel)`` entries of largest
         ``|delta|``. The top-k is taken over *this rank's local shard*, not
         the whole unit (as in the reference implementation, which works on
         FSDP flat shards): it needs no extra collective, and with even
         sharding each shard keeps the same fraction. Among entries tied at
         the cut-off the lower positions are kept;
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

    Transport. Without sparsification (``density == 1``) steps 3 and 4 run
    on dense tensors over all-reduces: the election needs one of ``numel``
    values, the numerator and (with ``normalize``) the divisor are packed
    into one of ``2 * numel`` (``numel`` without ``normalize``): 2
    collectives, ``3 * numel`` values through the all-reduce.

    With sparsification (``density < 1``) every replica sends one message of
    what it kept and every rank gathers them all (``all_gather``), then does
    steps 3 and 4 itself, summing in replica order in the shard's dtype
    (fp32 in the engine), with ``weights`` for the divisor: every rank gets
    the same bits. A message (:func:`gta_message_bytes`, ``uint8``) holds
    ``slots`` positions packed ``max(1, ceil(log2(numel)))`` bits each, then
    ``slots`` values of ``x`` (4 bytes each in fp32), positions ascending.
    ``"magnitude"``: ``slots = ceil(density * numel)`` on every replica, so
    one all-gather (1 collective); ``"random"`` / ``"rescaled_random"``: the
    kept counts differ, so every replica's count (one int64) is gathered
    first and every message is padded to the largest (2 collectives; none
    more when nobody kept anything). An excluded replica keeps nothing: its
    message is zeros (position 0, value 0), which never counts. Per replica
    that is about ``density * numel * (4 + log2(numel) / 8)`` bytes on the
    all-gather, against ``4 * numel`` through a mean's all-reduce.

    Args:
        consensus_method: ``"sum"`` or ``"count"``.
        sparsification_method: None, ``"magnitude"``, ``"random"`` or
            ``"rescaled_random"``.
        normalize: divide by the sum of agreeing weights.
        density: kept fraction in (0, 1]; must be 1 when
            ``sparsification_method`` is None.
        int8_mask: keep the dense path's masks as 1-byte bool tensors instead
            of tensors of ``delta``'s dtype; saves memory and changes no value
            (the sparse path's masks are bool, over the kept entries only).
    """

    collectives_per_call = 2
    """Collectives of one call at most (the magnitude transport issues 1)."""

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
                f"consensus_method must be one of {', '.join(CONSENSUS_METHODS)}, "
                f"got {spelled(consensus_method)}"
            )
        if sparsification_method not in SPARSIFICATION_METHODS:
            raise ValueError(
                f"sparsification_method must be null or one of "
                f"{', '.join(SPARSIFICATION_METHODS[1:])}, got {spelled(sparsification_method)}"
            )
        if isinstance(density, bool) or not isinstance(density, numbers.Real):  # numpy too
            raise ValueError(f"density must be a number in (0, 1], got {spelled(density)}")
        if not (0.0 < density <= 1.0):
            raise ValueError(f"density must be in (0, 1], got {spelled(density)}")
        if sparsification_method is None and density != 1.0:
            # Silently ignoring a density the user set would hide a config mistake.
            raise ValueError(
                f"density = {spelled(density)} has no effect without a sparsification_method; "
                f"set sparsification_method to one of {', '.join(SPARSIFICATION_METHODS[1:])} "
                f"or density to 1.0"
            )
        self.consensus_method = consensus_method
        self.sparsification_method = sparsification_method
        self.normalize = bool(normalize)
        self.density = float(density)
        self.int8_mask = bool(int8_mask)

    @property
    def sparse(self) -> bool:
        """Whether the reducer sparsifies (``density < 1``): it then gathers compact
        messages instead of all-reducing dense tensors."""
        # density 1 keeps every entry for all three methods.
        return self.sparsification_method is not None and self.density < 1.0

    def _mask_dtype(self, delta: Tensor) -> torch.dtype:
        return torch.bool if self.int8_mask else delta.dtype

    def _select(self, flat: Tensor, weight: float, generator: torch.Generator | None
                ) -> tuple[Tensor, Tensor]:
        """Steps 1 and 2 on the flattened shard: the kept positions (ascending) and the
        kept values of ``x = weight * delta_sparse``; nothing for an excluded replica."""
        if weight == 0.0:
            return (torch.zeros(0, dtype=torch.int64, device=flat.device),
                    flat.new_zeros(0))
        if self.sparsification_method == "magnitude":
            pos = _largest(flat.abs(), _keep_count(self.density, flat.numel()))
            return pos, flat[pos] * weight
        draw = torch.rand(flat.shape, generator=generator, dtype=torch.float32, device=flat.device)
        pos = (draw < self.density).nonzero().reshape(-1)
        del draw
        kept = flat[pos]
        if self.sparsification_method == "rescaled_random":
            kept.div_(self.density)
        return pos, kept * weight

    def reduce(
        self,
        delta: Tensor,
        weight: float,
        all_reduce: AllReduceSum,
        *,
        generator: torch.Generator | None = None,
        weights: Sequence[float] | None = None,
        all_gather: AllGather | None = None,
    ) -> Tensor:
        """GTA merge across the sync group; see the class docstring and :meth:`Reducer.reduce`.

        Args:
            delta: this rank's shard of the pseudo-gradient.
            weight: this replica's weight (0 = excluded).
            all_reduce: in-place sum over the sync group; called twice without
                sparsification, never with it.
            generator: RNG for ``"random"`` / ``"rescaled_random"``.
            weights: every replica's weight, in ``all_gather``'s row order
                (required with sparsification).
            all_gather: gathers from every replica (required with sparsification).

        Raises:
            ValueError: sparsification without ``weights`` or ``all_gather``, or
                ``weights`` not one per gathered replica.
        """
        weight = _check_weight(weight)
        flat = delta.detach().reshape(-1)
        if self.sparse and flat.numel():
            if weights is None or all_gather is None:
                raise ValueError("GTA with sparsification gathers compact messages: "
                                 "reduce() needs weights and all_gather")
            weights = [_check_weight(w) for w in weights]
            result = self._reduce_sparse(flat, weight, weights, all_gather, generator)
        else:
            result = self._reduce_dense(flat, weight, all_reduce)
        return result.reshape(delta.shape)

    def _reduce_dense(self, flat: Tensor, weight: float, all_reduce: AllReduceSum) -> Tensor:
        """Steps 2-4 on dense tensors, two all-reduces (no sparsification)."""
        x = _weighted(flat, weight)

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
            return packed[0] / divisor
        return packed[0].clone()

    def _reduce_sparse(self, flat: Tensor, weight: float, weights: list[float],
                       all_gather: AllGather, generator: torch.Generator | None) -> Tensor:
        """Steps 1-4 with the compact transport: gather every replica's kept positions
        and values, then elect, mask and sum locally in replica order."""
        n, dtype = flat.numel(), flat.dtype
        pos, values = self._select(flat, weight, generator)
        if self.sparsification_method == "magnitude":
            slots = _keep_count(self.density, n)
            counts = [slots] * len(weights)
        else:
            mine = torch.tensor([pos.numel()], dtype=torch.int64, device=flat.device)
            counts = [int(c) for c in all_gather(mine).reshape(-1).tolist()]
            if len(counts) != len(weights):
                raise ValueError(f"{len(weights)} weights for {len(counts)} replicas")
            slots = max(counts)
            if slots == 0:  # nobody kept anything (every rank knows): nothing to send
                return torch.zeros_like(flat)
        gathered = all_gather(_encode(pos, values, n, slots))
        if gathered.shape[0] != len(weights):
            raise ValueError(f"{len(weights)} weights for {gathered.shape[0]} replicas")
        del pos, values
        # Excluded replicas (weight 0) sent zeros and never count: skip them.
        parts = [(w, *_decode(gathered[j], counts[j], n, slots, dtype))
                 for j, w in enumerate(weights) if w > 0.0]
        del gathered

        # Every sum below adds the replicas' kept entries in replica order; an entry a
        # replica did not keep adds 0, so it equals the dense formulas summed in that order.
        elect = torch.zeros_like(flat)
        for _, p, v in parts:
            elect.index_add_(0, p, v if self.consensus_method == "sum" else torch.sign(v))
        positive = elect >= 0  # ties and zeros vote +
        del elect
        numerator = torch.zeros_like(flat)
        divisor = torch.zeros_like(flat) if self.normalize else None
        for w, p, v in parts:
            # x_j > 0 where + won, x_j < 0 where - won; a kept 0 never counts.
            agree = torch.where(positive[p], v > 0, v < 0)
            numerator.index_add_(0, p, v * agree)
            if divisor is not None:
                divisor.index_add_(0, p, agree.to(dtype).mul_(w))
        if divisor is None:
            return numerator
        divisor.masked_fill_(divisor < _MIN_DIVISOR, 1.0)
        return numerator.div_(divisor)

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
                f"options {', '.join(ignored)} only apply to reducer = \"gta\", but reducer = "
                f"{spelled(reducer)}; set reducer = \"gta\" or remove them"
            )
        return MeanReducer()
    if reducer == "gta":
        return GTAReducer(**gta_kwargs)  # type: ignore[arg-type]
    raise ValueError(f"reducer must be null or one of {', '.join(REDUCERS[1:])}, "
                     f"got {spelled(reducer)}")
