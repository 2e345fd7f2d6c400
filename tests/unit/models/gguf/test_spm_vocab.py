"""Sentencepiece vocabularies in GGUF both ways (issue 37): a tiny Gemma 3 (and a Llama 2 style
Llama) whose ``tokenizer.json`` is sentencepiece's BPE as transformers converts one (byte
fallback, ``<0x00>``..``<0xFF>``, spaces as "▁", every split of a token into two tokens a merge,
in vocabulary order; trained here by ``tokenizers`` on text with runs of spaces, digits and
accents) is exported as llama.cpp's ``llama`` vocabulary, and the GGUF's tokenizer, imported by
spill, read by transformers' GGUF loader and by llama.cpp itself, encodes every text as the
original ``tokenizer.json`` does; tokens, scores and types survive an import and a second export
exactly; a hub-style file without merges imports to the same encodings; a Unigram tokenizer and
one whose spaces are not "▁" are refused in one line."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from spill.errors import UnsupportedModel
from spill.jobs.export.gguf import read_tokenizer, write
from spill.models.config import load_config
from spill.models.gguf import spm
from spill.models.gguf.importer import import_gguf
from spill.models.gguf.reader import read_gguf, tokenizer_json
from tests.unit.engines import hf_families

tokenizers = pytest.importorskip("tokenizers")
SPACE = spm.SPACE
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
TURNS = ["<start_of_turn>", "<end_of_turn>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps.",
    "Question 5: what is 5 plus 8? The answer is 13, and 1234 + 5678 = 6912.",
    "    indented code  with   several    spaces\tand tabs\n\nnew lines",
    "café au lait, crème brûlée, résumé; naïve élan",
    "the theory of the thermal theme: there, these, those, then",
    "def add(a, b):\n    return a + b\n",
] * 20
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Question 11: what is 11 plus 14? 25.",
    "a  b   c    d     e      f",
    "    leading spaces and trailing   ",
    " one leading space",
    "café é 日本 🙂 naïve",
    "digits 0123456789 and 3.14159",
    "tabs\tand\nnew\n\nlines\r\n",
    "the theory there these those thermal theme then",
    "def add(a, b):\n    return a + b\n",
    "",
    " ",
    "\u2581 a literal marker",
]
_rng = random.Random(0)
_WORDS = " ".join(CORPUS[:6]).replace("\n", " ").split(" ")  # "" too: runs of spaces
MANY = [" ".join(_rng.choice(_WORDS) for _ in range(_rng.randint(1, 12))) for _ in range(300)]
SPEC = dict(num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=32, sliding_window=6)
IDS = dict(pad_token_id=0, eos_token_id=1, bos_token_id=2)


def _sentencepiece_bpe(prefix: bool):
    """sentencepiece's BPE as ``tokenizer.json`` holds it: specials, the 256 byte tokens, the
    trained pieces; merges every split of a piece into two pieces, by the piece's id; Gemma's
    normalizer and a user-defined "▁▁▁▁" (or Llama 2's normalizer, with ``prefix``, and no
    user-defined token: llama.cpp puts a "▁" after one there), two control tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, trainers

    learner = Tokenizer(models.BPE())
    learner.normalizer = normalizers.Replace(" ", SPACE)
    learner.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, show_progress=False))
    # no piece across the user-defined "▁▁▁▁" (sentencepiece's trainer learns none)
    pieces = sorted(learner.get_vocab(), key=learner.get_vocab().get)
    pieces = [t for t in pieces if prefix or SPACE * 4 not in t or t == SPACE * 4]
    vocab = {t: i for i, t in enumerate(SPECIALS + spm.BYTES + pieces)}
    known, merges = set(pieces), []
    for t in pieces:
        splits = [(t[:k], t[k:]) for k in range(1, len(t)) if t[:k] in known and t[k:] in known]
        merges += sorted(splits, key=lambda s: (vocab[s[0]], vocab[s[1]]))
    bpe = models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    tok = Tokenizer(bpe)
    spaces = normalizers.Replace(" ", SPACE)
    tok.normalizer = (
        normalizers.Sequence([normalizers.Prepend(SPACE), spaces]) if prefix else spaces
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in TURNS])
    if not prefix:
        tok.add_tokens([AddedToken(SPACE * 4, normalized=True)])
    assert len(merges) > 200 and SPACE * 4 in vocab  # a trained piece, made user-defined
    return tok


