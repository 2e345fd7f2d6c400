import json

import pytest

from spill.errors import ModelError
from spill.models.tiny import write_tiny
from spill.models.tokenizer import Tokenizer
from spill.models.weights import fingerprint, weight_files


def _bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_same_seed_same_bytes(tmp_path, family):
    a = write_tiny(tmp_path / "a", family, seed=3)
    b = write_tiny(tmp_path / "b", family, seed=3)
    c = write_tiny(tmp_path / "c", family, seed=4)
    assert _bytes(a) == _bytes(b)
    assert _bytes(a)["model.safetensors"] != _bytes(c)["model.safetensors"]
    assert fingerprint(a) == fingerprint(b) != fingerprint(c)


def test_sharded_model_has_index(tmp_path):
    m = write_tiny(tmp_path / "m", "qwen2", seed=1, shards=3)
    files = weight_files(m)
    assert len(files.shards) == 3 and "model.embed_tokens.weight" in files.tensor_shard
    (m / files.shards[1]).unlink()
    with pytest.raises(ModelError, match="missing"):
        weight_files(m)


def test_fingerprint_sees_config_and_headers(tmp_path):
    m = write_tiny(tmp_path / "m", "llama", seed=1)
    before = fingerprint(m)
    cfg = json.loads((m / "config.json").read_text())
    cfg["rope_theta"] = 20000.0
    (m / "config.json").write_text(json.dumps(cfg))
    assert fingerprint(m) != before


def test_tokenizer_roundtrip_and_chat(tiny_models):
    tok = Tokenizer(tiny_models["llama"])
    text = "héllo wörld\n\t  code() {}"
    assert tok.decode(tok.encode(text)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == tok.token_id("<|im_start|>") and tok.token_id("<|im_end|>") in tok.eos_ids
    assert tok.vocab_size == 259


def test_tokenizer_matches_transformers(tiny_models):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(tiny_models["qwen2"]))
    tok = Tokenizer(tiny_models["qwen2"])
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    assert tok.apply_chat_template(msgs) == ref.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )
    for s in ["plain", "ünïcödé ✓", "<|im_start|>user\nx<|im_end|>"]:
        assert tok.encode(s) == ref(s)["input_ids"]
