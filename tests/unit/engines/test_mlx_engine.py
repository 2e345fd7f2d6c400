"""The MLX engine: streamed == resident bit for bit, float32 agreement with the torch engine on
both families, seeded sampling, the ring sized from memory, measured numerics and the BLAS it reports."""

from __future__ import annotations

import importlib.util
import json
import shutil

import numpy as np
import pytest

if importlib.util.find_spec("mlx") is None:  # checked without importing mlx.core (see blas.py)
    pytest.skip(
        'MLX is not installed: pip install "mlx[cpu]" (Linux) or mlx (macOS)',
        allow_module_level=True,
    )
mlx_engine = pytest.importorskip("spill.engines.mlx", reason="the MLX engine does not import")
mx = pytest.importorskip("mlx.core")

from spill.engines import resolve  # noqa: E402
from spill.engines.base import GenerateParams, LoadOptions, ModelSpec  # noqa: E402
from spill.engines.mlx import blas, numerics  # noqa: E402
from spill.engines.torch import ENGINE as TORCH  # noqa: E402
from spill.errors import EngineError  # noqa: E402
from spill.models.config import load_config  # noqa: E402
from spill.models.lora import LoraConfig, init_params  # noqa: E402
from spill.models.tiny import write_tiny  # noqa: E402
from spill.paths import machine_cache  # noqa: E402

pytestmark = pytest.mark.mlx

MLX = mlx_engine.ENGINE
PROMPTS = [np.array([5, 6, 7, 8, 9, 10]), np.array([100, 3]), np.arange(20, 40)]
COMPLETIONS = [np.array([11, 12, 13]), np.array([4, 5, 6, 7]), np.array([1])]
GREEDY = GenerateParams(max_new_tokens=12)
SAMPLED = GenerateParams(max_new_tokens=24, temperature=1.0, top_p=0.9)
LOGPROB_TOLERANCE = 1e-5  # float32, MLX vs torch; measured 5.7e-6 (llama), 4.8e-7 (qwen2)


def open_runner(folder, engine=MLX, **options):
    return engine.open(ModelSpec(folder, load_config(folder)), LoadOptions(**options))


def tokens(gens):
    return [(g.tokens.tolist(), g.finish) for g in gens]


def same(xs, ys) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(xs, ys, strict=True))


@pytest.fixture
def runners(tiny_model):
    """(streamed with a ring of 2, resident), both float32."""
    streamed = open_runner(tiny_model, ring=2, dtype="float32")
    resident = open_runner(tiny_model, resident=True, dtype="float32")
    yield streamed, resident
    streamed.close()
    resident.close()


def test_resolves_by_name_and_reports_itself(tiny_models):
    assert resolve("mlx") is MLX and MLX.name == "mlx"
    runner = open_runner(tiny_models["llama"], ring=2, dtype="float32")
    info = runner.info
    assert (info.engine, info.device, info.numerics) == ("mlx", "cpu", "float32")
    assert info.why == f"requested; BLAS {blas.describe()}"
    assert "engine mlx · device cpu · numerics float32" in info.line()
    with pytest.raises(EngineError, match="cpu or gpu"):
        open_runner(tiny_models["llama"], device="cuda:0")


def test_streamed_and_resident_are_bit_identical(runners):
    streamed, resident = runners
    assert not streamed.info.resident and streamed.info.ring == 2 and resident.info.resident
    a, b = streamed.score(PROMPTS, COMPLETIONS), resident.score(PROMPTS, COMPLETIONS)
    assert all(x.dtype == np.float32 for x in a) and same(a, b)
    for params in (GREEDY, SAMPLED):
        seeds = [1, 2, 3]
        assert tokens(streamed.generate(PROMPTS, params, seeds)) == tokens(
            resident.generate(PROMPTS, params, seeds)
        )
    assert streamed.stats.extra["ring_max_live"] <= 2


def test_bfloat16_streamed_and_resident_are_bit_identical(tiny_models):
    folder = tiny_models["qwen2"]
    streamed = open_runner(folder, ring=2, dtype="bfloat16")
    resident = open_runner(folder, resident=True, dtype="bfloat16")
    assert streamed.info.numerics == "bfloat16" and streamed.model.kernel.embed.dtype == mx.bfloat16
    a = streamed.score(PROMPTS, COMPLETIONS)
    assert same(a, resident.score(PROMPTS, COMPLETIONS))
    ref = open_runner(folder, dtype="float32").score(PROMPTS, COMPLETIONS)
    assert max(np.abs(x - y).max() for x, y in zip(a, ref, strict=True)) < 0.1


