"""``import_gguf(..., keep_quantization=True)``: mapped tensors stored packed, and every one of
them dequantizes to exactly the float import's values; the names, records and refusals around it."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from spill.errors import ModelError
from spill.ground.hashing import file_sha256
from spill.models import quant
from spill.models.config import load_config
from spill.models.gguf import quant as gguf_quant
from spill.models.gguf.importer import import_gguf
from spill.models.gguf.reader import read_gguf
from spill.models.names import split_quant
from tests.unit.models.gguf.test_importer import _write_tiny_gguf

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
    raw["quantization"] = {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelError, match="mxfp4 quantization is not supported"):
        load_config(tmp_path)
    raw["quantization"] = {"group_size": 64, "bits": 4, "mode": "affine", "lm_head": False}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_config(tmp_path).quantization == (("", 4, 64),)  # mlx-lm's own keys


K_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


def _k_blocks(data: np.ndarray, qtype) -> np.ndarray:
    """Random K-quant bytes for ``data``'s rows (gguf cannot quantize these types), each row
    seeded by its own bytes so a row permutation permutes the blocks too; d and dmin sane fp16."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows = []
    for row in np.asarray(data, np.float32).reshape(-1, data.shape[-1]):
        rng = np.random.default_rng(int.from_bytes(row.tobytes()[:8], "little"))
        raw = rng.integers(0, 256, (row.size // block, size), dtype=np.uint8)
        lo, hi = (208, 210) if qtype == Q.Q6_K else (0, 4)
        d = rng.standard_normal((len(raw), (hi - lo) // 2)) * 0.01
        raw[:, lo:hi] = d.astype(np.float16).view(np.uint8)
        rows.append(raw.reshape(-1))
    return np.stack(rows).reshape(*data.shape[:-1], -1)


def test_k_quant_gguf_keeps_exactly_and_computes_the_same(tmp_path, monkeypatch):
    """A tiny llama of hidden 256 whose matrices are Q4_K, Q5_K and Q6_K (q/k permuted): the kept
    copy dequantizes to the float import, and torch computes the same log-probs on both."""
    from spill.engines import resolve
    from spill.engines.base import GenerateParams, LoadOptions, ModelSpec
    from tests.unit.models.gguf import test_importer as kit

    for name, value in dict(H=256, HEADS=4, KV=2, D=64, INTER=512).items():
        monkeypatch.setattr(kit, name, value)
    kinds = {"attn_q": Q.Q4_K, "attn_k": Q.Q6_K, "attn_v": Q.Q5_K, "attn_output": Q.Q4_K}
    kinds |= {"ffn_gate": Q.Q6_K, "ffn_up": Q.Q4_K, "ffn_down": Q.Q5_K}
    for hf, (gname, _) in list(kit._STORE.items()):
        if gname.split(".")[0] in kinds:
            monkeypatch.setitem(kit._STORE, hf, (gname, kinds[gname.split(".")[0]]))
    monkeypatch.setitem(kit._GLOBAL_STORE, "lm_head.weight", ("output.weight", Q.Q6_K))
    real = gguf.quants.quantize
    monkeypatch.setattr(
        gguf.quants, "quantize", lambda d, t: _k_blocks(d, t) if t in K_TYPES else real(d, t)
    )
    kit._write_tiny_gguf(tmp_path / "k.gguf")
    floats = import_gguf(tmp_path / "k.gguf", tmp_path / "float")
    kept = import_gguf(tmp_path / "k.gguf", tmp_path / "kept", keep_quantization=True)
    want, got = _dequantized(floats), _dequantized(kept)
    for name in want:
        assert np.array_equal(got[name], want[name]), name
    cfg = load_config(kept)
    assert cfg.quant_spec("model.layers.0.self_attn.k_proj") == (8, 16)  # Q6_K
    assert cfg.quant_spec("model.layers.0.self_attn.v_proj") == (8, 32)  # Q5_K
    assert cfg.quant_spec("model.layers.0.self_attn.q_proj") == (4, 32)  # Q4_K
    prompts, completions = [np.arange(5, 30, dtype=np.int64)], [np.arange(40, 46, dtype=np.int64)]
    seen = []
    for folder, opts in (
        (floats, {"resident": True}),
        (kept, {"ring": 1}),
        (kept, {"resident": True}),
    ):
        runner = resolve("torch").open(
            ModelSpec(folder, load_config(folder)), LoadOptions(dtype="float32", **opts)
        )
        try:
            (scores,) = runner.score(prompts, completions)
            (gen,) = runner.generate(prompts, GenerateParams(4), [0])
        finally:
            runner.close()
        assert np.isfinite(scores).all() and (scores < 0).all()
        seen.append((scores.view(np.uint32).tolist(), gen.tokens.tolist()))
    assert seen[1] == seen[0] and seen[2] == seen[0]


def test_import_model_names_a_kept_file_by_its_type(tiny_pair, spill_home):
    from spill.models.resolve import import_model

    _, kept = tiny_pair
    said = []
    folder = import_model(str(kept.parent / "tiny.gguf"), progress=said.append)  # the default
    assert folder == spill_home / "models" / "tiny-q8_0"  # Q8_0 is the file's commonest type
    marker = json.loads((folder / "spill-source.json").read_text())
    assert marker["name"] == "tiny@q8_0" and marker["source"] == "gguf"
    assert file_sha256(folder / "model.safetensors") == file_sha256(kept / "model.safetensors")
    assert import_model(str(kept.parent / "tiny.gguf"), keep=True, progress=said.append) == folder
    assert "already exists" in said[-1]
    floats = import_model(str(kept.parent / "tiny.gguf"), keep=False, progress=said.append)
    assert floats == spill_home / "models" / "tiny"  # --dequantize: the float folder, its stem
    assert "quantization" not in json.loads((floats / "config.json").read_text())
