"""Measuring leakage: the share of validation n-token windows that also occur in training."""

from __future__ import annotations

import numpy as np

__all__ = ["window_hashes", "window_overlap"]

_MUL = np.uint64(0x100000001B3)  # FNV-style odd multiplier; collisions are 2**-64-rare
_CHUNK = 1 << 22


def window_hashes(tokens: np.ndarray, n: int) -> np.ndarray:
    """64-bit hash of every window of ``n`` consecutive tokens (stride 1).

    Args:
        tokens: 1-D token ids.
        n: Window length.

    Returns:
        ``uint64[len(tokens) - n + 1]`` (empty when the array is shorter than ``n``).
    """
    m = len(tokens) - n + 1
    if m <= 0:
        return np.zeros(0, dtype=np.uint64)
    out = np.empty(m, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for s in range(0, m, _CHUNK):  # chunks keep memory bounded for large splits
            e = min(m, s + _CHUNK)
            ids = np.asarray(tokens[s : e + n - 1], dtype=np.uint64) + np.uint64(1)
            h = np.zeros(e - s, dtype=np.uint64)
            for j in range(n):
                h = h * _MUL + ids[j : j + e - s]
            out[s:e] = h
    return out


def window_overlap(val: np.ndarray, train: np.ndarray, n: int = 32) -> float:
    """Share of the validation split's ``n``-token windows that occur anywhere in training.

    Token-level and verbatim: a window counts when the same ``n`` ids appear in a row
    somewhere in ``train``. Windows are taken at every position (stride 1).

    Args:
        val: Validation token ids.
        train: Training token ids.
        n: Window length (32 by default).

    Returns:
        A share in [0, 1]; 0.0 when the validation split is shorter than ``n``.
    """
    v = window_hashes(val, n)
    if len(v) == 0:
        return 0.0
    t = np.unique(window_hashes(train, n))
    pos = np.searchsorted(t, v)
    hit = (pos < len(t)) & (t[np.minimum(pos, len(t) - 1)] == v)
    return float(hit.mean())
