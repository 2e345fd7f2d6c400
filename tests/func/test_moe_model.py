"""bench/moe_model.py (issue 41): its defaults are Qwen3-30B-A3B's shape (30,532,122,624
parameters), and at a small shape (2 layers, 8 experts, hidden 256, a 512-token vocabulary)
it writes what ``mlx_lm convert -q --q-bits 4 --q-group-size 64`` writes from a float
transformers ``Qwen3MoeForCausalLM`` of that shape: the same tensors, dtypes and shapes, the
same ``quantization`` (the router at 8 bits) and index metadata. Its dequantized weights have
the std it promises, spill's torch and MLX engines score it finitely, and mlx-lm's own
``load`` reads and runs it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench import moe_model
from spill.models.quant import dequantize
from spill.store.safetensors_io import bf16_bits_to_float32, read_header
from tests.unit.engines.kit import load_engine, open_runner

ROOT = Path(__file__).resolve().parents[2]
SHAPE = {
    "layers": 2,
    "experts": 8,
    "experts-per-token": 2,
    "hidden": 256,
    "intermediate": 384,
    "expert-intermediate": 128,
    "heads": 4,
    "kv-heads": 2,
    "head-dim": 64,
    "vocab": 512,
}
TOKENIZER = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def generated(tmp_path_factory, tiny_models) -> Path:
    out = tmp_path_factory.mktemp("moe-model") / "q4"
    args = [f"--{k}={v}" for k, v in SHAPE.items()]
    cmd = [sys.executable, str(ROOT / "bench/moe_model.py"), str(out), "--tokenizer-from"]
    done = subprocess.run([*cmd, str(tiny_models["llama"]), *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert f"wrote {out}: " in done.stdout
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tiny_models) -> Path:
    """mlx-lm's 4-bit conversion of a random bfloat16 qwen3_moe of ``SHAPE``."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install mlx-lm)")
    import mlx_lm

    root = tmp_path_factory.mktemp("moe-convert")
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=SHAPE["vocab"],
        hidden_size=SHAPE["hidden"],
        intermediate_size=SHAPE["intermediate"],
        moe_intermediate_size=SHAPE["expert-intermediate"],
        num_hidden_layers=SHAPE["layers"],
        num_attention_heads=SHAPE["heads"],
        num_key_value_heads=SHAPE["kv-heads"],
        head_dim=SHAPE["head-dim"],
        num_experts=SHAPE["experts"],
        num_experts_per_tok=SHAPE["experts-per-token"],
        norm_topk_prob=True,
        tie_word_embeddings=False,
    )
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    float_model = transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)  # as on the hub
    float_model.save_pretrained(root / "float")
    path = root / "float" / "config.json"  # the keys mlx-lm's qwen3_moe reads beside these
    raw = json.loads(path.read_text())
    raw |= {"num_experts": SHAPE["experts"], "rope_theta": 1000000.0}
    path.write_text(json.dumps(raw))
    for name in TOKENIZER:
        (root / "float" / name).write_bytes((tiny_models["llama"] / name).read_bytes())
    mlx_lm.convert(str(root / "float"), str(root / "q4"), quantize=True, q_bits=4, q_group_size=64)
    return root / "q4"


def headers(folder: Path) -> dict[str, tuple[str, list[int]]]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out = {}
    for shard in set(index["weight_map"].values()):
        header = read_header(folder / shard)
        assert header.pop("__metadata__") == {"format": "mlx"}
        out |= {n: (e["dtype"], e["shape"]) for n, e in header.items()}
    return out


def tensor(folder: Path, name: str) -> np.ndarray:
    """One tensor of the single shard (bf16 as float32)."""
    path = folder / "model.safetensors"
    header = read_header(path)
    e, data = header[name], path.stat().st_size  # the data ends the file
    data -= max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    dtype = {"U32": np.uint32, "BF16": np.uint16}[e["dtype"]]
    a, b = e["data_offsets"]
    raw = np.fromfile(path, np.uint8, b - a, offset=data + a)
    x = raw.view(dtype).reshape(e["shape"])
    return bf16_bits_to_float32(x) if dtype is np.uint16 else x


def test_defaults_are_qwen3_30b_a3b():
    a = moe_model.parser().parse_args(["out", "--tokenizer-from", "tok"])
    plan = moe_model.tensors(moe_model.config(a, {}), a.bits, a.group_size)
    assert sum(math.prod(shape) for _, shape, _ in plan) == 30_532_122_624


@pytest.mark.mlx
def test_layout_is_mlx_lm_convert(generated, converted):
    assert headers(generated) == headers(converted)
    ours, theirs = (json.loads((f / "config.json").read_text()) for f in (generated, converted))
    for key in ("quantization", "quantization_config"):
        assert ours[key] == theirs[key]
    assert ours["quantization"]["model.layers.1.mlp.gate"] == {"group_size": 64, "bits": 8}
    ours, theirs = (
        json.loads((f / "model.safetensors.index.json").read_text()) for f in (generated, converted)
    )
    assert ours == theirs


def test_dequantized_std(generated):
    for module, bits, std in [
        ("model.layers.0.mlp.switch_mlp.down_proj", 4, 0.02),
        ("model.layers.1.self_attn.q_proj", 4, 0.02),
        ("model.layers.0.mlp.gate", 8, 0.05),
    ]:
        parts = [tensor(generated, f"{module}.{p}") for p in ("weight", "scales", "biases")]
        w = dequantize(*(x.reshape(-1, x.shape[-1]) for x in parts), bits, 64)
        assert abs(float(w.std()) / std - 1) < 0.05, module
        assert abs(float(w.mean())) < std / 50, module


@pytest.mark.parametrize("engine", ["torch", pytest.param("mlx", marks=pytest.mark.mlx)])
def test_spill_scores(generated, engine):
    runner = open_runner(load_engine(engine), generated, ring=2)
    (logp,) = runner.score([np.arange(5, 40)], [np.arange(40, 50)])
    assert logp.shape == (10,) and np.isfinite(logp).all() and (logp < 0).all()


@pytest.mark.mlx
def test_mlx_lm_loads(generated):
    mlx_lm = pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install mlx-lm)")
    mx = pytest.importorskip("mlx.core")
    model, _ = mlx_lm.load(str(generated))
    assert model.model.layers[0].mlp.gate.bits == 8
    assert type(model.model.layers[0].mlp.switch_mlp.up_proj).__name__ == "QuantizedSwitchLinear"
    logits = model(mx.array(np.arange(5, 50)[None]))
    assert logits.shape == (1, 45, SHAPE["vocab"]) and bool(mx.isfinite(logits).all())
