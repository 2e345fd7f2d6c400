"""A build's stages share one process: under a memory budget the build bounds the CPU math
libraries' per-shape caches before its first job, and between jobs it hands back what the last
one left (reference cycles collected, the heap trimmed), so that the next stage starts near where
a fresh job's process would (issue 38, docs/memory.md)."""

from __future__ import annotations

import gc
import os
import weakref
from types import SimpleNamespace

import pytest

from spill.engines.core import budget, heap
from spill.project.build.context import BuildContext

MIB = 1 << 20


def _ctx(memory: int | None) -> BuildContext:
    project = SimpleNamespace(engine=SimpleNamespace(budget=memory))
    return BuildContext(project, "mem://s", None, "sha", "key")  # type: ignore[arg-type]


def test_a_build_is_under_a_budget_given_memory_or_a_cgroup_limit(monkeypatch):
    monkeypatch.setattr(budget, "physical_memory", lambda: 16 << 30)
    monkeypatch.setattr(budget, "memory_limit", lambda: None)
    assert _ctx(300 * MIB).under_budget()
    assert not _ctx(None).under_budget()
    monkeypatch.setattr(budget, "memory_limit", lambda: 700 * MIB)  # a Slurm job's --mem
    assert _ctx(None).under_budget()
    monkeypatch.setattr(budget, "memory_limit", lambda: 32 << 30)  # above the RAM: no promise
    assert not _ctx(None).under_budget()


def test_the_shape_caches_are_bounded_unless_the_user_set_them(monkeypatch):
    for key in heap.SHAPE_CACHES:
        monkeypatch.delenv(key, raising=False)
    assert heap.bound_shape_caches()
    assert [os.environ[k] for k in heap.SHAPE_CACHES] == [str(heap.SHAPE_CACHE_ENTRIES)] * 2
    monkeypatch.delenv(heap.SHAPE_CACHES[0])
    monkeypatch.setenv(heap.SHAPE_CACHES[1], "1024")  # the user's word stands, for both
    assert not heap.bound_shape_caches()
    assert heap.SHAPE_CACHES[0] not in os.environ
    assert os.environ[heap.SHAPE_CACHES[1]] == "1024"


class _Runner:  # what a finished job leaves: an object only a reference cycle keeps alive
    def __init__(self) -> None:
        self.me = self
        self.rows = bytearray(4 * MIB)


@pytest.mark.skipif(not heap.glibc(), reason="malloc_trim is glibc's")
def test_release_collects_what_only_cycles_hold():
    gc.disable()  # as between two jobs when the collector has not run yet
    try:
        left = _Runner()
        alive = weakref.ref(left)
        del left
        assert alive() is not None
        heap.release()
        assert alive() is None
    finally:
        gc.enable()
