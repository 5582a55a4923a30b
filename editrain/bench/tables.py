"""Markdown tables and the text of numbers in them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (cells formatted with :func:`cell`).

    Args:
        headers: column titles; the first column is left-aligned, the others right-aligned.
        rows: one sequence of cell values per row.
    """
    head = "| " + " | ".join(headers) + " |"
    sep = "|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|"
    body = ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join([head, sep, *body]) + "\n"


def cell(v: Any) -> str:
    """Table cell text: ``n/a`` for missing numbers, 4 significant digits otherwise."""
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if not math.isfinite(v):
            return "n/a"
        if v == 0:
            return "0"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.4g}"
    return str(v)


def spread_cell(s: dict[str, Any] | None, scale: float = 1.0) -> str:
    """``median [min-max]`` of a ``stats.spread`` record (only the median for one repeat).

    Args:
        s: the spread (``median``, ``min``, ``max``, ``n``).
        scale: multiply the numbers by this (e.g. 1000 for seconds shown as ms).
    """
    if not s or s.get("median") is None:
        return "n/a"
    text = cell(s["median"] * scale)
    if s.get("n", 0) < 2:
        return text
    return f"{text} [{cell(s['min'] * scale)}-{cell(s['max'] * scale)}]"


def verdict_cell(beyond: bool | None) -> str:
    """``yes`` / ``no`` / ``n/a (1 repeat)`` for a "beyond spread" column."""
    return "n/a (1 repeat)" if beyond is None else ("yes" if beyond else "no")


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b`` when both are known and ``b`` is not zero."""
    return None if a is None or b is None or b == 0 else a / b


def fmt_bytes(n: float | None) -> str:
    """``12.3 MiB`` style."""
    if n is None:
        return "n/a"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def mean_pm(stats: dict) -> str:
    """``mean +- std`` of a :func:`~editrain.bench.stats.mean_std` record (just the mean
    for one value, ``n/a`` for none)."""
    if stats.get("mean") is None:
        return "n/a"
    if stats.get("n", 0) < 2:
        return f"{stats['mean']:.4f}"
    return f"{stats['mean']:.4f} +- {stats['std']:.4f}"


def ms(v: float | None) -> float | None:
    """Seconds to milliseconds (None stays None)."""
    return None if v is None else v * 1000.0


def percent(x: float | None) -> str:
    """A fraction as a signed percentage, ``+3.4%``."""
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def spread_of(key: str, scale: float = 1.0):
    """A :class:`~editrain.bench.scenario.Table` column: :func:`spread_cell` of ``key`` in
    the row's entry (its last item), times ``scale``."""
    return lambda row: spread_cell(row[-1].get(key), scale)


def entry_cell(key: str, text: Any):
    """A :class:`~editrain.bench.scenario.Table` column: ``text`` (e.g. :func:`fmt_bytes`)
    of ``key`` in the row's entry (its last item)."""
    return lambda row: text(row[-1][key])


def per_seed(diff: dict[str, Any]) -> str | None:
    """A table cell: the per-seed values of a paired difference, signed."""
    return ", ".join(f"{v:+.4f}" for v in diff["values"]) or None


def best_first(losses: dict[str, float]) -> str:
    """``name loss`` pairs, lowest loss first."""
    return ", ".join(f"{k} {losses[k]:.4f}" for k in sorted(losses, key=losses.get))


def spread_columns(per_seed_key: str) -> list[tuple[str, Any]]:
    """Table columns of a row's ``final_val_loss`` over seeds (a ``mean_std`` record): its
    min, max and how many of the seeds (the list under ``per_seed_key``) finished."""
    def loss(row: Any) -> dict[str, Any]:
        return row[1]["final_val_loss"]

    return [("min", lambda row: loss(row)["min"]), ("max", lambda row: loss(row)["max"]),
            ("seeds ok", lambda row: f"{loss(row)['n']}/{len(row[1][per_seed_key])}")]


__all__ = ["best_first", "cell", "entry_cell", "fmt_bytes", "md_table", "mean_pm", "ms", "per_seed",
           "percent", "ratio", "spread_cell", "spread_columns", "spread_of", "verdict_cell"]
