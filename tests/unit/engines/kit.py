"""What the engine tests share: prompts, loading an engine or skipping where it is missing, and
the small tune loop (micro-batches, a cosine schedule, AdamW) the trainer tests run."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from spill.engines.base import AdamW, GenerateParams, LoadOptions, ModelSpec, TrainBatch
from spill.jobs.schedule import cosine_lr
from spill.jobs.tune.data import Example, micro_batch_at
from spill.models.config import load_config
from spill.models.lora import init_params

PROMPTS = [np.array([5, 6, 7, 8, 9, 10]), np.array([100, 3]), np.arange(20, 40)]
COMPLETIONS = [np.array([11, 12, 13]), np.array([4, 5, 6, 7]), np.array([1])]
GREEDY = GenerateParams(max_new_tokens=12)
SAMPLED = GenerateParams(max_new_tokens=24, temperature=1.0, top_p=0.9)
ENGINES = ["torch", pytest.param("mlx", marks=pytest.mark.mlx)]


def load_engine(name: str, module: bool = False):
    """The engine called ``name``, or a skip that says how to install it (of the whole test
    module with ``module``, called at import)."""
    if name == "mlx":
        if importlib.util.find_spec("mlx") is None:  # without importing mlx.core (see blas.py)
            pytest.skip(
                'MLX is not installed: pip install "mlx[cpu]" (Linux) or mlx (macOS)',
                allow_module_level=module,
            )
        return pytest.importorskip(
            "spill.engines.mlx", reason="the MLX engine does not import"
        ).ENGINE
    from spill.engines.torch import ENGINE

    return ENGINE


def open_runner(engine, folder, **options):
    return engine.open(ModelSpec(folder, load_config(folder)), LoadOptions(**options))


def llama3_scaled(tiny_llama: Path, folder: Path) -> Path:
    """A copy of the tiny llama with Llama 3 rope scaling; an original context of 64 puts the
    tiny head's frequencies in all three bands (kept, smoothed, scaled)."""
    shutil.copytree(tiny_llama, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def same(xs, ys) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(xs, ys, strict=True))


def tokens(gens):
    return [(g.tokens.tolist(), g.finish) for g in gens]


def nudged(cfg, lora, seed=0):
    """An adapter with nonzero B, so it changes the model and A gets gradients."""
    params = init_params(cfg, lora, seed)
    rng = np.random.default_rng(seed)
    for name, value in params.items():
        if name.endswith("lora_b"):
            params[name] = rng.normal(0, 0.05, value.shape).astype(np.float32)
    return params


def adapter_gaps(runner, lora, params, rows, reference) -> tuple[list, list]:
    """Each row's largest gap between ``runner``'s log-probs with the adapter ``params`` on and
    ``reference(prompt, completion)``'s, and how far the adapter moved them from the base's."""
    base = runner.score(*rows)
    runner.use_adapter(lora, params)
    gaps, moved = [], []
    for prompt, completion, ours, before in zip(*rows, runner.score(*rows), base, strict=True):
        gaps.append(np.abs(ours - reference(prompt, completion)).max())
        moved.append(np.abs(ours - before).max())
    return gaps, moved


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
    mbs = [micro_batch_at(examples(), seed, step * accum + k, size, 0) for k in range(accum)]
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
