"""Freed large CPU blocks (``spill.engines.core.heap``): the torch engine keeps them in the heap,
counted in page faults of a fresh process, never in time; a budget returns them, counted in
the anonymous memory left after freeing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from spill.engines.core import heap

BLOCK = 2**24  # float32 elements: 64 MiB, above glibc's largest adaptive mmap threshold
ROUNDS = 10

CODE = f"""
import resource, sys, torch
from spill.engines.torch import heap
if sys.argv[1] == "keep":
    assert heap.keep_freed_blocks()
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = torch.ones({BLOCK}); del x
before = faults()
for _ in range({ROUNDS}):
    x = torch.ones({BLOCK}); del x
print(faults() - before)
"""


def _faults(how: str, env: dict[str, str] | None = None) -> int:
    proc = subprocess.run(
        [sys.executable, "-c", CODE, how],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout)


@pytest.mark.skipif(not heap.glibc(), reason="the thresholds are glibc's")
def test_a_freed_large_tensor_is_reused_not_faulted_in_again():
    default, kept = _faults("default"), _faults("keep")
    print(f"\npage faults for {ROUNDS} 64 MiB tensors: default {default}, kept {kept}")
    assert default > 3 * kept  # by default every block is mapped and zero-filled anew


def test_a_user_s_own_malloc_tuning_is_left_alone(monkeypatch):
    names = ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    assert not heap._user_tunes_malloc()
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.rtld.optional_static_tls=2048")
    assert not heap._user_tunes_malloc()  # a tunable of something else
    values = ("glibc.malloc.mmap_threshold=1048576", "1048576", "131072")
    for name, value in zip(names, values, strict=True):
        monkeypatch.setenv(name, value)
        assert heap._user_tunes_malloc()
        monkeypatch.delenv(name)


_HEAP = """
import re, sys
import numpy as np
from spill.engines.core import heap
budget = sys.argv[1] == "budget"
if budget:
    assert heap.return_between_layers()
def anon():
    return int(re.search(r"RssAnon:\\s+(\\d+)", open("/proc/self/status").read())[1]) << 10
big = np.ones(16 << 18, np.float32)  # 16 MiB mapped, freed: glibc raises its threshold past it
del big
start = anon()
blocks = [np.ones(2 << 18, np.float32) for _ in range(32)]  # 32 blocks of 2 MiB
last = blocks.pop()  # the heap's top stays in use: only free pages below it can go back
del blocks
if budget:
    heap.trim()  # what the ring does after each layer
print(anon() - start)
"""


@pytest.mark.skipif(not heap.glibc(), reason="the thresholds are glibc's")
def test_under_a_budget_freed_blocks_go_back_to_the_system_between_layers():
    """Without a budget 31 freed 2 MiB blocks stay in the heap below one still in use (the
    threshold rose past them when a 16 MiB block was freed); under one (``return_between_layers``)
    the trim the ring runs after each layer hands their pages back."""
    kept = {
        how: int(
            subprocess.run(
                [sys.executable, "-c", _HEAP, how], capture_output=True, text=True, check=True
            ).stdout
        )
        for how in ("default", "budget")
    }
    assert kept["default"] >= 48 << 20, kept
    assert kept["budget"] <= 8 << 20, kept
