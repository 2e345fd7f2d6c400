"""MLX LoRA training against the torch engine: gradients close to the torch trainer's, AdamW as
torch's, and checkpoints that cross engines both ways (the portable checkpoint is float32 numpy
by spill's names). What every engine must do is in ``test_train.py``."""

from __future__ import annotations

import numpy as np
import pytest

from tests.unit.engines.kit import load_engine

MLX = load_engine("mlx", module=True)  # skips this whole module where MLX is missing
mx = pytest.importorskip("mlx.core")

import torch  # noqa: E402

from spill.engines.base import AdamW, TrainBatch  # noqa: E402
from spill.engines.torch import ENGINE as TORCH  # noqa: E402
from spill.models.config import load_config  # noqa: E402
from spill.models.lora import LoraConfig  # noqa: E402
from tests.unit.engines import kit  # noqa: E402
from tests.unit.engines.kit import batches, equal_states, fresh, nudged, tune  # noqa: E402

pytestmark = pytest.mark.mlx

GRAD_TOLERANCE = 2e-5  # relative to a tensor's largest gradient; measured ~3e-6


def open_runner(folder, engine=MLX, **options):
    return kit.open_runner(engine, folder, **options)


def grads(trainer) -> dict[str, np.ndarray]:
    return {n: np.array(g) for n, g in trainer.grads.items()}


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
