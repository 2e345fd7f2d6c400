"""The ring inside the torch engine: sized from a memory budget, and really streaming (the ring
itself is tested engine-free in ``test_ring.py``)."""

from __future__ import annotations

import numpy as np

from spill.engines.base import GenerateParams, LoadOptions, ModelSpec
from spill.engines.torch import ENGINE
from spill.models.config import load_config


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
