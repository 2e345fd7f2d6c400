"""The adapter hook on a linear, which the training issue builds on."""

from __future__ import annotations

import numpy as np
import torch

from spill.engines.base import LoadOptions, ModelSpec
from spill.engines.torch import ENGINE
from spill.engines.torch.ops import context, linear
from spill.models.config import load_config


def test_lora_linear_equals_merged_weight():
    gen = torch.Generator().manual_seed(0)
    x, w, b = (
        torch.randn(3, 5, 16, generator=gen),
        torch.randn(8, 16, generator=gen),
        torch.randn(8),
    )
    a, bb = torch.randn(16, 4, generator=gen), torch.randn(4, 8, generator=gen)
    merged = linear(x, w + 0.5 * (a @ bb).T, b)
    torch.testing.assert_close(linear(x, w, b, (a, bb, 0.5)), merged, rtol=1e-5, atol=1e-5)
    assert torch.equal(linear(x, w, b, (a, torch.zeros(4, 8), 2.0)), linear(x, w, b))


def test_zero_adapter_leaves_the_model_unchanged(tiny_models):
    folder = tiny_models["qwen2"]
    cfg = load_config(folder)
    runner = ENGINE.open(ModelSpec(folder, cfg), LoadOptions(ring=2, dtype="float32"))
    m = runner.model
    ids = torch.tensor([[3, 4, 5, 6]])
    ctx = context(torch.ones(1, 4, dtype=torch.bool), 0, 4, m.kernel.freq, m.kernel.dtype)
    h = cfg.hidden_size
    zero = {"self_attn.q_proj": (torch.randn(h, 2), torch.zeros(2, h), 2.0)}
    with torch.inference_mode():
        base = m.forward(ids, ctx)
        tuned = m.forward(ids, ctx, lora={i: zero for i in range(cfg.num_hidden_layers)})
    assert torch.equal(base, tuned)
    nudged = {"mlp.down_proj": (torch.ones(cfg.intermediate_size, 1), torch.ones(1, h), 0.1)}
    with torch.inference_mode():
        other = m.forward(ids, ctx, lora={1: nudged})
    assert not np.allclose(base.numpy(), other.numpy())
    runner.close()
