"""glibc malloc settings under which a training process keeps the memory a step frees.

A CPU training step allocates and frees the same activation, gradient and optimizer
buffers at every step. With glibc's default settings the larger of them are ``mmap``-ed
afresh each time (the mmap threshold adapts to the blocks freed so far) and free memory at
the top of the heap is handed back to the kernel, so a step touches new pages and pays a
page fault for each (the kernel zeroes them). Measured on the tiny preset, 2 replicas x 1
process on 2 cores, through the library API: in most processes 1,000 to 3,000 minor page
faults and 4 to 7 ms of kernel time per step with the defaults; none and 0.3 to 0.5 ms
once these settings were applied, in the same processes. Whether a process faults depends
on its heap's layout, so some never do.

:func:`keep_freed_memory` is called by editrain's workers (``editrain train``) and by
:func:`editrain.init_mesh`, so a library user's loop runs with the same heap as the
command line's; the peers benchmark sets up torchft's workers the same way.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys

__all__ = ["MALLOC_ENV", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_memory",
           "release_freed_memory"]

MMAP_THRESHOLD = 32 * 2**20
"""Blocks of this size or more still get their own ``mmap`` (glibc's largest allowed
threshold); smaller ones come from the heap."""
TRIM_THRESHOLD = 2**31 - 1
"""Free memory at the top of the heap that glibc keeps instead of returning it."""
MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
              "MALLOC_MMAP_MAX_")
"""glibc's tuning variables: when the user set any of them, their choice stands."""

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3  # parameter numbers of mallopt, from <malloc.h>


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse by the next step.

    Sets the mmap threshold to :data:`MMAP_THRESHOLD` and the trim threshold to
    :data:`TRIM_THRESHOLD` with ``mallopt``. The process's resident memory then stays at
    its peak, as it does with PyTorch's caching allocator on a GPU. Does nothing on a
    C library other than glibc, or when any of :data:`MALLOC_ENV` is set; an allocator
    loaded with ``LD_PRELOAD`` (jemalloc, tcmalloc) ignores the settings.

    Returns:
        Whether both settings were applied.
    """
    mallopt = _glibc_function("mallopt", (ctypes.c_int, ctypes.c_int))
    if mallopt is None or any(name in os.environ for name in MALLOC_ENV):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def release_freed_memory() -> bool:
    """Hand the memory that glibc's malloc holds free back to the kernel (``malloc_trim``).

    glibc returns free memory by itself only from the top of a heap; what is freed below a
    block still in use, and the heaps of other threads (a tokenizer's worker threads each
    get one), stay resident. A long pass that frees much and keeps a little at a time (a
    token-cache build: each encoded batch freed, each document's description kept) then
    holds far more than it uses: on 150 MB of Python, ``editrain data``'s peak was 194 MiB
    with glibc's defaults, 156 MiB with a trim every second (2-core AMD EPYC). Does nothing
    on a C library other than glibc, or when any of :data:`MALLOC_ENV` is set (the user
    chose how freed memory is kept).

    Returns:
        Whether memory was handed back.
    """
    trim = _glibc_function("malloc_trim", (ctypes.c_size_t,))
    if trim is None or any(name in os.environ for name in MALLOC_ENV):
        return False
    return bool(trim(0))


@functools.cache
def _glibc_function(name: str, argtypes: tuple = ()):
    """glibc's function ``name`` (returning an int) through ctypes, or None on another C
    library; looked up once (finding the C library reads the interpreter's binary)."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    try:
        function = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = list(argtypes), ctypes.c_int
    return function
