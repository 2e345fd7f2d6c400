"""spill's MLX engine against mlx-lm itself, on the same transformers-made folders of each family
mlx-lm has (``hf_families.MLX_LM``: Qwen3, Mistral as mlx-lm's llama, SmolLM3's NoPE layer,
Gemma 3's sliding and full layers past the window, Phi-3's partial rotary and longrope) and the
tiny Llama (bfloat16, both sides in float32): gold log-probs within ``TOLERANCE`` of mlx-lm's
(float32; the largest gaps measured on this machine were 1.4e-6 for every family, base and
adapter, and 9.5e-6 for the tiny Llama with an adapter, whose log-probs near -16 move in float32
steps of 1.9e-6), greedy tokens equal to ``mlx_lm.generate.generate_step``'s, and the mlx-lm
adapter spill publishes beside every tuned adapter (``adapters.safetensors``,
``adapter_config.json``), after a few MLX tune steps, loaded by ``mlx_lm``'s own
``load_adapters`` to the same log-probs. Phi-3 "phi3-long" is compared on rows past its original
length only (mlx-lm turns by the long factors at every length)."""

from __future__ import annotations

import numpy as np
import pytest

from spill.engines.base import GenerateParams
from spill.models.config import load_config
from spill.models.lora import LoraConfig, export_mlx
from tests.unit.engines import hf_families
from tests.unit.engines.kit import PROMPTS, fresh, load_engine, nudged, open_runner, tune
from tests.unit.engines.test_families import ROWS

pytestmark = pytest.mark.mlx
ENGINE = load_engine("mlx", module=True)
mlx_lm = pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install mlx-lm)")
mx = pytest.importorskip("mlx.core")
generate_step = pytest.importorskip("mlx_lm.generate").generate_step
TOLERANCE = 2e-5
NEW = 12
VARIANTS = ["llama", *hf_families.MLX_LM]


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_models):
    root = tmp_path_factory.mktemp("mlx-lm-families")
    made = {
        v: hf_families.make(v, root / v, tiny_models["llama"], seed=k, spec=spec)
        for k, (v, spec) in enumerate(hf_families.MLX_LM.items())
    }
    return {"llama": tiny_models["llama"]} | {v: hf_families.for_mlx_lm(f) for v, f in made.items()}


@pytest.fixture(params=VARIANTS)
def variant(request, folders):
    return request.param, folders[request.param]


def rows(name: str):
    """The test rows mlx-lm computes as transformers does (phi3-long: those past 16 tokens)."""
    if name != "phi3-long":
        return ROWS
    keep = [k for k, (p, c) in enumerate(zip(*ROWS, strict=True)) if len(p) + len(c) > 16]
    return tuple([part[k] for k in keep] for part in ROWS)


def mlx_lm_model(folder):
    """The folder as mlx-lm loads it, in float32 (the tiny Llama is stored in bfloat16)."""
    model, _ = mlx_lm.utils.load_model(folder)
    model.set_dtype(mx.float32)
    return model


def mlx_lm_log_probs(model, prompt, completion) -> np.ndarray:
    ids = mx.array(np.concatenate([prompt, completion]))[None]
    logits = model(ids).astype(mx.float32)
    logp = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))[0]  # (T, V)
    return logp[len(prompt) - 1 : -1][np.arange(len(completion)), completion]


def test_log_probs_match_mlx_lm(variant):
    name, folder = variant
    theirs = mlx_lm_model(folder)
    runner = open_runner(ENGINE, folder, ring=2, dtype="float32")
    for prompt, completion, ours in zip(*rows(name), runner.score(*rows(name)), strict=True):
        assert np.abs(ours - mlx_lm_log_probs(theirs, prompt, completion)).max() <= TOLERANCE
    runner.close()


def test_greedy_matches_mlx_lm(variant):
    """Prompts shorter and longer than the windows, a KV-cached decode on both sides."""
    name, folder = variant
    theirs = mlx_lm_model(folder)
    runner = open_runner(ENGINE, folder, ring=2, dtype="float32")
    prompts = [
        p for p in (PROMPTS[0], PROMPTS[2], ROWS[0][-1]) if name != "phi3-long" or len(p) > 16
    ]
    for prompt in prompts:
        ours = runner.generate([prompt], GenerateParams(max_new_tokens=NEW), [0])[0]
        steps = generate_step(
            mx.array(prompt), theirs, max_tokens=NEW, sampler=lambda x: mx.argmax(x, -1)
        )
        want = [int(token) for token, _ in steps]
        assert len(want) == NEW and ours.tokens.tolist() == want[: len(ours.tokens)], name
    runner.close()


def test_the_published_mlx_lm_adapter_scores_in_mlx_lm_as_in_spill(variant, tmp_path):
    name, folder = variant
    cfg = load_config(folder)
    lora = LoraConfig(rank=4, alpha=8, targets=LoraConfig.parse_targets("all", cfg.linears))
    runner = open_runner(ENGINE, folder, ring=2, dtype="float32")
    trainer = fresh(runner, cfg, lora, nudged(cfg, lora))
    losses = tune(trainer, 3)
    assert losses[-1] < losses[0]
    params = trainer.state()[0]
    adapter = export_mlx(params, lora, cfg.num_hidden_layers, tmp_path / "mlx")
    runner.use_adapter(lora, params)
    theirs = mlx_lm.utils.load_adapters(mlx_lm_model(folder), str(adapter))
    gaps = [
        np.abs(ours - mlx_lm_log_probs(theirs, prompt, completion)).max()
        for prompt, completion, ours in zip(*rows(name), runner.score(*rows(name)), strict=True)
    ]
    assert max(gaps) <= TOLERANCE, name
    runner.close()
