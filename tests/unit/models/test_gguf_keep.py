"""``import_gguf(..., keep_quantization=True)``: mapped tensors stored packed, and every one of
them dequantizes to exactly the float import's values; the names, records and refusals around it."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from spill.errors import ModelError
from spill.hashing import file_sha256
from spill.models import gguf_quant, quant
from spill.models.config import load_config
from spill.models.gguf_import import import_gguf
from spill.models.gguf_reader import read_gguf
from spill.models.names import split_quant
from tests.unit.models.test_gguf_import import _write_tiny_gguf

Q = gguf.GGMLQuantizationType


def load_file(path: str) -> dict[str, np.ndarray]:
    """A safetensors file as numpy arrays (bf16 widened to float32, packed words as uint32)."""
    import torch
    from safetensors.torch import load_file as load_torch

    out = {}
    for name, t in load_torch(path).items():
        if t.dtype == torch.uint32:
            out[name] = t.view(torch.int32).numpy().view(np.uint32)
        else:
            out[name] = (t.float() if t.dtype == torch.bfloat16 else t).numpy()
    return out


def _dequantized(folder) -> dict[str, np.ndarray]:
    """Every weight of a folder as float32, packed modules dequantized with spill's numpy code."""
    cfg, tensors = load_config(folder), load_file(str(folder / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        module = name.rsplit(".", 1)[0]
        if name.endswith((".scales", ".biases")):
            continue
        if f"{module}.scales" in tensors:
            bits, group = cfg.quant_spec(module)
            s, b = tensors[f"{module}.scales"], tensors[f"{module}.biases"]
            out[name] = quant.dequantize(t, s, b, bits, group)
        else:
            out[name] = t.astype(np.float32)
    return out


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keep")
    _write_tiny_gguf(tmp / "tiny.gguf")
    floats = import_gguf(tmp / "tiny.gguf", tmp / "float")
    kept = import_gguf(tmp / "tiny.gguf", tmp / "kept", keep_quantization=True)
    return floats, kept


def test_kept_copy_dequantizes_to_the_float_import(tiny_pair):
    floats, kept = tiny_pair
    want, got = _dequantized(floats), _dequantized(kept)
    assert set(got) == set(want)
    for name in want:
        assert np.array_equal(got[name], want[name]), name


def test_kept_copy_is_packed_with_an_mlx_config(tiny_pair):
    _, kept = tiny_pair
    header = load_file(str(kept / "model.safetensors"))
    # k_proj is Q4_1 (and row-permuted), gate Q4_0, o/down/embed Q8_0, up Q5_1 (8-bit)
    k = "model.layers.0.self_attn.k_proj"
    assert header[f"{k}.weight"].dtype == np.uint32 and header[f"{k}.weight"].shape == (32, 8)
    assert header[f"{k}.scales"].shape == (32, 2)
    assert header[f"{k}.scales"].dtype == np.float16  # Q4_1's d and m are fp16 values
    assert "model.layers.0.self_attn.q_proj.scales" not in header  # stored F32 in the GGUF
    q = json.loads((kept / "config.json").read_text())["quantization"]
    assert q["group_size"] == 32 and q["bits"] == 8  # Q8_0 and Q5_1 outnumber the 4-bit ones
    assert q[k] == {"group_size": 32, "bits": 4}
    assert load_config(kept).quant_spec("model.layers.1.mlp.gate_proj") == (4, 32)


def test_kept_copy_records_every_file_hash(tiny_pair):
    _, kept = tiny_pair
    marker = json.loads((kept / "spill-source.json").read_text())
    files = {p.name for p in kept.iterdir() if p.name != "spill-source.json"}
    assert set(marker["files"]) == files
    for name, rec in marker["files"].items():
        assert rec["sha256"] == file_sha256(kept / name) and rec["from"] == "local"
    assert marker["tensors"]["model.layers.0.self_attn.k_proj.weight"]["bits"] == 4
    assert "packed" in marker["dtype_rule"]


def test_second_kept_import_is_byte_identical(tiny_pair, tmp_path):
    _, kept = tiny_pair
    again = import_gguf(kept.parent / "tiny.gguf", tmp_path / "again", keep_quantization=True)
    assert file_sha256(again / "model.safetensors") == file_sha256(kept / "model.safetensors")


def test_unmapped_type_is_dequantized_and_said(tmp_path):
    path = tmp_path / "q2k.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    block, size = gguf.GGML_QUANT_SIZES[Q.Q2_K]
    writer.add_tensor("blk.0.ffn_up.weight", np.zeros((2, size), np.uint8), raw_dtype=Q.Q2_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    file = read_gguf(path)
    (info,) = file.tensors
    said = []
    kept = gguf_quant.kept_tensors(file, info, "x.weight", 0, lambda w, h: w, said.append)
    assert kept is None
    assert said == [
        "blk.0.ffn_up.weight: Q2_K has no exact affine form; stored dequantized (exact)"
    ]
    assert gguf_quant.file_tag(file) == "f"


def test_quantized_names():
    assert split_quant("smollm2:135m@q4_1") == ("smollm2:135m", "q4_1")
    assert split_quant("tiny:llama:1@q4g64") == ("tiny:llama:1", "q4g64")
    assert split_quant("Qwen/Qwen2.5-0.5B-Instruct@main") == (
        "Qwen/Qwen2.5-0.5B-Instruct@main",
        None,
    )
    assert split_quant("smollm2:135m") == ("smollm2:135m", None)


def test_bad_quantization_config_is_refused_in_one_line(tiny_pair, tmp_path):
    _, kept = tiny_pair
    raw = json.loads((kept / "config.json").read_text())
    raw["quantization"] = {"group_size": 32, "bits": 3}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelError, match="3-bit affine") as e:
        load_config(tmp_path)
    assert "\n" not in str(e.value)
