"""Statistics over seeds and repeats: medians, spreads, and whether a difference is real."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import Any


def finite(values: Iterable[Any]) -> list[float]:
    """The finite numbers among ``values`` (bools, None and NaN are dropped)."""
    return [float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool)
            and math.isfinite(v)]


def measured(value: Any, least: float = 0.0) -> float | None:
    """``value`` as a measurement read back from a run's rows: a JSON number (never a bool
    or a string), finite and at least ``least``; None for anything else, which the readers
    take as no measurement (a row they skip), as every reader of ``metrics.jsonl`` does
    with a row it cannot read (:func:`editrain.metrics.current_rows`). ``float()`` took
    ``true`` as 1 and parsed ``"0.5"``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value >= least else None


def median(values: Iterable[Any]) -> float | None:
    """Median of the finite values (None when there are none)."""
    xs = finite(values)
    return statistics.median(xs) if xs else None


def mean_std(values: Iterable[Any]) -> dict[str, Any]:
    """``mean``, sample ``std`` (0 for one value), ``min``, ``max``, ``n`` of finite values."""
    xs = finite(values)
    if not xs:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0,
            "min": min(xs), "max": max(xs), "n": len(xs)}


def spread(values: Iterable[Any]) -> dict[str, Any]:
    """Median and range of repeated measurements.

    Args:
        values: one value per repeat (missing or non-finite values are dropped).

    Returns:
        ``{"median", "min", "max", "n", "values"}`` (numbers None when nothing is finite).
    """
    xs = finite(values)
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0, "values": []}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs),
            "values": xs}


def beyond_spread(a: dict[str, Any], b: dict[str, Any], tolerance: float = 0.0) -> bool | None:
    """Whether two repeated measurements differ by more than their spread.

    True when the min-max ranges of ``a`` and ``b`` (from :func:`spread`) are more than
    ``tolerance`` apart, False otherwise. None when either has fewer than 2 repeats (one
    repeat has no spread, so nothing can be said).

    Args:
        a: one spread.
        b: the other.
        tolerance: a gap this small does not count (e.g. floating-point noise between
            deterministic runs, whose spread is 0).
    """
    if a.get("n", 0) < 2 or b.get("n", 0) < 2:
        return None
    return a["max"] + tolerance < b["min"] or b["max"] + tolerance < a["min"]


def paired_differences(a: Iterable[Any], b: Iterable[Any]) -> dict[str, Any]:
    """Per-pair differences ``a[i] - b[i]`` (pairs with a missing value are dropped).

    Args:
        a: values of one method, one per seed.
        b: values of the reference method for the same seeds, in the same order.

    Returns:
        :func:`mean_std` of the differences plus ``values`` (the differences) and
        ``same_sign`` (whether every difference has the sign of the mean; None without
        differences).
    """
    diffs = [x - y for x, y in zip(a, b) if finite([x]) and finite([y])]
    out = mean_std(diffs)
    out["values"] = diffs
    out["same_sign"] = (all((d > 0) == (out["mean"] > 0) and d != 0 for d in diffs)
                        if diffs else None)
    return out


def gap_to_sync(edit: list[float | None], sync: list[float | None]) -> dict[str, Any]:
    """EDiT's final losses against synchronous training's over paired seeds: both
    methods' :func:`mean_std` (``edit``, ``sync``), the paired ``gap`` (edit - sync, by
    :func:`paired_differences`) and ``relative_gap``, the gap's mean over sync's mean loss
    (None when either is missing)."""
    gap, s = paired_differences(edit, sync), mean_std(sync)
    return {"sync": s, "edit": mean_std(edit), "gap": gap,
            "relative_gap": gap["mean"] / s["mean"] if gap["mean"] is not None and s["mean"]
            else None}


def compare(a: str, b: str, sa: dict[str, Any], sb: dict[str, Any], tolerance: float = 0.0,
            **labels: Any) -> dict[str, Any]:
    """A comparison record of two named spreads: ``a``, ``b``, the ``labels``, the
    difference of the medians (None when either has none) and whether it is beyond the
    spread (:func:`beyond_spread`)."""
    known = sa.get("median") is not None and sb.get("median") is not None
    difference = sa["median"] - sb["median"] if known else None
    return {"a": a, "b": b, **labels, "difference": difference,
            "beyond_spread": beyond_spread(sa, sb, tolerance)}


def seed_losses(runs: list[Any]) -> list[float | None]:
    """Each run's final validation loss over the seeds, None for a run that failed."""
    return [r.final_val_loss if r.ok else None for r in runs]


__all__ = ["beyond_spread", "compare", "finite", "mean_std", "measured", "median",
           "paired_differences", "seed_losses", "spread"]
