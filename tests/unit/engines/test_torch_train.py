"""LoRA training on the torch engine: streamed gradients equal plain autograd, AdamW is
torch's, dropout touches the adapter input only, CUDA trains like the CPU. What every engine
must do is in ``test_train.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from spill.engines.base import AdamW, TrainBatch
from spill.engines.core.common import dropout_seed
from spill.engines.torch import ENGINE
from spill.engines.torch.kernel import dropout
from spill.engines.torch.ops import linear
from spill.models.config import load_config
from spill.models.lora import ALL_LINEAR, MODULES, LoraConfig
from tests.unit.engines import kit
from tests.unit.engines.kit import batches, fresh, nudged, tune


def open_runner(folder, **options):
    return kit.open_runner(ENGINE, folder, **options)


def reference_grads(model, lora, params, batch: TrainBatch) -> dict[str, np.ndarray]:
    """Plain autograd through one resident forward with every layer's adapter in the graph."""
    leaves = {n: torch.tensor(a, requires_grad=True) for n, a in params.items()}
    adapters = {}
    for i in range(model.cfg.num_hidden_layers):
        adapters[i] = {}
        for t in lora.targets:
            stem = f"layers.{i}.{MODULES[t]}"
            entry = (leaves[stem + ".lora_a"], leaves[stem + ".lora_b"], lora.scale)
            if lora.dropout > 0:
                seed = dropout_seed(batch.dropout_seed, i, MODULES[t])
                entry += (dropout(lora.dropout, seed),)
            adapters[i][MODULES[t]] = entry
    ids = torch.from_numpy(batch.tokens)
    ctx = model.kernel.context(batch.attention, 0, ids.shape[1])
    h = model.forward(ids, ctx, lora=adapters)  # (B, T, hidden)
    rows, cols = (torch.from_numpy(x) for x in np.nonzero(batch.targets[:, 1:]))
    logits = model.kernel.logits(h[rows, cols])
    loss = F.cross_entropy(logits, ids[rows, cols + 1], reduction="sum") * batch.scale
    loss.backward()
    return {n: t.grad.numpy() for n, t in leaves.items()}


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_streamed_gradients_equal_plain_autograd(tiny_model, p):
    cfg = load_config(tiny_model)
    lora = LoraConfig(rank=4, alpha=8, dropout=p, targets=("q_proj", "v_proj", "o_proj", "up_proj"))
    params = nudged(cfg, lora)  # B != 0, so A gets a gradient too
    batch = batches(0)[0]
    targets = batch.targets.copy()
    targets[0, -1] = False  # targets on some completion tokens only
    batch = TrainBatch(batch.tokens, batch.attention, targets, 0.25, batch.dropout_seed)
    assert not batch.attention.all()  # the batch carries padding
    streamed = open_runner(tiny_model, ring=2, dtype="float32")
    resident = open_runner(tiny_model, resident=True, dtype="float32")
    trainer = fresh(streamed, cfg, lora, params)
    loss = trainer.accumulate(batch)
    want = reference_grads(resident.model, lora, params, batch)
    for name, ref in want.items():
        got = trainer.grads[name].numpy()
        assert np.abs(ref).max() > 0, name
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max(), err_msg=name)
    assert loss > 0
    streamed.close()
    resident.close()


def test_apply_is_torch_adamw(tiny_models):
    folder = tiny_models["llama"]
    cfg = load_config(folder)
    lora = LoraConfig(rank=2, targets=("k_proj", "gate_proj"))
    runner = open_runner(folder, ring=2, dtype="float32")
    params = nudged(cfg, lora)
    trainer = fresh(runner, cfg, lora, params)
    ref = {n: torch.tensor(a) for n, a in params.items()}
    opt = torch.optim.AdamW(
        list(ref.values()), lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, foreach=False
    )
    gen = torch.Generator().manual_seed(0)
    for step in range(1, 4):
        for name, p in ref.items():
            g = torch.randn(p.shape, generator=gen)
            p.grad = g.clone()
            trainer.grads[name].copy_(g)
        opt.step()
        trainer.apply(AdamW(lr=3e-3, step=step, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1))
    got, m, v = trainer.state()
    for name, p in ref.items():
        assert np.array_equal(got[name], p.detach().numpy())
        assert np.array_equal(m[name], opt.state[p]["exp_avg"].numpy())
        assert np.array_equal(v[name], opt.state[p]["exp_avg_sq"].numpy())
        assert not trainer.grads[name].any()  # zeroed after the update
    runner.close()


def test_dropout_touches_the_adapter_input_only():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 5, 16, generator=gen), torch.randn(8, 16, generator=gen)
    a, b = torch.randn(16, 4, generator=gen), torch.randn(4, 8, generator=gen)
    assert torch.equal(linear(x, w, None, (a, b, 2.0, lambda h: h * 0)), linear(x, w))
    assert torch.equal(
        linear(x, w, None, (a, b, 2.0, lambda h: h)), linear(x, w, None, (a, b, 2.0))
    )
    h = dropout(0.25, 9)(x)
    assert torch.equal(h, dropout(0.25, 9)(x))
    kept = h != 0
    assert 0.6 < kept.float().mean() < 0.9
    torch.testing.assert_close(h[kept], x[kept] / 0.75)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_trains_like_the_cpu(tiny_models):
    folder = tiny_models["qwen2"]
    cfg = load_config(folder)
    lora = LoraConfig(rank=4, alpha=8, dropout=0.0, targets=ALL_LINEAR)
    runs = []
    for options in ({"ring": 2, "device": "cuda"}, {"resident": True, "device": "cuda"}, {}):
        runner = open_runner(folder, dtype="float32", **options)
        trainer = fresh(runner, cfg, lora)
        runs.append((tune(trainer, 3), trainer.state()))
        runner.close()
    # Decided, not measured (no CUDA device was lent): close, not bit-identical. Scoring is exact
    # on CUDA (forward kernels are deterministic, test_torch_runner), but the CUDA backward of
    # attention (SDPA's memory-efficient kernel) accumulates with atomics, so even one graph run
    # twice may differ in its last bits; exactness is promised for CPU training only.
    for losses, (params, _, _) in runs[1:]:
        np.testing.assert_allclose(runs[0][0], losses, rtol=1e-4)
        for name, ref in runs[0][1][0].items():
            a, b = ref.ravel().astype(np.float64), params[name].ravel().astype(np.float64)
            assert a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) >= 0.9999, name
