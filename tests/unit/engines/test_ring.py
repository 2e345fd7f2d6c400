"""The streaming ring (``spill.engines.core.ring``), without any engine: sizing from a memory
budget, prefetch that really runs ahead, at most K layers alive, any walking order, hooks, clean
stops. Layers are numpy arrays; torch and mlx are never imported."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from spill.engines.base import Stats
from spill.engines.core.common import plan_ring
from spill.engines.core.ring import Hooks, Ring
from spill.errors import EngineError

LAYERS = 6


def fake_ring(slots, resident=False, delay=0.0, fail_at=None, hooks=None):
    """A ring over a loader that builds layer i as {"w": array filled with i}."""
    loads = []

    def load(i):
        if i == fail_at:
            raise OSError(f"layer {i} unreadable")
        time.sleep(delay)
        loads.append((i, threading.current_thread().name))
        return {"w": np.full(4, i, np.float32)}

    return Ring(load, LAYERS, slots, resident, Stats(), hooks), loads


def test_the_core_imports_no_engine():
    code = (
        "import sys\n"
        "import spill.engines.core.open, spill.engines.core.numerics\n"
        "heavy = [m for m in ('torch', 'mlx') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_plan_ring():
    gib = 1 << 30
    assert plan_ring(28, gib, ring=None, resident=False, budget=40 * gib) == (28, True)
    assert plan_ring(28, gib, ring=None, resident=False, budget=28 * gib) == (28, True)
    assert plan_ring(28, gib, ring=None, resident=False, budget=10 * gib + 5) == (10, False)
    assert plan_ring(28, gib, ring=None, resident=False, budget=gib // 2) == (2, False)
    assert plan_ring(28, gib, ring=2, resident=False, budget=40 * gib) == (2, False)
    assert plan_ring(4, gib, ring=9, resident=False, budget=0) == (4, False)
    assert plan_ring(28, gib, ring=2, resident=True, budget=0) == (28, True)
    with pytest.raises(EngineError):
        plan_ring(28, gib, ring=0, resident=False, budget=0)


def test_prefetch_runs_ahead_and_never_exceeds_the_ring():
    ring, loads = fake_ring(slots=2)
    seen = []
    for i, w in ring.walk(range(LAYERS)):
        seen.append((i, float(w["w"][0])))
        if i == 0:
            time.sleep(0.2)  # layer 0 "computes"; the loader fetches layer 1 meanwhile
            assert ring.live() == {0, 1}
        assert len(ring.live()) <= 2
    assert seen == [(i, float(i)) for i in range(LAYERS)]
    assert all(name == "spill-ring" for _, name in loads)
    assert ring.max_live == 2 and ring.live() == set()
    assert ring.stats.layer_loads == LAYERS and ring.stats.load_seconds > 0


@pytest.mark.parametrize("slots", [1, 3])
def test_any_order_and_ring_size(slots):
    ring, _ = fake_ring(slots=slots)
    order = list(reversed(range(LAYERS)))  # the backward pass walks in reverse
    got = []
    for i, w in ring.walk(order):
        time.sleep(0.02)  # slow compute: the loader fills every free slot
        got.append((i, float(w["w"][0])))
    assert got == [(i, float(i)) for i in order]
    assert ring.max_live == slots


def test_slots_are_released_after_use():
    ring, _ = fake_ring(slots=2)
    kept = [w for _, w in ring.walk(range(LAYERS))]
    assert all(w == {} for w in kept)  # a slot's weights are gone once the walk moves on


def test_resident_loads_once():
    ring, loads = fake_ring(slots=LAYERS, resident=True)
    for _ in range(3):
        assert [i for i, _ in ring.walk(range(LAYERS))] == list(range(LAYERS))
    assert len(loads) == LAYERS == ring.stats.layer_loads


def test_breaking_out_stops_the_loader():
    ring, loads = fake_ring(slots=2, delay=0.01)
    for i, _ in ring.walk(range(LAYERS)):
        if i == 1:
            break
    assert ring.live() == set()
    assert len(loads) <= 3
    assert not [t for t in threading.enumerate() if t.name == "spill-ring"]


def test_loader_errors_surface_in_the_walk():
    ring, _ = fake_ring(slots=2, fail_at=3)
    with pytest.raises(OSError, match="layer 3"):
        for _ in ring.walk(range(LAYERS)):
            pass
    assert ring.live() == set()


class Recording(Hooks):
    """Hooks that note the thread each runs on and mark what compute sees."""

    def __init__(self):
        self.calls = []

    def load(self, fn, i):
        self.calls.append(("load", i, threading.current_thread().name))
        return fn(i)

    def ready(self, w):
        self.calls.append(("ready", int(w["w"][0]), threading.current_thread().name))
        w["ready"] = True
        return w

    def release(self, w):
        self.calls.append(("release", int(w["w"][0]), threading.current_thread().name))


def test_hooks_run_where_an_engine_needs_them():
    hooks = Recording()
    ring, _ = fake_ring(slots=2, hooks=hooks)
    main = threading.current_thread().name
    for _, w in ring.walk(range(LAYERS)):
        assert w["ready"]  # compute only ever sees a slot its engine has made ready
    by_kind = {k: [(i, t) for kind, i, t in hooks.calls if kind == k] for k in ("load", "ready")}
    assert by_kind["load"] == [(i, "spill-ring") for i in range(LAYERS)]
    assert by_kind["ready"] == [(i, main) for i in range(LAYERS)]
    assert sorted(i for kind, i, _ in hooks.calls if kind == "release") == list(range(LAYERS))
    hooks = Recording()
    ring, _ = fake_ring(slots=LAYERS, resident=True, hooks=hooks)
    for _ in range(2):
        assert all(w["ready"] for _, w in ring.walk(range(LAYERS)))
    assert [k for k, *_ in hooks.calls] == ["load", "ready"] * LAYERS  # once, at open


@pytest.mark.parametrize("resident", [False, True])
def test_between_runs_after_each_layers_use_and_before_the_next(resident):
    """A budget's heap trim: once after each layer the walker used, before it gets the next, in
    a streamed walk and a resident one; none after a walk left early."""
    seen = []
    ring, _ = fake_ring(2, resident=resident)
    ring.between = lambda: seen.append("trim")
    for i, _w in ring.walk(range(LAYERS)):
        seen.append(i)
    assert seen == [x for i in range(LAYERS) for x in (i, "trim")]
    seen.clear()
    for i, _w in ring.walk([3, 1, 4]):
        seen.append(i)
        if i == 1:
            break
    assert seen == [3, "trim", 1]
