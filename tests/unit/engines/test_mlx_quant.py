"""The MLX engine on a quantized base: packed linears through ``mx.quantized_matmul`` below
``ops.DENSE_ROWS`` rows, dequantized per use at or above it (a CPU), embedding rows dequantized
alone, group 16 dequantized on load. Streamed equals resident bit for bit in float32, in
inference and in LoRA training. ``quantized_matmul`` sits within float32 rounding of the float
product of the same values (its own summation order: equal on MLX's bundled reference BLAS, not
on OpenBLAS); a dequantized product is the float folder's bit for bit, so scoring and training
(every product many rows) equal the float folder. A one-graph vjp over many packed layers holds
no layer's float matrix past its product. A tune checkpoint crosses to the torch engine on the
same quantized folder and back; where mlx-lm is installed, it loads the folder and spill's MLX
adapter export and computes spill's numbers."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from tests.unit.engines.kit import load_engine

MLX = load_engine("mlx", module=True)  # skips this whole module where MLX is missing
mx = pytest.importorskip("mlx.core")

from spill.engines.base import GenerateParams  # noqa: E402
from spill.engines.mlx.ops import DENSE_ROWS, Packed, embedding, matmul_t  # noqa: E402
from spill.engines.torch import ENGINE as TORCH  # noqa: E402
from spill.models import quant  # noqa: E402
from spill.models.config import load_config  # noqa: E402
from spill.models.lora import LoraConfig  # noqa: E402
from spill.models.resolve import quantize_model  # noqa: E402
from spill.models.sources.quantize import _read, dequantize_folder  # noqa: E402
from spill.store.safetensors_io import write_file  # noqa: E402
from tests.unit.engines import kit  # noqa: E402
from tests.unit.engines.kit import equal_states, fresh, tune  # noqa: E402

pytestmark = pytest.mark.mlx

PROMPTS = [np.arange(3, 12, dtype=np.int64), np.arange(40, 45, dtype=np.int64)]
# each row scored alone (its own length) with 8 scored positions: every product of the layers and
# the head has >= DENSE_ROWS rows, so MLX dequantizes it as the float folder multiplies
COMPLETIONS = [np.arange(7, 15, dtype=np.int64)] * 2
LORA = LoraConfig(rank=4, alpha=8, targets=("q_proj", "v_proj", "o_proj", "down_proj"))
# torch and MLX on the same quantized folder in float32: the float engines' rounding distance
# (measured 5.7e-6 on the tiny llama q4g32, 9.5e-7 on the tiny qwen2 q8g64)
CROSS_ENGINE_LOGPROB = 2e-5


def _within_rounding(got, x, w, want):
    """|got - want| within the worst-case float32 error of two length-n dot products each
    (n * 2^-23 * sum |x||w|): two summation orders of the same exact products."""
    n = x.shape[-1]
    bound = n * 2.0**-23 * (np.abs(x) @ np.abs(w))
    assert np.all(np.abs(got - want) <= bound)


def _packed(bits, group, rows=24, cols=256, scale_dtype=np.float32, seed=0, dense=None):
    rng = np.random.default_rng(bits * group + seed)
    q = rng.integers(0, 1 << bits, (rows, cols), dtype=np.uint8)
    s = rng.standard_normal((rows, cols // group)).astype(scale_dtype)
    b = rng.standard_normal((rows, cols // group)).astype(scale_dtype)
    w = quant.pack(q, bits)
    want = quant.dequantize(w, s.astype(np.float32), b.astype(np.float32), bits, group)
    return Packed(mx.array(w), mx.array(s), mx.array(b), bits, group, mx.float32, dense), want


@pytest.mark.parametrize("bits", quant.BITS)
@pytest.mark.parametrize("group", quant.GROUP_SIZES)
@pytest.mark.parametrize("scale_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("dense", [None, DENSE_ROWS])
def test_packed_linear_and_rows_equal_the_dequantized_matrix(bits, group, scale_dtype, dense):
    """quantized_matmul within float32 rounding of the float product; dequantized per use (10
    rows >= DENSE_ROWS) it is the float product, forward and vjp, bit for bit."""
    packed, want = _packed(bits, group, scale_dtype=scale_dtype, dense=dense)
    ids = mx.array([[3, 0, 23], [5, 5, 1]])
    rows = np.array(embedding(packed, ids))  # (2, 3, 256)
    assert np.array_equal(rows.view(np.uint32), want[np.array(ids)].view(np.uint32))
    x = mx.random.normal((2, 5, 256), key=mx.random.key(bits + group))
    got = np.array(matmul_t(x, packed))  # (2, 5, 24)
    grad = mx.random.normal((2, 5, 24), key=mx.random.key(1))
    _, (gx,) = mx.vjp(lambda h: [matmul_t(h, packed)], [x], [grad])
    ref, ref_gx = np.array(x @ mx.array(want).T), np.array(grad @ mx.array(want))
    if dense:
        assert np.array_equal(got, ref) and np.array_equal(np.array(gx), ref_gx)
    else:
        _within_rounding(got, np.array(x), want.T, ref)
        _within_rounding(np.array(gx), np.array(grad), want, ref_gx)


def test_rows_below_the_threshold_keep_quantized_matmul():
    packed, want = _packed(4, 32, dense=DENSE_ROWS)
    quantized, _ = _packed(4, 32)
    for shape in [(1, 256), (1, DENSE_ROWS - 1, 256), (DENSE_ROWS, 256), (2, DENSE_ROWS, 256)]:
        x = mx.random.normal(shape, key=mx.random.key(len(shape)))
        got, q = np.array(matmul_t(x, packed)), np.array(matmul_t(x, quantized))
        float_product = np.array(x @ mx.array(want).T)
        rows = x.size // 256
        assert np.array_equal(got, float_product if rows >= DENSE_ROWS else q), shape


def _stack_peak(dense, layers=12, rows=8, width=256, hidden=1024) -> int:
    """Peak MLX memory (bytes above the start) of one vjp over ``layers`` packed up/down pairs
    with a float adapter each, as ``stack_vjp`` runs a resident stack: one lazy graph."""
    pairs = [
        (_packed(4, 32, hidden, width, seed=i, dense=dense)[0],
         _packed(4, 32, width, hidden, seed=100 + i, dense=dense)[0])
        for i in range(layers)
    ]  # fmt: skip
    mx.eval([p.arrays() for pair in pairs for p in pair])
    x = mx.random.normal((rows, width), key=mx.random.key(0))
    adapters = [mx.zeros((width, 1)) for _ in pairs]
    mx.eval(x, adapters)

    def run(*ads):
        h = x
        for (up, down), a in zip(pairs, ads, strict=True):
            h = h + matmul_t(mx.tanh(matmul_t(h, up)), down) * 0.01 + h @ a
        return [h.sum()]

    mx.synchronize()
    start = mx.get_active_memory()
    mx.reset_peak_memory()
    _, got = mx.vjp(run, adapters, [mx.array(1.0)])
    mx.eval(got)
    return mx.get_peak_memory() - start


def test_a_one_graph_vjp_dequantizes_per_use_and_holds_no_layer_s_float_matrix():
    """Layers of two 1 MiB float32 matrices each: the graph's peak stays a few matrices (measured
    6.4, 7.0 and 8.1 at 6, 12 and 24 layers: transients in flight, activations a few KiB a layer)
    and does not grow a matrix a layer. A plain graph, where the dequantized matrix is an input of
    the product that its backward keeps, held every layer's: 12.4, 24.6 and 49.1."""
    matrix = 1024 * 256 * 4
    peak12, peak24 = _stack_peak(DENSE_ROWS, layers=12), _stack_peak(DENSE_ROWS, layers=24)
    assert peak12 < 12 * matrix, peak12 / matrix  # half of the stack's 24 matrices
    assert peak24 - peak12 < 3 * matrix, (peak24 - peak12) / matrix  # plain: + 24