def _model(tmp_path: Path, tiny: Path, family: str, prefix: bool) -> Path:
    """A tiny random ``family`` model whose vocabulary is ``_sentencepiece_bpe``'s."""
    tok = _sentencepiece_bpe(prefix)
    size = tok.get_vocab_size()
    extra = (SPEC if family == "Gemma3" else dict(num_hidden_layers=2)) | IDS | {"vocab_size": size}
    folder = hf_families.make("x", tmp_path / "hf", tiny, spec=(family, extra))
    tok.save(str(folder / "tokenizer.json"))
    config = {"add_bos_token": True, "add_eos_token": False, "chat_template": "{{ messages }}"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").unlink(missing_ok=True)
    return folder


def _export(folder: Path, dest: Path) -> Path:
    """``write`` as ``spill export --format gguf --dtype f32`` calls it, with an empty adapter."""
    dest.mkdir()
    inputs = SimpleNamespace(
        adapter=SimpleNamespace(params={}, lora=SimpleNamespace(scale=1.0)),
        adapter_dir=folder,
        base_name=folder.name,
        base_folder=folder,
        config=load_config(folder),
        raw_config=json.loads((folder / "config.json").read_text()),
        quantization=None,
    )
    write(inputs, dest, "f32", None, lambda _: None)
    return dest / "model-f32.gguf"


def _encodings(tok, texts=TEXTS) -> list[list[int]]:
    return [tok.encode(t, add_special_tokens=False).ids for t in texts]


@pytest.fixture(scope="module", params=["Gemma3", "Llama"])
def exported(request, tmp_path_factory, tiny_models):
    """(the HF folder, its GGUF, the original tokenizer) for Gemma 3 (no "▁" before the text)
    and a Llama 2 style Llama (a "▁" before it)."""
    tmp = tmp_path_factory.mktemp(request.param)
    folder = _model(tmp, tiny_models["llama"], request.param, prefix=request.param == "Llama")
    gguf = _export(folder, tmp / "gguf")
    return folder, gguf, tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))


def test_the_gguf_holds_llama_cpps_sentencepiece_vocabulary(exported):
    folder, gguf, original = exported
    meta = read_gguf(gguf).metadata
    doc = json.loads((folder / "tokenizer.json").read_text())
    merges = [tuple(m) for m in doc["model"]["merges"]]
    assert meta["tokenizer.ggml.model"] == "llama" and meta["tokenizer.ggml.pre"] == "default"
    assert meta["tokenizer.ggml.add_space_prefix"] is (meta["general.architecture"] == "llama")
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    scores = meta["tokenizer.ggml.scores"]
    vocab = original.get_vocab()
    assert len(tokens) == len(vocab) == len(types) == len(scores)
    want = sorted(vocab, key=vocab.get)
    kinds = {i: 3 for t, i in vocab.items() if t in SPECIALS + TURNS}
    kinds |= {vocab[b]: 6 for b in spm.BYTES}
    if not meta["tokenizer.ggml.add_space_prefix"]:
        user = vocab[SPACE * 4]
        want[user] = "    "  # user-defined spaces as llama.cpp's converter writes them
        kinds[user] = 4
    assert tokens == want
    assert types == [kinds.get(i, 1) for i in range(len(tokens))]
    assert meta["tokenizer.ggml.merges"] == [f"{a} {b}" for a, b in merges]
    first = {}
    for rank, (a, b) in enumerate(merges):
        first.setdefault(a + b, -float(rank))
    floor = -float(len(merges))
    assert scores == [first.get(t, floor) if types[i] == 1 else floor for i, t in enumerate(want)]
    assert scores[vocab["T"]] == floor and max(scores) == 0.0 and len(set(scores)) > 200
    ids = [meta[f"tokenizer.ggml.{k}_token_id"] for k in ("bos", "eos", "padding", "unknown")]
    assert ids == [2, 1, 0, 3]
    assert meta["tokenizer.ggml.add_bos_token"] is True
    assert meta["tokenizer.ggml.add_eos_token"] is False
    assert meta["tokenizer.chat_template"] == "{{ messages }}"


def test_spills_import_encodes_as_the_original(exported, tmp_path):
    folder, gguf, original = exported
    back = import_gguf(gguf, tmp_path / "back")
    mine = tokenizers.Tokenizer.from_file(str(back / "tokenizer.json"))
    want = _encodings(original)
    assert _encodings(mine) == want
    assert _encodings(mine, MANY) == _encodings(original, MANY)
    assert sum(map(len, want)) > 150
    bytes_used = {i for ids in want for i in ids if 4 <= i < 260}
    assert len(bytes_used) >= 8  # 日本 and 🙂 fell back to bytes
    assert mine.encode("hi").ids[0] == 2  # <bos>, as add_bos_token says
    assert [mine.decode(ids) for ids in want] == [original.decode(ids) for ids in want]
    turn = "<start_of_turn>user\nhi<end_of_turn>"
    assert mine.encode(turn, add_special_tokens=False).ids == original.encode(turn).ids


def test_tokens_scores_and_types_survive_an_import_and_a_second_export(exported, tmp_path):
    folder, gguf, _ = exported
    back = import_gguf(gguf, tmp_path / "back")
    again = _export(back, tmp_path / "again")
    one, two = read_gguf(gguf).metadata, read_gguf(again).metadata
    for key in ("tokens", "scores", "token_type", "merges", "add_space_prefix"):
        assert one[f"tokenizer.ggml.{key}"] == two[f"tokenizer.ggml.{key}"], key


