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
    """Save and close a figure (a legend on every axis that has labelled artists).

    Args:
        fig: the matplotlib figure.
        path: the PNG to write.

    Returns:
        ``path``.
    """
    for ax in fig.axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path


__all__ = ["pyplot", "save_figure"]
