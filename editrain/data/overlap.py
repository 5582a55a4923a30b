"""Measuring leakage: the share of validation n-token windows that also occur in training."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

__all__ = ["iter_window_hashes", "window_hashes", "window_overlap"]

_MUL = np.uint64(0x100000001B3)  # FNV-style odd multiplier; collisions are 2**-64-rare
_INV = np.uint64(pow(int(_MUL), -1, 1 << 64))  # its inverse modulo 2**64 (odd: one exists)
# Windows hashed at once: a piece's arrays (ids, prefix sums, hashes, the powers, the
# lookups' temporaries) are each 8 bytes per window; at 2**20 they added about 50 MB to a
# 1 GB build's peak, at 2**18 a quarter of that for the same speed (numpy's passes over
# 2 MB arrays stay in cache better).
_CHUNK = 1 << 18
# An odd multiplier (a bijection of 64-bit integers) that spreads every bit of a window's
# hash into its top bits, which the sample of max_windows compares.
_MIX = np.uint64(0xBF58476D1CE4E5B9)


def iter_window_hashes(tokens: np.ndarray, n: int, chunk: int | None = None
                       ) -> Iterator[np.ndarray]:
    """:func:`window_hashes` of ``tokens`` in consecutive pieces of at most ``chunk``
    windows (default ``_CHUNK``), so that a split far larger than memory (a memory map, a
    :class:`~editrain.data.pretokenized.TokenFile`) is hashed in bounded memory: about 32
    bytes per window of one piece.

    A window's hash ``sum(x[k + j] * M**(n - 1 - j))`` (``x`` = id + 1, modulo 2**64) is
    computed from prefix sums, in a few passes whatever ``n``: with ``c`` the running sum
    of ``x[t] * M**-t``, it is ``(c[k + n - 1] - c[k - 1]) * M**(k + n - 1)``, ``M**-1``
    being ``M``'s inverse modulo 2**64 (the ring's arithmetic makes it exact)."""
    chunk = chunk or _CHUNK
    m = len(tokens) - n + 1
    if m <= 0:
        return
    width = min(chunk, m)  # windows of the longest piece
    with np.errstate(over="ignore"):
        # Powers, relative to a piece's first token: M**-t, and M**(k + n - 1).
        inv_pow = np.ones(width + n - 1, dtype=np.uint64)
        np.cumprod(np.full(width + n - 2, _INV), out=inv_pow[1:])
        mul_pow = np.ones(width, dtype=np.uint64)
        np.cumprod(np.full(width - 1, _MUL), out=mul_pow[1:])
        mul_pow *= np.uint64(pow(int(_MUL), n - 1, 1 << 64))
        for s in range(0, m, chunk):
            e = min(m, s + chunk)
            x = np.asarray(tokens[s : e + n - 1]).astype(np.uint64)
            x += np.uint64(1)
            x *= inv_pow[: len(x)]
            c = np.cumsum(x, dtype=np.uint64)
            del x
            h = c[n - 1 : n - 1 + e - s].copy()
            h[1:] -= c[: e - s - 1]
            del c
            h *= mul_pow[: e - s]
            yield h


def window_hashes(tokens: np.ndarray, n: int) -> np.ndarray:
    """64-bit hash of every window of ``n`` consecutive tokens (stride 1).

    Args:
        tokens: 1-D token ids.
        n: Window length.

    Returns:
        ``uint64[len(tokens) - n + 1]`` (empty when the array is shorter than ``n``).
    """
    parts = list(iter_window_hashes(tokens, n))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint64)


def window_overlap(val: np.ndarray, train: np.ndarray, n: int = 32,
                   max_windows: int | None = None) -> float:
    """Share of the validation split's ``n``-token windows that occur anywhere in training.

    Token-level and verbatim: a window counts when the same ``n`` ids appear in a row
    somewhere in ``train``. Windows are taken at every position (stride 1). Memory grows
    with the validation windows measured only: the training split is hashed piece by piece
    and each piece's hashes looked up among the validation windows' (sorted, distinct).

    Args:
        val: Validation token ids (an array, or anything sliced like one, such as a
            :class:`~editrain.data.pretokenized.TokenFile`).
        train: Training token ids (the same).
        n: Window length (32 by default).
        max_windows: When the validation split has more windows than this, the share is
            estimated on the windows whose hash, mixed, falls below ``max_windows / windows``
            of the hash range: about ``max_windows`` of them, the same ones in every run,
            every copy of a window kept or left out together. None: every window.

    Returns:
        A share in [0, 1]; 0.0 when the validation split is shorter than ``n``.
    """
    windows = len(val) - n + 1
    if max_windows is not None and windows > max_windows:
        below = np.uint64(int(2**64 * max_windows / windows))
        with np.errstate(over="ignore"):
            parts = [h[h * _MIX < below] for h in iter_window_hashes(val, n)]
        v = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint64)
    else:
        v = window_hashes(val, n)
    if len(v) == 0:
        return 0.0
    distinct = np.unique(v)
    seen = np.zeros(len(distinct), dtype=bool)
    last = len(distinct) - 1
    # A table of the validation hashes' top bits, about 8 slots per hash: a training window
    # whose slot is empty cannot be a validation window, so only the few others (all the
    # true matches and about 1 in 8 of the rest) are searched for in the sorted hashes.
    bits = int(min(max(16, np.ceil(np.log2(8 * len(distinct)))), 30))
    shift = np.uint64(64 - bits)
    present = np.zeros(1 << bits, dtype=bool)
    present[(distinct >> shift).astype(np.intp)] = True
    for h in iter_window_hashes(train, n):
        h = h[present[(h >> shift).astype(np.intp)]]
        pos = np.minimum(np.searchsorted(distinct, h), last)
        seen[pos[distinct[pos] == h]] = True
    return float(seen[np.searchsorted(distinct, v)].mean())
