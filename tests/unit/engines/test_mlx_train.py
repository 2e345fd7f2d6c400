"""MLX LoRA training through the ring: streamed == resident bit for bit, gradients close to the
torch trainer's, exact re-entry from ``state()``, AdamW as torch's, and checkpoints that cross
engines both ways (the portable checkpoint is float32 numpy by spill's names)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

if importlib.util.find_spec("mlx") is None:  # checked without importing mlx.core (see blas.py)
    pytest.skip(
        'MLX is not installed: pip install "mlx[cpu]" (Linux) or mlx (macOS)',
        allow_module_level=True,
    )
mlx_engine = pytest.importorskip("spill.engines.mlx", reason="the MLX engine does not import")
mx = pytest.importorskip("mlx.core")

import torch  # noqa: E402

from spill.engines.base import AdamW, LoadOptions, ModelSpec, TrainBatch  # noqa: E402
from spill.engines.torch import ENGINE as TORCH  # noqa: E402
from spill.errors import EngineError  # noqa: E402
from spill.jobs.schedule import cosine_lr  # noqa: E402
from spill.jobs.train_data import Example, micro_batch  # noqa: E402
from spill.models.config import load_config  # noqa: E402
from spill.models.lora import ALL_LINEAR, LoraConfig, init_params  # noqa: E402

pytestmark = pytest.mark.mlx

MLX = mlx_engine.ENGINE
GRAD_TOLERANCE = 2e-5  # relative to a tensor's largest gradient; measured ~3e-6


def open_runner(folder, engine=MLX, **options):
    return engine.open(ModelSpec(folder, load_config(folder)), LoadOptions(**options))


def nudged(cfg, lora, seed=0):
    """An adapter with nonzero B, so it changes the model and A gets gradients."""
    params = init_params(cfg, lora, seed)
    rng = np.random.default_rng(seed)
    for name, value in params.items():
        if name.endswith("lora_b"):
            params[name] = rng.normal(0, 0.05, value.shape).astype(np.float32)
    return params


def examples(n=6, seed=0) -> list[Example]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        p, c = int(rng.integers(2, 7)), int(rng.integers(2, 6))
        ids = rng.integers(0, 250, p + c).astype(np.int64)
        out.append(Example(ids, np.array([False] * p + [True] * c)))
    return out


def batches(step: int, accum=2, size=3, seed=0) -> list[TrainBatch]:
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


def grads(trainer) -> dict[str, np.ndarray]:
    return {n: np.array(g) for n, g in trainer.grads.items()}


@pytest.mark.parametrize("p", [0.0, 0.2])
def test_streamed_and_resident_train_bit_identically(tiny_model, p):
    cfg = load_config(tiny_model)
    lora = LoraConfig(rank=4, alpha=8, dropout=p, targets=ALL_LINEAR)
    runs = []
    for options in ({"ring": 2}, {"resident": True}):
        runner = open_runner(tiny_model, dtype="float32", **options)
        trainer = fresh(runner, cfg, lora)
        runs.append((tune(trainer, 3), trainer.state()))
        if "ring" in options:
            assert runner.model.ring.max_live <= 2
        runner.close()
    assert runs[0][0] == runs[1][0]
    assert equal_states(runs[0][1], runs[1][1])
    assert all(x.dtype == np.float32 for d in runs[0][1] for x in d.values())
    assert runs[0][0][-1] < runs[0][0][0]


def test_gradients_match_the_torch_trainer(tiny_model):
    cfg = load_config(tiny_model)
    lora = LoraConfig(rank=4, alpha=8, targets=("q_proj", "v_proj", "o_proj", "up_proj"))
    params = nudged(cfg, lora)
    batch = batches(0)[0]
    targets = batch.targets.copy()
    targets[0, -1] = False  # targets on some completion tokens only
    batch = TrainBatch(batch.tokens, batch.attention, targets, 0.25, batch.dropout_seed)
    assert not batch.attention.all()  # the batch carries padding
    ours = fresh(open_runner(tiny_model, ring=2, dtype="float32"), cfg, lora, params)
    theirs = fresh(open_runner(tiny_model, TORCH, ring=2, dtype="float32"), cfg, lora, params)
    loss, ref_loss = ours.accumulate(batch), theirs.accumulate(batch)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    got = grads(ours)
    worst = 0.0
    for name, ref in theirs.grads.items():
        ref = ref.numpy()
        assert np.abs(ref).max() > 0, name
        worst = max(worst, float(np.abs(got[name] - ref).max() / np.abs(ref).max()))
    print(f"\nmax relative gradient difference MLX vs torch: {worst:.2e}")
    assert worst <= GRAD_TOLERANCE


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
    assert equal_states(again.state(), saved)
    losses += tune(again, 2, start=2)
    assert losses == whole_losses
    assert equal_states(again.state(), whole.state())
    saved[0][next(iter(saved[0]))][:] = 5.0  # the trainer holds its own copies
    assert not equal_states(again.state(), saved)


@pytest.mark.parametrize("first,then", [("mlx", "torch"), ("torch", "mlx")])
def test_checkpoints_cross_engines(tiny_models, first, then):
    folder = tiny_models["llama"]
    cfg = load_config(folder)
    lora = LoraConfig(rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"))
    engines = {"mlx": MLX, "torch": TORCH}
    start = fresh(open_runner(folder, engines[first], ring=2, dtype="float32"), cfg, lora)
    losses = tune(start, 3)
    rest = open_runner(folder, engines[then], ring=2, dtype="float32").trainer(lora)
    rest.set_state(*start.state())
    assert equal_states(rest.state(), start.state())
    losses += tune(rest, 3, start=3)
    reference = tune(fresh(open_runner(folder, TORCH, ring=2, dtype="float32"), cfg, lora), 6)
    np.testing.assert_allclose(losses, reference, rtol=1e-5)  # measured 1.5e-7
    assert losses[-1] < losses[0]


def test_apply_is_torch_adamw(tiny_models):
    """m and v equal torch's bit for bit; params differ by an ulp of the update at most: torch's
    CPU ``sqrt`` (MKL's) is off by an ulp in ~15% of elements, MLX's is IEEE."""
    folder = tiny_models["llama"]
    cfg = load_config(folder)
    runner = open_runner(folder, ring=2, dtype="float32")
    for beta1 in (0.8, 0.3):  # torch's lerp_ has two forms, by the weight
        lora = LoraConfig(rank=2, targets=("k_proj", "gate_proj"))
        params = nudged(cfg, lora)
        trainer = fresh(runner, cfg, lora, params)
        ref = {n: torch.tensor(a) for n, a in params.items()}
        betas = (beta1, 0.95)
        opt = torch.optim.AdamW(
            list(ref.values()), lr=3e-3, betas=betas, eps=1e-6, weight_decay=0.1, foreach=False
        )
        gen = torch.Generator().manual_seed(0)
        for step in range(1, 4):
            for name, p in ref.items():
                p.grad = torch.randn(p.shape, generator=gen)
                trainer.grads[name] = mx.array(p.grad.numpy())
            opt.step()
            trainer.apply(AdamW(3e-3, step, beta1, 0.95, eps=1e-6, weight_decay=0.1))
        got, m, v = trainer.state()
        for name, p in ref.items():
            assert np.array_equal(m[name], opt.state[p]["exp_avg"].numpy()), name
            assert np.array_equal(v[name], opt.state[p]["exp_avg_sq"].numpy()), name
            want = p.detach().numpy()
            np.testing.assert_allclose(got[name], want, rtol=2e-7, atol=1e-8)
            assert not np.array(trainer.grads[name]).any()


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
    with pytest.raises(EngineError, match="steps count from 1"):
        trainer.apply(AdamW(lr=1e-3, step=0))
    no_targets = TrainBatch(batch.tokens, batch.attention, batch.targets & False, 1.0, 0)
    assert trainer.accumulate(no_targets) == 0.0


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
