"""LoRA training through the ring: streamed == resident bit for bit, gradients equal plain
autograd, exact re-entry from ``state()``, and adapters applied to scoring and generation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from spill.engines.base import AdamW, GenerateParams, LoadOptions, ModelSpec, TrainBatch
from spill.engines.common import dropout_seed
from spill.engines.torch import ENGINE
from spill.engines.torch.kernel import dropout
from spill.engines.torch.ops import linear
from spill.errors import EngineError
from spill.jobs.schedule import cosine_lr
from spill.jobs.train_data import Example, micro_batch
from spill.models.config import load_config
from spill.models.lora import ALL_LINEAR, MODULES, LoraConfig, init_params

PROMPTS = [np.array([5, 6, 7, 8, 9, 10]), np.array([100, 3])]
COMPLETIONS = [np.array([11, 12, 13]), np.array([4, 5, 6, 7])]


def open_runner(folder, **options):
    return ENGINE.open(ModelSpec(folder, load_config(folder)), LoadOptions(**options))


def nudged(cfg, lora, seed=0):
    """An adapter with nonzero B, so it changes the model."""
    params = init_params(cfg, lora, seed)
    rng = np.random.default_rng(seed)
    for name, value in params.items():
        if name.endswith("lora_b"):
            params[name] = rng.normal(0, 0.05, value.shape).astype(np.float32)
    return params


def same(xs, ys) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(xs, ys, strict=True))


def test_use_adapter_changes_scores_and_none_restores_the_base(tiny_model):
    runner = open_runner(tiny_model, ring=2, dtype="float32")
    resident = open_runner(tiny_model, resident=True, dtype="float32")
    cfg = load_config(tiny_model)
    lora = LoraConfig(rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"))
    greedy = GenerateParams(max_new_tokens=6)
    base = runner.score(PROMPTS, COMPLETIONS)
    runner.use_adapter(lora, init_params(cfg, lora, 3))  # B = 0: exactly the base model
    assert same(base, runner.score(PROMPTS, COMPLETIONS))
    params = nudged(cfg, lora)
    runner.use_adapter(lora, params)
    tuned = runner.score(PROMPTS, COMPLETIONS)
    assert not any(np.allclose(a, b) for a, b in zip(base, tuned, strict=True))
    params[next(iter(params))][:] = 7.0  # the runner holds its own copy
    assert same(tuned, runner.score(PROMPTS, COMPLETIONS))
    resident.use_adapter(lora, nudged(cfg, lora))  # streamed == resident with an adapter too
    assert same(tuned, resident.score(PROMPTS, COMPLETIONS))
    a, b = runner.generate(PROMPTS, greedy, [0, 0]), resident.generate(PROMPTS, greedy, [0, 0])
    assert [g.tokens.tolist() for g in a] == [g.tokens.tolist() for g in b]
    runner.use_adapter(None, None)
    assert same(base, runner.score(PROMPTS, COMPLETIONS))
    runner.close()
    resident.close()


def test_use_adapter_rejects_other_shapes(tiny_models):
    folder = tiny_models["llama"]
    runner = open_runner(folder, ring=2, dtype="float32")
    cfg = load_config(folder)
    lora = LoraConfig(rank=4, targets=("q_proj",))
    params = init_params(cfg, lora, 0)
    with pytest.raises(EngineError, match="missing"):
        runner.use_adapter(LoraConfig(rank=4, targets=("q_proj", "k_proj")), params)
    with pytest.raises(EngineError, match="shape"):
        runner.use_adapter(LoraConfig(rank=2, targets=("q_proj",)), params)
    runner.close()


def examples(n=6, seed=0) -> list[Example]:
    """Prompt/completion-like rows of different lengths (so batches carry right padding)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        p, c = int(rng.integers(2, 7)), int(rng.integers(2, 6))
        ids = rng.integers(0, 250, p + c).astype(np.int64)
        out.append(Example(ids, np.array([False] * p + [True] * c)))
    return out


def batches(step: int, accum=2, size=3, seed=0) -> list[TrainBatch]:
    """The micro-batches of optimizer step ``step``; scale = 1 / target tokens of the step."""
    mbs = [micro_batch(examples(), seed, step * accum + k, size, 0) for k in range(accum)]
    total = sum(mb.n_targets for mb in mbs)
    return [
        TrainBatch(mb.tokens, mb.attention, mb.targets, 1.0 / total, step * accum + k)
        for k, mb in enumerate(mbs)
    ]


def fresh(runner, cfg, lora, params=None):
    trainer = runner.trainer(lora)
    trainer.set_state(params if params is not None else init_params(cfg, lora, 1), {}, {})
    return trainer


def tune(trainer, steps, start=0, total=10) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        losses.append(sum(trainer.accumulate(b) for b in batches(step)))
        lr = cosine_lr(step, 1e-2, 2, total)
        trainer.apply(AdamW(lr=lr, step=step + 1, weight_decay=0.01))
    return losses