def test_a_file_without_merges_imports_to_the_same_encodings(exported):
    """As llama.cpp's converter writes it (the hub's files): merges derived from the vocabulary,
    by file position for Gemma and by score for the others, give the original's encodings."""
    folder, gguf, original = exported
    meta = dict(read_gguf(gguf).metadata)
    del meta["tokenizer.ggml.merges"]
    config = {"add_bos_token": False, "add_eos_token": False, "bos_token": None, "eos_token": None}
    derived = tokenizers.Tokenizer.from_str(tokenizer_json(meta, config))
    assert _encodings(derived) == _encodings(original)
    meta["general.architecture"] = "llama"  # by score: the same order here
    derived = tokenizers.Tokenizer.from_str(tokenizer_json(meta, config))
    assert _encodings(derived) == _encodings(original)


def test_transformers_gguf_loader_encodes_as_the_original(exported):
    """Where "▁" goes before the text, texts that begin with a space or "▁" aside: transformers
    puts it there with a Metaspace, which adds none before a "▁" (llama.cpp and a Prepend do)."""
    transformers = pytest.importorskip("transformers")
    folder, gguf, original = exported
    theirs = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    prefix = read_gguf(gguf).metadata["tokenizer.ggml.add_space_prefix"]
    texts = [t for t in TEXTS if not (prefix and t.startswith((" ", SPACE)))]
    assert len(texts) >= len(TEXTS) - 4
    got = [theirs.encode(t, add_special_tokens=False) for t in texts]
    assert got == _encodings(original, texts)


def _flat_scores(gguf: Path, dest: Path) -> Path:
    """``gguf``'s vocabulary alone with -1000 for every score, as gguf-py's ``LlamaHfVocab``
    writes a ``tokenizer.json`` without a ``tokenizer.model``."""
    import gguf as gguf_py

    meta = read_gguf(gguf).metadata
    w = gguf_py.GGUFWriter(dest, meta["general.architecture"])
    w.add_block_count(1)
    w.add_tokenizer_model("llama")
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_scores([-1000.0] * len(meta["tokenizer.ggml.tokens"]))
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_add_space_prefix(meta["tokenizer.ggml.add_space_prefix"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return dest


@pytest.mark.slow  # llama-cpp-python builds from its sdist; PYTHONPATH=/tmp/llpath where built
def test_llama_cpp_tokenizes_as_the_original(exported, tmp_path):
    """Every text as the original (the scores matter: with llama.cpp's converter's -1000 for
    every token, about half of the 300 word strings come out otherwise)."""
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed (it builds from its sdist)"
    )
    folder, gguf, original = exported
    llm = llama_cpp.Llama(model_path=str(gguf), vocab_only=True, verbose=False)
    want = _encodings(original, TEXTS + MANY)
    got = [llm.tokenize(t.encode(), add_bos=False, special=False) for t in TEXTS + MANY]
    for text, g, w in zip(TEXTS + MANY, got, want, strict=True):
        assert g == w, (text, g, w)
    turn = "<start_of_turn>user\nhi<end_of_turn>"
    assert llm.tokenize(turn.encode(), add_bos=False, special=True) == original.encode(turn).ids
    flat = _flat_scores(gguf, tmp_path / "flat.gguf")
    flat = llama_cpp.Llama(model_path=str(flat), vocab_only=True, verbose=False)
    same = sum(
        flat.tokenize(t.encode(), add_bos=False, special=False) == w
        for t, w in zip(MANY, want[len(TEXTS) :], strict=True)
    )
    print(f"\n{len(got)} texts, {sum(map(len, want))} tokens as llama.cpp's; flat scores: {same}")
    assert same < 0.8 * len(MANY)


def _refused(tmp_path: Path, doc: dict) -> str:
    (tmp_path / "tokenizer.json").write_text(json.dumps(doc))
    with pytest.raises(UnsupportedModel) as err:
        read_tokenizer(SimpleNamespace(base_folder=tmp_path))
    assert "\n" not in str(err.value) and "export --format hf" in str(err.value)
    return str(err.value)


def test_a_unigram_and_a_byte_fallback_bpe_without_sentencepiece_spaces_are_refused(tmp_path):
    from tokenizers import Tokenizer, models

    unigram = Tokenizer(models.Unigram([("<unk>", 0.0), ("a", -1.0)], 0))
    assert "a Unigram tokenizer" in _refused(tmp_path, json.loads(unigram.to_str()))
    doc = json.loads(_sentencepiece_bpe(prefix=False).to_str())
    doc["normalizer"] = None
    said = _refused(tmp_path, doc)
    assert "does not write spaces as sentencepiece's" in said
    meta = {"type": "Metaspace", "replacement": SPACE, "prepend_scheme": "always", "split": True}
    doc["pre_tokenizer"] = meta
    assert "pre-tokenizer Metaspace" in _refused(tmp_path, doc)
    doc["pre_tokenizer"] = meta | {"split": False}
    assert spm.space_prefix(doc, "t") is True  # Metaspace that prepends and does not split
    del doc["model"]["vocab"]["<0x0A>"]
    assert "without the byte token <0x0A>" in _refused(tmp_path, doc)
