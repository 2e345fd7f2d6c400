"""The streaming ring: sizing from a memory budget, prefetch that really runs ahead, at most K
layers alive, any walking order, clean stops."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from spill.engines.base import GenerateParams, LoadOptions, ModelSpec, Stats
from spill.engines.torch import ENGINE
from spill.engines.torch.ring import Ring, plan_ring
from spill.errors import EngineError
from spill.models.config import load_config

LAYERS = 6


def fake_ring(slots, resident=False, delay=0.0, fail_at=None):
    """A ring over a loader that builds layer i as {"w": tensor filled with i}."""
    loads = []

    def load(i):
        if i == fail_at:
            raise OSError(f"layer {i} unreadable")
        time.sleep(delay)
        loads.append((i, threading.current_thread().name))
        return {"w": torch.full((4,), float(i))}

    return Ring(load, LAYERS, slots, resident, Stats(), torch.device("cpu")), loads


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


def test_engine_sizes_the_ring_from_memory(tiny_models):
    folder = tiny_models["llama"]
    cfg = load_config(folder)
    layer_bytes = cfg.layer_params() * 4
    spec = ModelSpec(folder, cfg)

    def info(**kw):
        runner = ENGINE.open(spec, LoadOptions(dtype="float32", **kw))
        runner.close()
        return runner.info

    assert info(memory=layer_bytes * cfg.num_hidden_layers).resident
    tight = info(memory=layer_bytes * 3 + 1)
    assert (tight.resident, tight.ring) == (False, 3)
    assert info(memory=1).ring == 2
    assert info(ring=2, memory=10**12).ring == 2
    assert info().resident  # the default budget (half the free RAM) holds a tiny model
    assert "streaming, ring 3 of 4 layers" in tight.line()


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


def test_streaming_generation_reloads_every_layer_each_step(tiny_models):
    folder = tiny_models["qwen2"]
    runner = ENGINE.open(
        ModelSpec(folder, load_config(folder)), LoadOptions(ring=2, dtype="float32")
    )
    runner.generate([np.array([1, 2, 3])], GenerateParams(max_new_tokens=5), [0])
    assert runner.stats.layer_loads == 5 * runner.info.layers  # prefill + 4 decode steps
    assert runner.stats.extra["ring_max_live"] == 2
    assert runner.stats.load_seconds > 0
    runner.close()