def equal_states(a, b) -> bool:
    return all(
        x.keys() == y.keys() and all(np.array_equal(x[n], y[n]) for n in x)
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("p", [0.0, 0.2])
def test_streamed_and_resident_train_bit_identically(tiny_model, p):
    cfg = load_config(tiny_model)
    lora = LoraConfig(rank=4, alpha=8, dropout=p, targets=ALL_LINEAR)
    states, losses = [], []
    for options in ({"ring": 2}, {"resident": True}):
        runner = open_runner(tiny_model, dtype="float32", **options)
        trainer = fresh(runner, cfg, lora)
        losses.append(tune(trainer, 3))
        states.append(trainer.state())
        if "ring" in options:
            assert runner.model.ring.max_live <= 2
        runner.close()
    assert losses[0] == losses[1]
    assert equal_states(*states)
    params, m, v = states[0]
    assert all(x.dtype == np.float32 for d in states[0] for x in d.values())
    assert any(np.abs(params[n]).max() > 0 for n in params if n.endswith("lora_b"))
    assert losses[0][-1] < losses[0][0]


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


def test_state_round_trip_continues_exactly(tiny_models):
    folder = tiny_models["qwen2"]
    cfg = load_config(folder)
    lora = LoraConfig(rank=4, alpha=8, dropout=0.1, targets=("q_proj", "v_proj", "down_proj"))
    runner = open_runner(folder, ring=2, dtype="float32")
    whole = fresh(runner, cfg, lora)
    whole_losses = tune(whole, 4)
    first = fresh(runner, cfg, lora)
    losses = tune(first, 2)
    saved = first.state()
    again = runner.trainer(lora)
    again.set_state(*saved)
    assert equal_states(again.state(), saved)  # state() is an exact copy of what was set
    losses += tune(again, 2, start=2)
    assert losses == whole_losses
    assert equal_states(again.state(), whole.state())
    saved[0][next(iter(saved[0]))][:] = 5.0  # the trainer holds its own copies
    assert not equal_states(again.state(), saved)
    runner.close()


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


def test_dropout_masks_depend_on_the_seed_only(tiny_models):
    folder = tiny_models["llama"]
    cfg = load_config(folder)
    runner = open_runner(folder, ring=2, dtype="float32")
    lora = LoraConfig(rank=4, alpha=8, dropout=0.5, targets=("q_proj", "v_proj"))
    params = nudged(cfg, lora)
    batch = batches(0)[0]

    def loss(seed, p=lora):
        t = fresh(runner, cfg, p, params)
        return t.accumulate(TrainBatch(batch.tokens, batch.attention, batch.targets, 1.0, seed))

    assert loss(3) == loss(3)
    assert loss(3) != loss(4)
    assert loss(3, LoraConfig(rank=4, alpha=8, targets=lora.targets)) != loss(3)
    runner.close()


def test_trainer_refuses_bad_input(tiny_models):
    folder = tiny_models["llama"]
    cfg = load_config(folder)
    runner = open_runner(folder, ring=2, dtype="float32")
    lora = LoraConfig(rank=2, targets=("q_proj",))
    batch = batches(0)[0]
    with pytest.raises(EngineError, match="set_state"):
        runner.trainer(lora).accumulate(batch)
    trainer = fresh(runner, cfg, lora)
    with pytest.raises(EngineError, match="padding"):
        trainer.accumulate(TrainBatch(batch.tokens, batch.attention, ~batch.attention, 1.0, 0))
    with pytest.raises(EngineError, match="missing"):
        trainer.set_state(init_params(cfg, LoraConfig(rank=2, targets=("k_proj",)), 0), {}, {})
    with pytest.raises(EngineError, match="dropout"):
        runner.trainer(LoraConfig(dropout=1.0))
    no_targets = TrainBatch(batch.tokens, batch.attention, batch.targets & False, 1.0, 0)
    assert trainer.accumulate(no_targets) == 0.0
    runner.close()


def test_bfloat16_base_trains_float32_adapters_identically_streamed_and_resident(tiny_models):
    folder = tiny_models["qwen2"]
    cfg = load_config(folder)
    lora = LoraConfig(rank=4, alpha=8, dropout=0.1, targets=("q_proj", "v_proj", "down_proj"))
    runs = []
    for options in ({"ring": 2}, {"resident": True}):
        runner = open_runner(folder, dtype="bfloat16", **options)
        trainer = fresh(runner, cfg, lora)
        runs.append((tune(trainer, 2), trainer.state()))
        runner.close()
    assert runs[0][0] == runs[1][0]
    assert equal_states(runs[0][1], runs[1][1])
    assert all(x.dtype == np.float32 for d in runs[0][1] for x in d.values())


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
    for losses, (params, _, _) in runs[1:]:  # kernels differ: close, not bit-identical
        np.testing.assert_allclose(runs[0][0], losses, rtol=1e-4)
        for name, ref in runs[0][1][0].items():
            a, b = ref.ravel().astype(np.float64), params[name].ravel().astype(np.float64)
            assert a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) >= 0.9999, name
