"""Gemma 3 from llama.cpp's ``gemma3`` GGUF (issue 37). A Gemma3ForCausalLM made by transformers
is written with ``gguf.GGUFWriter`` as llama.cpp's ``convert_hf_to_gguf`` writes one: tensor
names from gguf-py's own map for ``MODEL_ARCH.GEMMA3``, every ``*norm.weight`` as 1 + w, no q/k
row interleave, the window, head size and global rotary base as keys and nothing else (the
sliding pattern, the local base, the query scale and the embedding scale are llama.cpp's code).
spill imports it to a ``gemma3_text`` folder whose config is the HF folder's and which scores
as the HF folder does, in spill and in transformers; kept quantized it scores as its float
import; rope scaling is refused."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from spill.errors import UnsupportedModel
from spill.models.config import load_config
from spill.models.gguf.arch import ARCHES
from spill.models.gguf.importer import import_gguf
from spill.store.safetensors_io import read_header
from tests.unit.engines import hf_families
from tests.unit.engines.kit import open_runner

torch = pytest.importorskip("torch")
Q = gguf.GGMLQuantizationType
# six layers: five slide (a window of 6, shorter than the rows), the sixth attends to all keys
# on its own rotary base; query_pre_attn_scalar is head_dim, as llama.cpp infers it
SPEC = (
    "Gemma3",
    dict(num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=32, sliding_window=6),
)
ROWS = ([np.arange(3, 33), np.arange(40, 45)], [np.arange(60, 75), np.arange(100, 110)])


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, tiny_models) -> Path:
    folder = tmp_path_factory.mktemp("gemma3") / "hf"
    return hf_families.make("gemma3-llama-cpp", folder, tiny_models["llama"], spec=SPEC)


def _write_llama_cpp_gemma3(
    folder: Path, path: Path, matrices=Q.F32, rope_scaling=None, window=True
) -> None:
    """The GGUF llama.cpp's converter writes for ``folder`` (float32 weights, its byte-level
    tokenizer padded to the embedding's rows); the MLP matrices whose rows split into 32-value blocks stored as ``matrices``."""
    from safetensors.numpy import load_file

    raw = json.loads((folder / "config.json").read_text())
    layers = raw["num_hidden_layers"]
    w = writer = gguf.GGUFWriter(path, "gemma3")
    w.add_context_length(raw["max_position_embeddings"])
    w.add_embedding_length(raw["hidden_size"])
    w.add_block_count(layers)
    w.add_feed_forward_length(raw["intermediate_size"])
    w.add_head_count(raw["num_attention_heads"])
    w.add_head_count_kv(raw["num_key_value_heads"])
    w.add_layer_norm_rms_eps(raw["rms_norm_eps"])
    w.add_key_length(raw["head_dim"])
    w.add_value_length(raw["head_dim"])
    w.add_rope_freq_base(raw["rope_parameters"]["full_attention"]["rope_theta"])
    if window:
        w.add_sliding_window(raw["sliding_window"])
    if rope_scaling:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope_scaling)
    tok = json.loads((folder / "tokenizer.json").read_text())
    tokens = sorted(tok["model"]["vocab"], key=tok["model"]["vocab"].get)
    tokens += [t["content"] for t in tok["added_tokens"]]
    types = [1] * len(tokens) + [5] * (raw["vocab_size"] - len(tokens))  # normal, unused
    tokens += [f"[PAD{i}]" for i in range(len(tokens), raw["vocab_size"])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_bos_token_id(raw["bos_token_id"])
    w.add_eos_token_id(raw["eos_token_id"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, layers)
    for name, t in load_file(str(folder / "model.safetensors")).items():
        gname = names.get_name(name, try_suffixes=(".weight",))
        if name.endswith("norm.weight"):
            t = t + np.float32(1)  # Gemma3RMSNorm's (1 + w), as llama.cpp multiplies
        if ".mlp." in name and matrices != Q.F32 and t.shape[-1] % 32 == 0:
            writer.add_tensor(gname, gguf.quants.quantize(t, matrices), raw_dtype=matrices)
        else:
            writer.add_tensor(gname, t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _scores(folder: Path) -> list[np.ndarray]:
    from tests.unit.engines.kit import load_engine

    runner = open_runner(load_engine("torch"), folder, dtype="float32")
    try:
        return runner.score(*ROWS)
    finally:
        runner.close()


def test_a_llama_cpp_gemma3_gguf_imports_as_the_hf_folder_it_came_from(hf_folder, tmp_path):
    _write_llama_cpp_gemma3(hf_folder, tmp_path / "g.gguf")
    back = import_gguf(tmp_path / "g.gguf", tmp_path / "back")
    config = json.loads((back / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["query_pre_attn_scalar"] == 32
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    want, got = load_config(hf_folder).to_dict(), load_config(back).to_dict()
    assert got == want  # window, layers, both rotary bases, query and embedding scales, tied head
    assert got["windowed"] == (0, 1, 2, 3, 4) and got["norm_offset"] == 1.0

    # the imported norms are the stored 1 + w less 1: spill's 1 + w is that stored value exactly
    from safetensors.numpy import load_file

    hf, ours = (
        load_file(str(hf_folder / "model.safetensors")),
        load_file(str(back / "model.safetensors")),
    )
    assert set(ours) == set(hf)
    one = np.float32(1)
    for name, t in hf.items():
        mine = ours[name].astype(np.float32)
        same = np.array_equal(one + mine, one + t) if "norm" in name else np.array_equal(mine, t)
        assert same, name
    for ref, mine in zip(_scores(hf_folder), _scores(back), strict=True):
        assert np.array_equal(ref, mine)

    # transformers reads the imported config as it reads the original
    def hf_scores(folder: Path) -> np.ndarray:
        model = hf_families.load(folder)
        ids = torch.tensor(np.concatenate([ROWS[0][0], ROWS[1][0]]))[None]
        with torch.no_grad():
            return torch.log_softmax(model(ids).logits.double(), -1)[0].numpy()

    assert np.abs(hf_scores(back) - hf_scores(hf_folder)).max() <= 1e-5


def test_a_quantized_gemma3_gguf_kept_packed_scores_as_its_float_import(hf_folder, tmp_path):
    _write_llama_cpp_gemma3(hf_folder, tmp_path / "q.gguf", matrices=Q.Q8_0)
    kept = import_gguf(tmp_path / "q.gguf", tmp_path / "kept", keep_quantization=True)
    floats = import_gguf(tmp_path / "q.gguf", tmp_path / "floats")
    assert json.loads((kept / "config.json").read_text())["quantization"]["bits"] == 8
    packed = read_header(kept / "model.safetensors")
    assert "model.layers.5.mlp.up_proj.scales" in packed and "model.norm.weight" in packed
    for a, b in zip(_scores(kept), _scores(floats), strict=True):
        assert np.abs(a - b).max() <= 1e-5


def test_a_gemma3_gguf_without_a_window_imports_with_every_layer_full(hf_folder, tmp_path):
    """llama.cpp runs such a file without sliding layers: every layer on the global base."""
    _write_llama_cpp_gemma3(hf_folder, tmp_path / "w.gguf", window=False)
    back = import_gguf(tmp_path / "w.gguf", tmp_path / "w")
    assert json.loads((back / "config.json").read_text())["layer_types"] == ["full_attention"] * 6
    assert load_config(back).windowed == ()


def test_a_gemma3_gguf_with_rope_scaling_is_refused(hf_folder, tmp_path):
    _write_llama_cpp_gemma3(hf_folder, tmp_path / "s.gguf", rope_scaling=8.0)
    with pytest.raises(UnsupportedModel, match="GGUF rope scaling is not supported"):
        import_gguf(tmp_path / "s.gguf", tmp_path / "s")
    assert not (tmp_path / "s").exists()


def test_llama_cpps_query_scale_is_head_dims_but_the_27bs():
    """llama.cpp scales queries by head_dim ** -0.5, except at 62 blocks (Gemma 3 27B: hidden
    5376 over 32 heads, the 168 of its config.json)."""
    arch = ARCHES["gemma3"]
    assert arch.query_pre_attn_scalar(1152, 4, 256, 26) == 256  # Gemma 3 1B
    assert arch.query_pre_attn_scalar(5376, 32, 128, 62) == 168  # Gemma 3 27B
    assert ARCHES["qwen3"].query_pre_attn_scalar(1024, 16, 128, 28) is None