def _scores(engine, folder, **opts):
    runner = kit.open_runner(engine, folder, dtype="float32", device="cpu", **opts)
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
    assert words == f"{bits}-bit affine g{group}, dequantized per use for >= {DENSE_ROWS} rows"
    logp, toks, _ = _scores(MLX, folder, ring=2)
    assert np.array_equal(logp, ref) and toks == ref_tokens
    floats, float_tokens, none = _scores(MLX, plain, resident=True)
    assert none == "" and float_tokens == ref_tokens
    # every scored product has >= DENSE_ROWS rows: dequantized, the float folder's products
    assert np.array_equal(floats, ref)
    theirs, their_tokens, _ = _scores(TORCH, folder, ring=2)
    assert np.abs(theirs - ref).max() <= CROSS_ENGINE_LOGPROB and their_tokens == ref_tokens


def test_group_16_is_dequantized_on_load_and_said(tmp_path):
    """A g32 module rewritten as g16 (each scale and bias twice: the same values) computes the
    same numbers (scoring dequantizes every product, that module at load, the others per use: the
    same floats, bit for bit), streamed as resident, and the pre-run words say mlx dequantized it."""
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
    assert words == (
        f"8-bit affine g32, 1 module 8-bit g16, dequantized per use for >= {DENSE_ROWS} rows, "
        "1 module g16 dequantized (mlx takes g32/g64/g128)"
    )
    logp, toks, _ = _scores(MLX, folder, ring=2)
    assert np.array_equal(logp, ref) and toks == ref_tokens
    assert ref_tokens == source_tokens
    assert np.array_equal(ref, source_logp)  # scoring dequantizes every product: the same floats


