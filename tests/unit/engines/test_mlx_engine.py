"""The MLX engine: how it reports itself, float32 agreement with the torch engine on both
families (with and without adapters, with Llama 3 rope scaling), measured numerics and the BLAS
it reports. What every engine must do is in ``test_runner.py``."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.unit.engines.kit import load_engine

MLX = load_engine("mlx", module=True)  # skips this whole module where MLX is missing
mx = pytest.importorskip("mlx.core")

from spill.engines import resolve  # noqa: E402
from spill.engines.base import GenerateParams  # noqa: E402
from spill.engines.mlx import blas, numerics  # noqa: E402
from spill.engines.torch import ENGINE as TORCH  # noqa: E402
from spill.errors import EngineError  # noqa: E402
from spill.ground.paths import machine_cache  # noqa: E402
from spill.models.config import load_config  # noqa: E402
from spill.models.lora import LoraConfig, init_params  # noqa: E402
from tests.unit.engines import kit  # noqa: E402
from tests.unit.engines.kit import COMPLETIONS, PROMPTS, llama3_scaled, same, tokens  # noqa: E402

pytestmark = pytest.mark.mlx

LOGPROB_TOLERANCE = 1e-5  # float32, MLX vs torch; measured 5.7e-6 (llama), 4.8e-7 (qwen2)


def open_runner(folder, engine=MLX, **options):
    return kit.open_runner(engine, folder, **options)


@pytest.fixture
def streamed(tiny_model):
    """A float32 runner streaming through a ring of 2."""
    runner = open_runner(tiny_model, ring=2, dtype="float32")
    yield runner
    runner.close()


def test_resolves_by_name_and_reports_itself(tiny_models):
    assert resolve("mlx") is MLX and MLX.name == "mlx"
    runner = open_runner(tiny_models["llama"], ring=2, dtype="float32")
    info = runner.info
    assert (info.engine, info.device, info.numerics) == ("mlx", "cpu", "float32")
    assert info.why == f"requested; BLAS {blas.describe()}"
    assert "engine mlx · device cpu · numerics float32" in info.line()
    with pytest.raises(EngineError, match="cpu or gpu"):
        open_runner(tiny_models["llama"], device="cuda:0")


def test_log_probs_and_greedy_match_torch(streamed, tiny_model):
    torch_runner = open_runner(tiny_model, TORCH, ring=2, dtype="float32")
    ours, theirs = streamed.score(PROMPTS, COMPLETIONS), torch_runner.score(PROMPTS, COMPLETIONS)
    diff = max(np.abs(a - b).max() for a, b in zip(ours, theirs, strict=True))
    print(f"\nmax |log-prob MLX - torch| float32: {diff:.2e}")
    assert diff <= LOGPROB_TOLERANCE
    stop = load_config(tiny_model).eos_token_ids
    params = GenerateParams(max_new_tokens=16, stop_ids=stop)
    assert tokens(streamed.generate(PROMPTS, params, [0] * 3)) == tokens(
        torch_runner.generate(PROMPTS, params, [0] * 3)
    )


def test_adapter_scores_match_torch(tiny_model):
    cfg = load_config(tiny_model)
    lora = LoraConfig(rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"))
    params = init_params(cfg, lora, 3)
    rng = np.random.default_rng(0)
    for name in params:
        if name.endswith("lora_b"):
            params[name] = rng.normal(0, 0.05, params[name].shape).astype(np.float32)
    ours = open_runner(tiny_model, ring=2, dtype="float32")
    theirs = open_runner(tiny_model, TORCH, ring=2, dtype="float32")
    base = ours.score(PROMPTS, COMPLETIONS)
    ours.use_adapter(lora, params)
    theirs.use_adapter(lora, params)
    tuned = ours.score(PROMPTS, COMPLETIONS)
    assert not any(np.allclose(a, b) for a, b in zip(base, tuned, strict=True))
    ref = theirs.score(PROMPTS, COMPLETIONS)
    assert max(np.abs(a - b).max() for a, b in zip(tuned, ref, strict=True)) <= LOGPROB_TOLERANCE
    greedy = GenerateParams(max_new_tokens=8)
    assert tokens(ours.generate(PROMPTS, greedy, [0] * 3)) == tokens(
        theirs.generate(PROMPTS, greedy, [0] * 3)
    )
    params[next(iter(params))][:] = 7.0  # the runner holds its own copy
    assert same(tuned, ours.score(PROMPTS, COMPLETIONS))
    resident = open_runner(tiny_model, resident=True, dtype="float32")
    resident.use_adapter(lora, init_params(cfg, lora, 3))  # B = 0: exactly the base model
    assert same(base, resident.score(PROMPTS, COMPLETIONS))
    ours.use_adapter(None, None)
    assert same(base, ours.score(PROMPTS, COMPLETIONS))
    with pytest.raises(EngineError, match="shape"):
        ours.use_adapter(LoraConfig(rank=2, targets=lora.targets), params)


def test_llama3_rope_scaling_matches_torch(tiny_models, tmp_path):
    folder = llama3_scaled(tiny_models["llama"], tmp_path / "llama3")
    prompt, completion = np.arange(30, 90), np.arange(90, 120)
    ours = open_runner(folder, dtype="float32").score([prompt], [completion])[0]
    theirs = open_runner(folder, TORCH, dtype="float32").score([prompt], [completion])[0]
    assert np.abs(ours - theirs).max() <= LOGPROB_TOLERANCE


# -- numerics and BLAS ---------------------------------------------------------------------


def test_slow_bf16_picks_float32_measured_once(monkeypatch):
    calls = []

    def measure(ratio):
        def fake():
            calls.append(ratio)
            return {"shape": [1, 1, 1], "float32_s": 1.0, "bfloat16_s": ratio, "ratio": ratio}

        monkeypatch.setattr(numerics, "measure_linear", fake)

    measure(20.0)
    dtype, why = numerics.choose(mx.Device(mx.cpu))
    assert dtype == mx.float32 and why.startswith("bf16 matmul 20x slower than float32 here")
    assert why.endswith(f"BLAS {blas.describe()}")
    numerics.choose(mx.Device(mx.cpu))
    assert len(calls) == 1
    (key,) = json.loads((machine_cache() / "numerics-mlx.json").read_text())
    assert mx.__version__ in key and blas.describe() in key
    (machine_cache() / "numerics-mlx.json").unlink()
    measure(0.5)
    assert numerics.choose(mx.Device(mx.cpu))[0] == mx.bfloat16
    with pytest.raises(EngineError, match="float32 or bfloat16"):
        numerics.choose(mx.Device(mx.cpu), "float16")


def test_real_measurement_is_cheap_and_blas_is_named():
    found = numerics.measure_linear(rounds=1)
    assert found["float32_s"] > 0 and found["bfloat16_s"] > 0
    print(f"\nBLAS: {blas.describe()}; 64x1024x1024 linear {found}")
    assert blas.describe()
