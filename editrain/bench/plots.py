"""Matplotlib set-up and saving of the scenarios' PNG plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot():
    """matplotlib's pyplot on the non-interactive Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> Path:
    """Save ``fig`` as the PNG ``path`` and close it (a legend on every axis that has
    labelled artists); returns ``path``."""
    for ax in fig.axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


def median_bars(spreads: list[dict[str, Any]], missing: float = float("nan")
                ) -> tuple[list[float], list[list[float]]]:
    """Bar or point heights and min-max error bars (``yerr``) of ``stats.spread`` records:
    the medians (``missing`` where a spread has none, with no bar)."""
    ys = [missing if s["median"] is None else s["median"] for s in spreads]
    return ys, [[0.0 if s["median"] is None else s["median"] - s["min"] for s in spreads],
                [0.0 if s["median"] is None else s["max"] - s["median"] for s in spreads]]


__all__ = ["median_bars", "pyplot", "save_figure"]
