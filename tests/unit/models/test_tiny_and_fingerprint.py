import json

import pytest

from spill.errors import ModelError
from spill.models.sources.tiny import write_tiny
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


@pytest.mark.parametrize(
    ("template", "says"),
    [
        ("{% for m in messages %}{{ m.content }", "unexpected '}'"),  # does not compile
        ("{{ raise_exception('system turns only') }}", "system turns only"),  # refuses at render
    ],
)
def test_a_bad_chat_template_is_one_line_each_time(tmp_path, template, says):
    """The template is compiled once per tokenizer; a template that fails to compile or refuses
    a chat is a TokenizerError naming the folder, on every call, never a Jinja traceback."""
    from spill.errors import TokenizerError

    folder = write_tiny(tmp_path / "m", "llama", seed=1)
    (folder / "chat_template.jinja").write_text(template)
    tok = Tokenizer(folder)
    for _ in range(2):
        with pytest.raises(TokenizerError, match=f"chat template failed: .*{says}") as e:
            tok.apply_chat_template([{"role": "user", "content": "hi"}])
        assert str(folder) in str(e.value) and "\n" not in str(e.value)


def test_chat_rendering_is_the_same_on_every_call(tiny_models):
    tok = Tokenizer(tiny_models["qwen2"])
    chats = [[{"role": "user", "content": f"row {i}"}] for i in range(3)]
    first = [
        tok.apply_chat_template(c, add_generation_prompt=i % 2 == 0) for i, c in enumerate(chats)
    ]
    again = [
        tok.apply_chat_template(c, add_generation_prompt=i % 2 == 0) for i, c in enumerate(chats)
    ]
    assert (
        first == again and first[0].endswith("assistant\n") and not first[1].endswith("assistant\n")
    )


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