def _tuned(engine, folder, steps=3, **opts):
    cfg = load_config(folder)
    trainer = fresh(
        kit.open_runner(engine, folder, dtype="float32", device="cpu", **opts), cfg, LORA
    )
    return tune(trainer, steps), trainer


def test_lora_on_a_packed_base_streamed_equals_resident_equals_the_float_folder(tmp_path):
    folder = quantize_model("tiny:qwen2:2", 4, 32, progress=lambda _: None)
    plain = dequantize_folder(folder, tmp_path / "plain")
    ref_losses, ref = _tuned(MLX, folder, resident=True)
    losses, trainer = _tuned(MLX, folder, ring=2)
    assert losses == ref_losses and equal_states(trainer.state(), ref.state())
    float_losses, _ = _tuned(MLX, plain, resident=True)
    assert float_losses == ref_losses  # every training product has >= DENSE_ROWS rows
    assert ref_losses[-1] < ref_losses[0]
    _, params, _ = ref.state()
    assert all(a.dtype == np.float32 for a in params.values())  # adapters stay float32


def test_dequantized_per_use_streamed_equals_resident_equals_the_float_folder(tmp_path):
    """Nine rows decode with every product dequantized per use (9 >= DENSE_ROWS; the prefill,
    scoring and training have more rows): scores, greedy tokens, losses and tune states are equal
    streamed and resident, and equal the float folder's, bit for bit."""
    folder = quantize_model("tiny:llama:2", 4, 32, progress=lambda _: None)
    plain = dequantize_folder(folder, tmp_path / "plain")
    prompts = [np.arange(3 + k, 9 + 2 * k, dtype=np.int64) for k in range(9)]
    # 8 scored positions a row: each row's head product (scored alone) has DENSE_ROWS rows
    completions = [np.arange(20 + k, 28 + k, dtype=np.int64) for k in range(9)]
    got = {}
    for side, f, opts in (
        ("resident", folder, {"resident": True}),
        ("ring", folder, {"ring": 2}),
        ("float", plain, {"resident": True}),
    ):
        runner = kit.open_runner(MLX, f, dtype="float32", device="cpu", **opts)
        scores = np.concatenate(runner.score(prompts, completions))
        gens = kit.tokens(runner.generate(prompts, GenerateParams(6), list(range(9))))
        trainer = fresh(runner, load_config(f), LORA)
        got[side] = scores, gens, tune(trainer, 3), trainer.state()
        runner.close()
    ref = got["resident"]
    for side in ("ring", "float"):
        scores, gens, losses, state = got[side]
        assert np.array_equal(scores, ref[0]) and gens == ref[1], side
        assert losses == ref[2] and equal_states(state, ref[3]), side


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