def test_log_probs_and_greedy_match_torch(runners, tiny_model):
    streamed, _ = runners
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
    folder = tmp_path / "llama3"
    shutil.copytree(tiny_models["llama"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    prompt, completion = np.arange(30, 90), np.arange(90, 120)
    ours = open_runner(folder, dtype="float32").score([prompt], [completion])[0]
    theirs = open_runner(folder, TORCH, dtype="float32").score([prompt], [completion])[0]
    assert np.abs(ours - theirs).max() <= LOGPROB_TOLERANCE


def test_sharded_model_equals_single_file(tiny_models, tmp_path):
    sharded = write_tiny(tmp_path / "sharded", family="qwen2", seed=7, shards=3)
    a = open_runner(sharded, ring=2, dtype="float32").score(PROMPTS, COMPLETIONS)
    b = open_runner(tiny_models["qwen2"], ring=2, dtype="float32").score(PROMPTS, COMPLETIONS)
    assert same(a, b)


def test_seeded_sampling_is_reproducible_and_ignores_batch_neighbours(tiny_models):
    runner = open_runner(tiny_models["llama"], ring=2, dtype="float32")
    seeds = [11, 12, 13]
    batch = runner.generate(PROMPTS, SAMPLED, seeds)
    assert tokens(batch) == tokens(runner.generate(PROMPTS, SAMPLED, seeds))
    for prompt, seed, in_batch in zip(PROMPTS, seeds, batch, strict=True):
        assert tokens(runner.generate([prompt], SAMPLED, [seed])) == tokens([in_batch])
    outs = {tuple(runner.generate([PROMPTS[0]], SAMPLED, [s])[0].tokens) for s in range(4)}
    assert len(outs) > 1


def test_stop_ids_edges_and_stats(tiny_models):
    runner = open_runner(tiny_models["qwen2"], ring=2, dtype="float32")
    free = runner.generate(PROMPTS, GREEDY, [0, 0, 0])
    first = int(free[1].tokens[0])
    stopped = runner.generate(
        PROMPTS, GenerateParams(max_new_tokens=12, stop_ids=(first,)), [0] * 3
    )
    for g, f in zip(stopped, free, strict=True):
        at = f.tokens.tolist().index(first) if first in f.tokens else None
        want = (f.tokens.tolist(), "length") if at is None else (f.tokens[:at].tolist(), "stop")
        assert (g.tokens.tolist(), g.finish) == want
    before = runner.stats.layer_loads
    assert runner.score([np.array([1, 2])], [np.array([], dtype=np.int64)])[0].shape == (0,)
    out = runner.generate([np.array([1, 2])], GenerateParams(max_new_tokens=0), [0])
    assert out[0].tokens.shape == (0,) and out[0].finish == "length"
    runner.generate([np.array([1, 2])], GenerateParams(max_new_tokens=3), [0])
    layers = runner.info.layers
    assert runner.stats.layer_loads - before == layers + 3 * layers  # score, prefill, 2 steps
    assert runner.stats.extra["ring_max_live"] <= 2
    with pytest.raises(EngineError, match="token ids"):
        runner.score([np.array([1, 999])], [np.array([1])])


# -- the ring inside the engine (the ring itself: test_ring.py) ---------------------------


def test_engine_sizes_the_ring_from_memory(tiny_models):
    folder = tiny_models["llama"]
    cfg = load_config(folder)
    layer_bytes = cfg.layer_params() * 4
    tight = open_runner(folder, dtype="float32", memory=layer_bytes * 3 + 1).info
    assert (tight.resident, tight.ring) == (False, 3)
    assert open_runner(folder, dtype="float32", memory=1).info.ring == 2
    assert open_runner(folder, dtype="float32").info.resident


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
    found = numerics.measure_linear(reps=1)
    assert found["float32_s"] > 0 and found["bfloat16_s"] > 0
    print(f"\nBLAS: {blas.describe()}; 64x1024x1024 linear {found}")
    assert blas.describe()
