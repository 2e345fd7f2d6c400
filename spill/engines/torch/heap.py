"""Large CPU tensors reused instead of mapped afresh: glibc's malloc serves every block above
its mmap threshold with a new mapping and unmaps it when freed, so each use of such a block
zero-fills its pages again. The threshold follows the largest block freed, but only up to
32 MiB; a row batch's temporaries are larger (96 prompts of ~150 tokens through a 1536-wide MLP
in float32: 88 MB each), and the README's adapter eval at batch 96 spent 14.7 of its 22 s in
the kernel faulting them in (0.9 s after ``keep_freed_blocks``).

``keep_freed_blocks()`` raises the mmap threshold to 256 MiB and the top-of-heap trim threshold
to 512 MiB, so such blocks stay in the heap and are reused. Where memory sits changes, never a
result. A no-op where the C library is not glibc (macOS, musl) or where the user has set
glibc's malloc tunables.
"""

from __future__ import annotations

import ctypes
import functools
import os

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 256 * 2**20
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD


def _user_tunes_malloc() -> bool:
    env = os.environ
    return "glibc.malloc." in env.get("GLIBC_TUNABLES", "") or any(
        k in env for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
    )


def glibc() -> bool:
    try:
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (ValueError, OSError):  # not a name this platform knows
        return False


@functools.cache
def keep_freed_blocks() -> bool:
    """Set the thresholds once per process; True when they were set."""
    if not glibc() or _user_tunes_malloc():
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
