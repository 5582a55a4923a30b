"""Pseudo-gradient penalty: anomaly detection, replica weights and clipping.

This module is the pure-logic half of EDiT's pseudo-gradient penalty
(docs/algorithm.md, sections 5 and 6). It never talks to
``torch.distributed``: the sync engine gathers the ``R x L`` matrix of
pseudo-gradient norms (replicas x units) once per sync, and every rank then
calls the functions here with identical inputs, so every rank reaches the same
flags and weights without further communication.

Pieces:

- :class:`EWMADetector`: online mean/variance of one (unit, replica) norm
  series with a z-score outlier test. Outliers are fed back *winsorised*, so a
  burst of spikes cannot blind it while a lasting shift is still learned.
- :class:`DetectorBank`: one detector per (unit, replica); turns a norm matrix
  into ``included`` / ``outlier`` / ``z`` matrices. NaN/Inf norms are always
  excluded and never reach a detector.
- :func:`finite_mask`: the NaN/Inf exclusion alone, for runs without
  ``skip_anomaly``.
- :func:`compute_weights`: per-unit replica weights (uniform or norm softmax,
  optionally mixed with A-EDiT step weights), renormalised over the included
  replicas.
- :func:`clip_coefficient`: the scale factor of ``clip_pseudo_grad``.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, TypeVar

import torch
from torch import Tensor

from editrain.errors import plain_count, plain_scalar, require

__all__ = [
    "CLIP_EPS",
    "DetectorBank",
    "EWMADetector",
    "clip_coefficient",
    "compute_weights",
    "finite_mask",
]

# Added to the norm in the clip factor so a zero pseudo-gradient does not divide by zero.
CLIP_EPS = 1e-6


def _detector_args(alpha: Any, warmup: Any, threshold: Any) -> tuple[float, int, float]:
    """The detector's settings as plain numbers, or a :class:`~editrain.errors.ConfigError`
    (a ``ValueError``) in the words ``sync.ewma_*``'s checks use: the detector is built by
    Python callers too, with numpy scalars (taken, as the config takes them)."""
    alpha = plain_scalar(alpha, float, "ewma_alpha")
    # `a < x <= b` is False for NaN, which a plain `x <= a` test would let through.
    require(0.0 < alpha <= 1.0, "ewma_alpha", f"must be in (0, 1], got {alpha}")
    warmup = plain_count(warmup, "ewma_warmup_steps", least=0)
    threshold = plain_scalar(threshold, float, "ewma_threshold")
    require(0.0 < threshold < math.inf, "ewma_threshold",
            f"must be a finite number > 0, got {threshold}")
    return alpha, warmup, threshold


def _population_std(values: deque[float] | list[float]) -> float:
    """Population standard deviation (ddof=0, like ``numpy.std``); 1.0 when empty."""
    n = len(values)
    if n == 0:
        return 1.0
    # fsum keeps the result independent of summation order up to correct rounding.
    m = math.fsum(values) / n
    return math.sqrt(math.fsum((x - m) * (x - m) for x in values) / n)


class EWMADetector:
    """Online EWMA anomaly detector for one (unit, replica) norm series.

    Follows docs/algorithm.md section 6, except that ``mean`` and ``var`` start from
    the first observations instead of 0 (see :attr:`rate`; a start at 0 left the
    standard deviation several times too large after warm-up). The state is ``mean``
    and ``var`` (exponentially weighted), the number of updates ``count``
    and ``window``, the z-scores of the last ``warmup`` updates. While
    ``count < warmup`` nothing is flagged and ``z`` is 0.

    A value is an outlier when its z-score exceeds
    ``threshold * max(1, std(window))``: the window's spread widens the test
    when the series is naturally noisy in z units. The test is one-sided:
    only unusually *large* norms are anomalies.

    :meth:`observe` is the entry point for training: it judges a value on the
    current state, then updates with the raw value, or, for an outlier, with
    the winsorised value ``mean + threshold * sqrt(var)``. Feeding the raw
    spike would inflate the variance and hide the next spikes; feeding a huge
    penalised value (the reference implementation's +1e6) does the same. The
    winsorised value moves the statistics only a bounded amount per step,
    so a genuine, lasting level shift is still accepted after a while.

    All state is plain Python floats so checkpoints are exact and
    ``torch``-free.

    Args:
        alpha: EWMA smoothing factor in (0, 1] (config ``ewma_alpha``).
        warmup: number of updates before anything can be flagged; also the
            length of the z-score window (config ``ewma_warmup_steps``,
            counted in syncs).
        threshold: z-score threshold > 0 (config ``ewma_threshold``).
    """

    def __init__(self, alpha: float = 0.02, warmup: int = 120, threshold: float = 3.0) -> None:
        self.alpha, self.warmup, self.threshold = _detector_args(alpha, warmup, threshold)
        self.mean = 0.0
        self.var = 0.0
        self.count = 0
        self.window: deque[float] = deque(maxlen=self.warmup)

    # -- statistics ---------------------------------------------------------

    @property
    def rate(self) -> float:
        """The weight of the latest update: ``max(alpha, 1 / count)``. The first update
        sets ``mean`` to the value and ``var`` to 0, and until ``count`` reaches
        ``1 / alpha`` every observation weighs the same (running mean and variance): the
        statistics start from the first observations, not from 0, whose distance to the
        first norms would inflate ``var`` for hundreds of syncs."""
        return max(self.alpha, 1.0 / self.count) if self.count else self.alpha

    def z(self, v: float) -> float:
        """z-score of ``v`` under the current statistics.

        Args:
            v: a norm value.

        Returns:
            ``(v - mean) / sqrt(var)``, or 0.0 while ``count < warmup`` or
            ``var == 0``.
        """
        if self.count < self.warmup or self.var == 0.0:
            return 0.0
        return (float(v) - self.mean) / math.sqrt(self.var)

    def window_std(self) -> float:
        """Population std (ddof=0) of the z-score window; 1.0 when it is empty."""
        return _population_std(self.window)

    def update(self, v: float) -> None:
        """Fold ``v`` into the statistics and append its new z-score to the window.

        This does not judge ``v``; use :meth:`observe` during training.

        Args:
            v: a finite value (the raw norm, or the winsorised one for an outlier).

        Raises:
            ValueError: if ``v`` is NaN or infinite: it would poison ``mean`` and
                ``var`` for good, so callers must filter such norms first.
        """
        v = float(v)
        if not math.isfinite(v):
            raise ValueError(f"EWMADetector.update needs a finite value, got {v!r}")
        self.count += 1
        a = self.rate
        d = v - self.mean
        self.mean += a * d
        # West's incremental EW variance: uses both the old (d) and new (v - mean) residual.
        self.var = (1.0 - a) * (self.var + a * d * (v - self.mean))
        self.window.append(self.z(v))

    def is_outlier(self, v: float) -> bool:
        """Whether ``v`` is anomalous under the current state (no update).

        Args:
            v: a norm value.

        Returns:
            False while ``count < warmup``; else ``z(v) > threshold * max(1, std(window))``.
        """
        if self.count < self.warmup:
            return False
        return self.z(v) > self.threshold * max(1.0, self.window_std())

    def observe(self, v: float) -> tuple[bool, float]:
        """Judge ``v``, then update with it (winsorised if it is an outlier).

        Args:
            v: a finite norm value.

        Returns:
            ``(is_outlier, z)`` where ``z`` is the z-score of ``v`` *before* the update.
        """
        v = float(v)
        z = self.z(v)
        outlier = self.is_outlier(v)
        # Winsorise against the pre-update statistics: the clipped value sits exactly
        # on the decision boundary in sigma units, the largest "still normal" value.
        self.update(self.mean + self.threshold * math.sqrt(self.var) if outlier else v)
        return outlier, z

    # -- checkpointing ------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Plain-data snapshot: ``mean``, ``var`` (float), ``count`` (int), ``window`` (list).

        The hyper-parameters are not included: they come from the run's config,
        so a resumed run may change them.
        """
        return {
            "mean": self.mean,
            "var": self.var,
            "count": self.count,
            "window": list(self.window),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a snapshot made by :meth:`state_dict`.

        Args:
            state_dict: the snapshot. If its window is longer than this
                detector's ``warmup``, only the most recent entries are kept.
        """
        self.mean = float(state_dict["mean"])
        self.var = float(state_dict["var"])
        self.count = int(state_dict["count"])
        self.window = deque((float(x) for x in state_dict["window"]), maxlen=self.warmup)

    def __repr__(self) -> str:
        return (
            f"EWMADetector(alpha={self.alpha}, warmup={self.warmup}, threshold={self.threshold}, "
            f"mean={self.mean:.6g}, var={self.var:.6g}, count={self.count})"
        )


def finite_mask(norms: Tensor) -> Tensor:
    """Which norms are usable at all: finite (not NaN, not +/-Inf).

    A replica whose pseudo-gradient norm is not finite is excluded from its
    unit's sync whether or not ``skip_anomaly`` is on.

    Args:
        norms: ``[R, L]`` norm matrix (any float dtype).

    Returns:
        Bool tensor of the same shape.
    """
    return torch.isfinite(norms)


class DetectorBank:
    """One :class:`EWMADetector` per (unit, replica).

    Every rank gathers the full ``R x L`` norm matrix, so every rank holds an
    identical bank; it is checkpointed once, not per replica.

    Args:
        num_units: ``L``, the number of sync units.
        num_replicas: ``R``, the number of replicas (size of the sync group).
        alpha: EWMA smoothing factor (config ``ewma_alpha``).
        warmup: updates before flagging (config ``ewma_warmup_steps``).
        threshold: z-score threshold (config ``ewma_threshold``).
    """

    def __init__(
        self,
        num_units: int,
        num_replicas: int,
        alpha: float = 0.02,
        warmup: int = 120,
        threshold: float = 3.0,
    ) -> None:
        if num_units < 1 or num_replicas < 1:
            raise ValueError(
                f"DetectorBank needs num_units >= 1 and num_replicas >= 1, "
                f"got {num_units} and {num_replicas}"
            )
        self.alpha, self.warmup, self.threshold = _detector_args(alpha, warmup, threshold)
        self.num_units = int(num_units)
        self.num_replicas = int(num_replicas)
        # Indexed [unit][replica].
        self._detectors = [
            [self._new_detector() for _ in range(self.num_replicas)] for _ in range(self.num_units)
        ]

    def _new_detector(self) -> EWMADetector:
        return EWMADetector(self.alpha, self.warmup, self.threshold)

    def detector(self, unit: int, replica: int) -> EWMADetector:
        """The detector of one (unit, replica).

        Args:
            unit: unit index in ``[0, L)``.
            replica: replica index in ``[0, R)``.
        """
        return self._detectors[unit][replica]

    def observe(self, norms: Tensor, units: list[int] | None = None
                ) -> tuple[Tensor, Tensor, Tensor]:
        """Judge and learn one sync's norms.

        Non-finite norms are excluded and never fed to their detector (also
        during warm-up), so one NaN cannot poison a detector forever. Finite
        norms go through :meth:`EWMADetector.observe`.

        Args:
            norms: ``[R, L]`` pseudo-gradient norms (replicas x units), float32
                or float64, on any device.
            units: the units the ``L`` columns belong to (a fragment's sync); None: all
                units, in order.

        Returns:
            ``(included, outlier, z)``, each ``[R, L]`` on the CPU:
            ``included`` (bool) is finite and not an outlier; ``outlier``
            (bool) is the detector's verdict, False for non-finite norms since
            those were not judged (they are still excluded); ``z`` (float64)
            is the z-score before the update, NaN for non-finite norms.
        """
        units = list(range(self.num_units)) if units is None else list(units)
        if norms.dim() != 2 or tuple(norms.shape) != (self.num_replicas, len(units)):
            raise ValueError(
                f"expected norms of shape [R, L] = [{self.num_replicas}, {len(units)}], "
                f"got {tuple(norms.shape)}"
            )
        values = norms.detach().to(device="cpu", dtype=torch.float64).tolist()
        shape = (self.num_replicas, len(units))
        included = torch.zeros(shape, dtype=torch.bool)
        outlier = torch.zeros(shape, dtype=torch.bool)
        z = torch.full(shape, math.nan, dtype=torch.float64)
        for r, row in enumerate(values):
            for u, v in enumerate(row):
                if not math.isfinite(v):
                    continue
                flagged, z_ru = self._detectors[units[u]][r].observe(v)
                outlier[r, u] = flagged
                included[r, u] = not flagged
                z[r, u] = z_ru
        return included, outlier, z

    def resize(self, num_replicas: int) -> None:
        """Change ``R`` for an elastic restart.

        Detectors of replicas ``0 .. min(old R, new R) - 1`` are kept as they
        are (replica indices are assumed to keep their meaning); replicas
        beyond the old ``R`` get fresh detectors, which warm up again before
        they can flag anything.

        Args:
            num_replicas: the new ``R`` (>= 1).
        """
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        for unit in self._detectors:
            del unit[num_replicas:]
            unit.extend(self._new_detector() for _ in range(num_replicas - len(unit)))
        self.num_replicas = int(num_replicas)

    def state_dict(self) -> dict[str, Any]:
        """Plain-data snapshot of every detector.

        Layout: ``{"num_units": L, "num_replicas": R, "detectors": {"<unit>":
        {"<replica>": EWMADetector.state_dict()}}}`` with decimal string keys,
        which serialise unchanged through JSON and DCP.
        """
        return {
            "num_units": self.num_units,
            "num_replicas": self.num_replicas,
            "detectors": {
                str(u): {str(r): det.state_dict() for r, det in enumerate(unit)}
                for u, unit in enumerate(self._detectors)
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any], allow_resize: bool = False) -> None:
        """Restore a snapshot made by :meth:`state_dict`.

        Args:
            state_dict: the snapshot.
            allow_resize: accept a snapshot taken with a different ``R`` (an
                elastic resume). The bank keeps its current ``R``: detectors of
                replicas present in the snapshot are restored, the others are
                fresh (see :meth:`resize`). The number of units must always match.

        Raises:
            ValueError: on a unit-count mismatch, or a replica-count mismatch
                without ``allow_resize``.
        """
        saved_units = int(state_dict["num_units"])
        saved_replicas = int(state_dict["num_replicas"])
        if saved_units != self.num_units:
            raise ValueError(
                f"detector state has {saved_units} units, this model has {self.num_units}"
            )
        if saved_replicas != self.num_replicas and not allow_resize:
            raise ValueError(
                f"detector state has {saved_replicas} replicas, this run has "
                f"{self.num_replicas}; pass allow_resize=True for an elastic resume"
            )
        detectors = state_dict["detectors"]
        for u in range(self.num_units):
            for r in range(self.num_replicas):
                det = self._new_detector()
                if r < saved_replicas:
                    det.load_state_dict(detectors[str(u)][str(r)])
                self._detectors[u][r] = det


def compute_weights(
    norms: Tensor,
    included: Tensor,
    *,
    norm_softmax: bool,
    temperature: float = 1.0,
    step_counts: Tensor | None = None,
    step_weight_ratio: float = 0.5,
) -> Tensor:
    """Per-unit replica weights, renormalised over the included replicas.

    For each unit (column) ``u`` with included set ``I``:

    - ``w_j = softmax_j(-n_j / T)`` over ``j in I`` if ``norm_softmax``
      (larger pseudo-gradients weigh less), else ``w_j = 1 / |I|``;
    - with ``step_counts``: ``s_j = steps_j / sum_{k in I} steps_k`` (uniform
      over ``I`` if that sum is 0) and the weight becomes
      ``(1 - r) * w_j + r * s_j``.

    Excluded replicas get exactly 0 and their norms are never read, so a
    NaN there is harmless. A unit with no included replica gets an all-zero
    column (the caller then skips that unit's outer step).

    Args:
        norms: ``[R, L]`` pseudo-gradient norms.
        included: ``[R, L]`` bool, replicas taking part per unit.
        norm_softmax: use the norm softmax (config ``pseudo_gradnorm_reduce``).
        temperature: softmax temperature ``T > 0`` (config
            ``weight_softmax_temperature``).
        step_counts: ``[R]`` inner steps since the last sync per replica
            (A-EDiT ``use_step_weight``), or None.
        step_weight_ratio: ``r`` in [0, 1] (config ``step_weight_ratio``).

    Returns:
        ``[R, L]`` float64 weights (on the CPU) summing to 1 over each
        non-empty column.
    """
    if not (temperature > 0.0) or math.isinf(temperature):
        raise ValueError(
            f"weight_softmax_temperature must be a finite number > 0, got {temperature!r}"
        )
    if not (0.0 <= step_weight_ratio <= 1.0):
        raise ValueError(f"step_weight_ratio must be in [0, 1], got {step_weight_ratio!r}")
    if norms.dim() != 2 or norms.shape != included.shape:
        raise ValueError(
            f"norms and included must both be [R, L], got {tuple(norms.shape)} "
            f"and {tuple(included.shape)}"
        )
    n = norms.detach().to(device="cpu", dtype=torch.float64)
    inc = included.detach().to(device="cpu", dtype=torch.bool)
    if not bool(torch.isfinite(n[inc]).all()):
        raise ValueError("included replicas must have finite norms (exclude NaN/Inf first)")

    inc_f = inc.to(torch.float64)
    count = inc_f.sum(dim=0)  # [L]: |I| per unit
    nonempty = count > 0

    if norm_softmax:
        # Excluded entries become -inf logits so they get exp(...) = 0 exactly; the
        # column max is taken over included entries only (stable softmax).
        logits = torch.where(inc, -n / temperature, torch.full_like(n, -math.inf))
        col_max = logits.max(dim=0, keepdim=True).values
        # An empty column has max -inf; use 0 there to avoid (-inf) - (-inf) = NaN.
        col_max = torch.where(torch.isfinite(col_max), col_max, torch.zeros_like(col_max))
        e = torch.exp(logits - col_max)
        # Every non-empty column holds exp(0) = 1, so its sum is >= 1.
        total = e.sum(dim=0, keepdim=True)
        weights = e / torch.where(total > 0, total, torch.ones_like(total))
    else:
        weights = inc_f / torch.where(nonempty, count, torch.ones_like(count))

    if step_counts is not None:
        steps = step_counts.detach().to(device="cpu", dtype=torch.float64).reshape(-1)
        if steps.numel() != n.shape[0]:
            raise ValueError(
                f"step_counts must have one entry per replica ({n.shape[0]}), got {steps.numel()}"
            )
        if not bool(torch.isfinite(steps).all()) or bool((steps < 0).any()):
            raise ValueError(f"step_counts must be finite and >= 0, got {steps.tolist()}")
        s = steps[:, None] * inc_f  # [R, L], excluded replicas' steps do not count
        s_total = s.sum(dim=0, keepdim=True)
        uniform = inc_f / torch.where(nonempty, count, torch.ones_like(count))
        s = torch.where(s_total > 0, s / torch.where(s_total > 0, s_total, 1.0), uniform)
        weights = (1.0 - step_weight_ratio) * weights + step_weight_ratio * s

    return weights


_Norm = TypeVar("_Norm", float, Tensor)


def clip_coefficient(norm: _Norm, max_norm: float | None) -> _Norm:
    """Scale factor of pseudo-gradient clipping: ``min(1, c / (N + 1e-6))``.

    NaN in ``norm`` propagates to the result (for floats and tensors alike)
    instead of being silently turned into 1.

    Args:
        norm: ``N``, the norm of the reduced pseudo-gradient (float or tensor).
        max_norm: ``c > 0`` (config ``clip_pseudo_grad``), or None for no clipping.

    Returns:
        The factor, of the same type as ``norm`` (a float, or a tensor of
        ``norm``'s shape and dtype).
    """
    if max_norm is not None and (not (max_norm > 0.0) or math.isinf(max_norm)):
        raise ValueError(f"clip_pseudo_grad must be None or a finite number > 0, got {max_norm!r}")
    if isinstance(norm, Tensor):
        if max_norm is None:
            return torch.ones_like(norm)
        return torch.clamp(max_norm / (norm + CLIP_EPS), max=1.0)
    if max_norm is None:
        return 1.0
    ratio = max_norm / (float(norm) + CLIP_EPS)
    # Written so that a NaN ratio falls through to `ratio` (min(1.0, nan) would give 1.0).
    return 1.0 if ratio >= 1.0 else ratio
