"""Where freed CPU blocks go: kept for reuse (``keep_freed_blocks``); under a budget (``core.budget``)
reused within a layer and handed back after each (``return_between_layers``, the ring's ``trim``).
Between a build's jobs ``release`` hands back what the last one left, and under a budget
``bound_shape_caches`` keeps the math libraries' per-shape caches small. Where memory sits changes,
never a result; glibc's thresholds are left alone elsewhere (macOS, musl) or where the user set them.
"""

from __future__ import annotations

import ctypes
import gc
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


def _set(mmap_threshold: int, trim_threshold: int) -> bool:
    if not glibc() or _user_tunes_malloc():
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        mallopt(M_TRIM_THRESHOLD, trim_threshold)
    )


# Large CPU tensors reused instead of mapped afresh: glibc's malloc serves every block above its
# mmap threshold with a new mapping and unmaps it when freed, so each use of such a block zero-fills
# its pages again. The threshold follows the largest block freed, but only up to 32 MiB; a row
# batch's temporaries are larger (96 prompts of ~150 tokens through a 1536-wide MLP in float32: 88
# MB each), and the README's adapter eval at batch 96 spent 14.7 of its 22 s in the kernel faulting
# them in (0.9 s after ``keep_freed_blocks``). So the mmap threshold goes to 256 MiB and the
# top-of-heap trim threshold to 512 MiB, and such blocks stay in the heap and are reused.
def keep_freed_blocks() -> bool:
    """Set the thresholds (at every CPU open, so the last runner opened decides: one opened
    under a budget returns blocks, ``return_freed_blocks``); True when they were set."""
    return _set(MMAP_THRESHOLD, TRIM_THRESHOLD)


# Under a budget freed blocks stay in the heap while a layer runs, so its temporaries are reused
# rather than faulted in afresh, and the heap's free pages go back to the system after each layer
# (``trim``, called by the ring). glibc's own adaptive threshold (up to 32 MiB) without the trims
# left a tune step's freed temporaries in its arenas (~100 MiB more at the peak of SmolLM2's ``tune
# --ring 2 --memory 300MB``; with freed blocks kept, the 2.5 B model's tune inside 1567 MiB was
# OOM-killed); every block from 1 MiB a mapping of its own, unmapped when freed, held the peak but
# cost the 4-layer tune of report 021 1.3x its time and twice the system time in page faults.
def return_between_layers() -> bool:
    """Under a budget: freed blocks reused within a layer (``keep_freed_blocks``' thresholds),
    handed back when the ring calls ``trim`` after each; True where trimming can (glibc)."""
    keep_freed_blocks()
    return glibc()


def trim() -> bool:
    """Hand the heap's free pages back to the system now (glibc's ``malloc_trim``): a runner
    closed under a budget leaves its small blocks' pages to the next job of the process (65 MiB
    after SmolLM2's eval runner closed); True when some were returned."""
    if not glibc():
        return False
    return bool(ctypes.CDLL(None).malloc_trim(0))


# Torch's bfloat16 matmuls on a CPU go through oneDNN, which keeps what it built for each shape in two
# caches (oneDNN's primitive cache and ideep's LRU cache), 1024 entries each by default, and returns
# nothing until the process ends: 60 shapes of a bf16 linear's forward and backward held 277 MiB
# (15 MiB with 16 entries each). Every eval batch of another length is new shapes, and a build's next
# stage inherited them all: with the README's build inside 700 MiB, the tune started 80 MiB and the
# last eval 176 MiB above a fresh job's process, and the eval was OOM-killed. Within a job the
# entries are reused (a tune's shapes repeat each step): 64 each: a SmolLM2 tune step 14% slower.
SHAPE_CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
SHAPE_CACHE_ENTRIES = 64


def bound_shape_caches() -> bool:
    """Under a budget, before the process's first matmul (the libraries read these once): the
    per-shape caches keep ``SHAPE_CACHE_ENTRIES`` each, unless the environment already sets
    them; True when it set them."""
    if any(k in os.environ for k in SHAPE_CACHES):
        return False
    for key in SHAPE_CACHES:
        os.environ[key] = str(SHAPE_CACHE_ENTRIES)
    return True


def release() -> bool:
    """After a job, before the next one in the same process (a build's stages): collect what
    only reference cycles still hold (a tune's runner, ring and tokenizers stay alive until the
    collector runs: with them, SmolLM2's tune stage left the eval after it 454 MiB anonymous, 338
    without), then ``trim``; True when the trim returned pages."""
    gc.collect()
    return trim()
