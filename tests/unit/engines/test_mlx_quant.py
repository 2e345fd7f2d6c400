"""The MLX engine on a quantized base: packed linears through ``mx.quantized_matmul``, embedding
rows dequantized alone, group 16 dequantized on load; streamed equals resident bit for bit in
float32, in inference and in LoRA training, and both sit within float32 rounding of the float
folder of the same values (``quantized_matmul`` and the BLAS float product sum in their own
orders: equal on MLX's bundled reference BLAS, not on OpenBLAS); a tune checkpoint crosses to the
torch engine on the same quantized folder and back; where mlx-lm is installed, it loads the
folder and spill's MLX adapter export and computes spill's numbers."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from tests.unit.engines.kit import load_engine

MLX = load_engine("mlx", module=True)  # skips this whole module where MLX is missing
mx = pytest.importorskip("mlx.core")

from spill.engines.base import GenerateParams  # noqa: E402
from spill.engines.mlx.ops import Packed, embedding, matmul_t  # noqa: E402
from spill.engines.torch import ENGINE as TORCH  # noqa: E402
from spill.models import quant  # noqa: E402
from spill.models.config import load_config  # noqa: E402
from spill.models.lora import LoraConfig  # noqa: E402
from spill.models.quantize import _read, dequantize_folder, quantize_model  # noqa: E402
from spill.store.safetensors_io import write_file  # noqa: E402
from tests.unit.engines import kit  # noqa: E402
from tests.unit.engines.kit import equal_states, fresh, tune  # noqa: E402

pytestmark = pytest.mark.mlx

PROMPTS = [np.arange(3, 12, dtype=np.int64), np.arange(40, 45, dtype=np.int64)]
COMPLETIONS = [np.arange(7, 10, dtype=np.int64)] * 2
LORA = LoraConfig(rank=4, alpha=8, targets=("q_proj", "v_proj", "o_proj", "down_proj"))
# torch and MLX on the same quantized folder in float32: the float engines' rounding distance
# (measured 5.7e-6 on the tiny llama q4g32, 9.5e-7 on the tiny qwen2 q8g64)
CROSS_ENGINE_LOGPROB = 2e-5
# MLX's quantized kernel vs its float matmul on the dequantized values, float32: 0 on the bundled
# reference BLAS; on OpenBLAS 0.3.21 (its own summation order) 4.8e-6 on the tiny llama q4g32,
# 1.4e-6 on the tiny qwen2 q8g64, 1.9e-6 with one g16 module dequantized
FLOAT_FOLDER_LOGPROB = 2e-5


def _within_rounding(got, x, w, want):
    """|got - want| within the worst-case float32 error of two length-n dot products each
    (n * 2^-23 * sum |x||w|): two summation orders of the same exact products."""
    n = x.shape[-1]
    bound = n * 2.0**-23 * (np.abs(x) @ np.abs(w))
    assert np.all(np.abs(got - want) <= bound)


def _packed(bits, group, rows=24, cols=256, scale_dtype=np.float32, seed=0):
    rng = np.random.default_rng(bits * group + seed)
    q = rng.integers(0, 1 << bits, (rows, cols), dtype=np.uint8)
    s = rng.standard_normal((rows, cols // group)).astype(scale_dtype)
    b = rng.standard_normal((rows, cols // group)).astype(scale_dtype)
    w = quant.pack(q, bits)
    want = quant.dequantize(w, s.astype(np.float32), b.astype(np.float32), bits, group)
    return Packed(mx.array(w), mx.array(s), mx.array(b), bits, group, mx.float32), want


@pytest.mark.parametrize("bits", quant.BITS)
@pytest.mark.parametrize("group", quant.GROUP_SIZES)
@pytest.mark.parametrize("scale_dtype", [np.float32, np.float16])
def test_packed_linear_and_rows_equal_the_dequantized_matrix(bits, group, scale_dtype):
    packed, want = _packed(bits, group, scale_dtype=scale_dtype)
    ids = mx.array([[3, 0, 23], [5, 5, 1]])
    rows = np.array(embedding(packed, ids))  # (2, 3, 256)
    assert np.array_equal(rows.view(np.uint32), want[np.array(ids)].view(np.uint32))
    x = mx.random.normal((2, 5, 256), key=mx.random.key(bits + group))
    got = np.array(matmul_t(x, packed))  # (2, 5, 24)
    _within_rounding(got, np.array(x), want.T, np.array(x @ mx.array(want).T))
    grad = mx.random.normal((2, 5, 24), key=mx.random.key(1))
    _, (gx,) = mx.vjp(lambda h: [matmul_t(h, packed)], [x], [grad])
    _within_rounding(np.array(gx), np.array(grad), want, np.array(grad @ mx.array(want)))


def _scores(engine, folder, **opts):
    runner = kit.open_runner(engine, folder, dtype="float32", **opts)
    try:
        scores = runner.score(PROMPTS, COMPLETIONS)
        gens = runner.generate(PROMPTS, GenerateParams(6), [0, 1])
        return np.concatenate(scores), kit.tokens(gens), runner.info.weights
    finally:
        runner.close()


@pytest.mark.parametrize(("family", "bits", "group"), [("llama", 4, 32), ("qwen2", 8, 64)])
def test_streamed_equals_resident_equals_the_float_folder(family, bits, group, tmp_path):
    folder = quantize_model(f"tiny:{family}:1", bits, group, progress=lambda _: None)
    plain = dequantize_folder(folder, tmp_path / "plain")
    ref, ref_tokens, words = _scores(MLX, folder, resident=True)
    assert words == f"{bits}-bit affine g{group}"
    logp, toks, _ = _scores(MLX, folder, ring=2)
    assert np.array_equal(logp, ref) and toks == ref_tokens
    floats, float_tokens, none = _scores(MLX, plain, resident=True)
    assert none == "" and float_tokens == ref_tokens
    assert np.abs(floats - ref).max() <= FLOAT_FOLDER_LOGPROB
    theirs, their_tokens, _ = _scores(TORCH, folder, ring=2)
    assert np.abs(theirs - ref).max() <= CROSS_ENGINE_LOGPROB and their_tokens == ref_tokens


def test_group_16_is_dequantized_on_load_and_said(tmp_path):
    """A g32 module rewritten as g16 (each scale and bias twice: the same values) computes the
    same numbers (that module dequantized: float32 rounding apart), streamed as resident, and the
    pre-run words say mlx dequantized it."""
    source = quantize_model("tiny:llama:1", 8, 32, progress=lambda _: None)
    folder = tmp_path / "g16"
    shutil.copytree(source, folder)
    tensors = _read(folder / "model.safetensors")
    module = "model.layers.1.mlp.down_proj"
    for part in ("scales", "biases"):
        dtype, a = tensors[f"{module}.{part}"]
        tensors[f"{module}.{part}"] = (dtype, np.repeat(a, 2, axis=1))
    write_file(folder / "model.safetensors", tensors, {"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization"][module] = {"group_size": 16, "bits": 8}
    (folder / "config.json").write_text(json.dumps(config))
    source_logp, source_tokens, _ = _scores(MLX, source, resident=True)
    ref, ref_tokens, words = _scores(MLX, folder, resident=True)
    assert words == "8-bit affine g32, 1 module 8-bit g16, 1 module g16 dequantized " + (
        "(mlx takes g32/g64/g128)"
    )
    logp, toks, _ = _scores(MLX, folder, ring=2)
    assert np.array_equal(logp, ref) and toks == ref_tokens
    assert ref_tokens == source_tokens
    assert np.abs(ref - source_logp).max() <= FLOAT_FOLDER_LOGPROB


def _tuned(engine, folder, steps=3, **opts):
    cfg = load_config(folder)
    trainer = fresh(kit.open_runner(engine, folder, dtype="float32", **opts), cfg, LORA)
    return tune(trainer, steps), trainer


def test_lora_on_a_packed_base_streamed_equals_resident_and_the_float_folder(tmp_path):
    folder = quantize_model("tiny:qwen2:2", 4, 32, progress=lambda _: None)
    plain = dequantize_folder(folder, tmp_path / "plain")
    ref_losses, ref = _tuned(MLX, folder, resident=True)
    losses, trainer = _tuned(MLX, folder, ring=2)
    assert losses == ref_losses and equal_states(trainer.state(), ref.state())
    float_losses, _ = _tuned(MLX, plain, resident=True)
    np.testing.assert_allclose(float_losses, ref_losses, rtol=1e-5)  # float32 rounding apart
    assert ref_losses[-1] < ref_losses[0]
    _, params, _ = ref.state()
    assert all(a.dtype == np.float32 for a in params.values())  # adapters stay float32


@pytest.mark.parametrize(("first", "then"), [("mlx", "torch"), ("torch", "mlx")])
def test_a_checkpoint_on_the_packed_base_continues_on_the_other_engine(first, then):
    folder = quantize_model("tiny:llama:2", 4, 64, progress=lambda _: None)
    engines = {"mlx": MLX, "torch": TORCH}
    losses, start = _tuned(engines[first], folder, ring=2)
    rest = kit.open_runner(engines[then], folder, dtype="float32", ring=2).trainer(LORA)
    rest.set_state(*start.state())
    assert equal_states(rest.state(), start.state())
    losses += tune(rest, 3, start=3)
    reference, _ = _tuned(TORCH, folder, steps=6, ring=2)
    np.testing.assert_allclose(losses, reference, rtol=1e-5)  # the float engines' distance
    assert losses[-1] < losses[0]


# spill MLX vs mlx-lm 0.32.2 on the same quantized folder, float32 log-probs: measured 3.8e-6 on
# the tiny llama q4g32, with and without spill's exported adapter (the same quantized kernels;
# mlx-lm's RoPE, attention and softmax are its own ops)
MLX_LM_LOGPROB = 1e-4


def _mlx_lm_log_probs(mlx_lm, folder, adapter=None) -> np.ndarray:
    """mlx-lm's float32 log-probs of COMPLETIONS after PROMPTS, one row at a time (no padding)."""
    model, _ = mlx_lm.load(str(folder), adapter_path=str(adapter) if adapter else None)
    model.set_dtype(mx.float32)  # scales, biases and norms; the packed words stay uint32
    out = []
    for p, c in zip(PROMPTS, COMPLETIONS, strict=True):
        ids = np.concatenate([p, c])
        logits = model(mx.array(ids[None, :-1]))[0].astype(mx.float32)  # (T - 1, V)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        picked = mx.take_along_axis(logp, mx.array(ids[1:, None]), axis=1)[:, 0]
        out.append(np.array(picked)[len(p) - 1 :])
    return np.concatenate(out)


