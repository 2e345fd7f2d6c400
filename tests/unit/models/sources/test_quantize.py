"""``spill models quantize``: a tiny float model's quantized copy in the cache holds exactly what
``mx.quantize`` makes of its weights (skipped without MLX), the torch engine computes on it as on
a float folder of the dequantized weights, bit for bit, and it is found by its name."""

from __future__ import annotations

import json

import numpy as np
import pytest

from spill.engines.base import GenerateParams, LoadOptions, ModelSpec
from spill.errors import ModelError, ModelNotFound
from spill.ground.hashing import file_sha256
from spill.models import quant
from spill.models.config import load_config
from spill.models.resolve import quantize_model, resolve_model
from spill.models.sources.quantize import _read, dequantize_folder
from spill.models.sources.tiny import write_tiny
from spill.store.safetensors_io import bf16_bits_to_float32


def _modules(folder) -> dict:
    return {
        n[: -len(".scales")] for n in _read(folder / "model.safetensors") if n.endswith(".scales")
    }


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_copy_holds_every_linear_and_embedding_packed(family):
    folder = quantize_model(f"tiny:{family}:3", 4, 32, progress=lambda _: None)
    assert folder.name == f"tiny-{family}-3-4x64-q4g32"
    tensors = _read(folder / "model.safetensors")
    modules = _modules(folder)
    assert "model.embed_tokens" in modules and "model.layers.3.mlp.down_proj" in modules
    untied = not load_config(folder).tie_word_embeddings
    assert len(modules) == 1 + 4 * 7 + untied and ("lm_head" in modules) == untied
    assert tensors["model.layers.0.self_attn.q_proj.weight"][0] == "U32"
    assert tensors["model.layers.0.self_attn.q_proj.scales"][0] == "BF16"  # the model's dtype
    assert tensors["model.norm.weight"][0] == "BF16"
    if family == "qwen2":
        assert tensors["model.layers.0.self_attn.q_proj.bias"][0] == "BF16"  # biases stay float
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 4}
    marker = json.loads((folder / "spill-source.json").read_text())
    assert marker["name"] == f"tiny:{family}:3:4x64@q4g32" and marker["source"] == "quantized"
    for name, rec in marker["files"].items():
        assert rec["sha256"] == file_sha256(folder / name)
    assert resolve_model(f"tiny:{family}:3@q4g32", progress=pytest.fail).folder == folder


@pytest.mark.parametrize(("bits", "group"), [(4, 64), (8, 32)])
def test_copy_equals_mx_quantize_and_mx_dequantize(bits, group):
    mx = pytest.importorskip("mlx.core", reason="MLX is not installed: no reference quantizer")
    try:
        import mlx_lm  # noqa: F401
    except ImportError:
        pass  # mlx-lm is not installed here: its loader is not tried, mx's own ops are
    source = resolve_model("tiny:llama:4", progress=lambda _: None).folder
    floats = _read(source / "model.safetensors")
    folder = quantize_model("tiny:llama:4", bits, group, progress=lambda _: None)
    ours = _read(folder / "model.safetensors")
    for module in _modules(folder):
        w = mx.array(floats[f"{module}.weight"][1]).view(mx.bfloat16)
        mq, ms, mb = mx.quantize(w, group_size=group, bits=bits)
        q, s, b = (ours[f"{module}.{p}"][1] for p in ("weight", "scales", "biases"))
        assert np.array_equal(np.array(mq), q), module
        assert np.array_equal(np.array(ms.view(mx.uint16)), s), module
        assert np.array_equal(np.array(mb.view(mx.uint16)), b), module
        s32, b32 = bf16_bits_to_float32(s), bf16_bits_to_float32(b)
        want = np.array(mx.dequantize(mq, mx.array(s32), mx.array(b32), group, bits))
        got = quant.dequantize(q, s32, b32, bits, group)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), module


def test_torch_on_the_copy_equals_a_float_folder_of_its_values(tmp_path):
    from spill.engines import resolve

    folder = quantize_model("tiny:qwen2:5", 4, 64, progress=lambda _: None)
    plain = dequantize_folder(folder, tmp_path / "plain")
    assert "quantization" not in json.loads((plain / "config.json").read_text())
    prompts = [np.arange(3, 12, dtype=np.int64), np.arange(40, 45, dtype=np.int64)]
    completions = [np.arange(7, 10, dtype=np.int64)] * 2
    got = []
    for where, opts in (
        (plain, {"resident": True}),
        (folder, {"ring": 2}),
        (folder, {"resident": True}),
    ):
        runner = resolve("torch").open(
            ModelSpec(where, load_config(where)), LoadOptions(dtype="float32", **opts)
        )
        try:
            scores = runner.score(prompts, completions)
            gens = runner.generate(prompts, GenerateParams(5), [0, 1])
        finally:
            runner.close()
        got.append(
            ([s.view(np.uint32).tolist() for s in scores], [g.tokens.tolist() for g in gens])
        )
    assert got[1] == got[0] and got[2] == got[0]


def _read_one(folder, name):
    return _read(folder / "model.safetensors")[name][1]


def test_names_and_refusals(tmp_path):
    with pytest.raises(
        ModelNotFound, match=r"spill models quantize tiny:llama:9 --bits 8 --group-size 32"
    ):
        resolve_model("tiny:llama:9@q8g32", progress=pytest.fail)
    with pytest.raises(ModelError, match="groups of 128; use a smaller --group-size"):
        quantize_model("tiny:llama:6", 8, 128, progress=lambda _: None)  # hidden 64
    folder = quantize_model("tiny:llama:6", 8, 32, progress=lambda _: None)
    with pytest.raises(ModelError, match="already quantized") as e:
        quantize_model(str(folder), 4, 64, progress=lambda _: None)
    assert "\n" not in str(e.value)
    again = []
    assert quantize_model("tiny:llama:6", 8, 32, progress=again.append) == folder
    assert "already in the cache" in again[0]
    with pytest.raises(ModelError, match="--group-size 16"):
        quantize_model("tiny:llama:6", 4, 16, progress=lambda _: None)
    sharded = write_tiny(tmp_path / "sharded", "llama", seed=2, shards=2)
    out = quantize_model(str(sharded), 4, 32, progress=lambda _: None)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["model.layers.0.mlp.up_proj.scales"] == index["model.layers.0.mlp.up_proj.weight"]
    assert load_config(out).quant_spec("model.embed_tokens") == (4, 32)
    assert resolve_model(str(out), progress=pytest.fail).folder == out.resolve()