def test_mlx_lm_loads_the_folder_and_spill_s_adapter_with_spill_s_numbers(tmp_path):
    mlx_lm = pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install mlx-lm)")
    from spill.models.lora import export_mlx

    folder = quantize_model("tiny:llama:1", 4, 32, progress=lambda _: None)
    cfg = load_config(folder)
    runner = kit.open_runner(MLX, folder, dtype="float32", resident=True)
    try:
        ours = np.concatenate(runner.score(PROMPTS, COMPLETIONS))
        trainer = fresh(runner, cfg, LORA)
        tune(trainer, 3)
        params, _, _ = trainer.state()
        runner.use_adapter(LORA, params)
        tuned = np.concatenate(runner.score(PROMPTS, COMPLETIONS))
    finally:
        runner.close()
    adapter = export_mlx(params, LORA, cfg.num_hidden_layers, tmp_path / "mlx")
    plain = np.abs(_mlx_lm_log_probs(mlx_lm, folder) - ours).max()
    with_adapter = np.abs(_mlx_lm_log_probs(mlx_lm, folder, adapter) - tuned).max()
    print(f"\nmlx-lm vs spill MLX: base {plain:.2e}, with the adapter {with_adapter:.2e}")
    assert plain <= MLX_LM_LOGPROB and with_adapter <= MLX_LM_LOGPROB
    assert np.abs(tuned - ours).max() > 100 * MLX_LM_LOGPROB  # the adapter changes the model
