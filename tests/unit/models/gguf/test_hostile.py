"""Hostile GGUF headers, made here byte by byte: each is refused in one line naming the file,
before anything is sized from it, and nothing is written."""

from __future__ import annotations

import struct
import time
import tracemalloc

import pytest

from spill.errors import ModelError, SpillError
from spill.models.gguf.importer import import_gguf
from spill.models.gguf.reader import MAX_ELEMENTS, Unread, read_gguf
from tests.unit.models.gguf.gguf_bytes import (
    ARRAY,
    GGML_F32,
    STRING,
    U8,
    Raw,
    small_llama,
    small_metadata,
    write_gguf,
)


def _refused(path, tmp_path, says: str) -> str:
    dest = tmp_path / "out"
    with pytest.raises(SpillError) as err:
        import_gguf(path, dest)
    text = str(err.value)
    assert "\n" not in text and str(path) in text and says in text, text
    assert not dest.exists() and not list(tmp_path.glob(".out*"))
    return text


def test_the_hand_made_llama_imports(tmp_path):
    """The base every hostile file below changes one thing of is itself a good model."""
    folder = import_gguf(small_llama(tmp_path / "ok.gguf"), tmp_path / "ok")
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"embedding_length": "abc"}, "'llama.embedding_length' is 'abc', not an integer"),
        ({"attention.layer_norm_rms_epsilon": "x"}, "rms_epsilon' is 'x', not a number"),
        ({"attention.head_count": 0}, "head_count' is 0, not an integer of at least 1"),
        (
            {"attention.head_count": 0, "attention.key_length": 4},
            "head_count' is 0, not an integer of at least 1",
        ),
        ({"attention.head_count_kv": 0}, "head_count_kv' is 0"),
        ({"attention.head_count": 3}, "3 heads do not divide embedding_length 32"),
        (
            {"tokenizer.ggml.tokens": "abc"},
            "'tokenizer.ggml.tokens' is str 'abc', not a list of strs",
        ),
        ({"tokenizer.ggml.tokens": [1, 2, 3, 4, 5]}, "not a list of strs"),
        ({"tokenizer.ggml.merges": [7]}, "'tokenizer.ggml.merges' is list [7], not a list of strs"),
        ({"tokenizer.ggml.token_type": ["x"] * 5}, "not a list of ints"),
        ({"tokenizer.ggml.merges": ["x y"]}, "Token `x` out of vocabulary"),
        ({"tokenizer.ggml.bos_token_id": "3"}, "'tokenizer.ggml.bos_token_id' is '3'"),
        ({"tokenizer.ggml.add_bos_token": 1}, "is 1, not true or false"),
        ({"general.architecture": 5}, "'general.architecture' is 5, not a string"),
        ({"block_count": 100_000_000}, "block_count 100000000 but the file holds tensors of 1"),
        ({"block_count": 2}, "block_count 2 but the file holds tensors of 1 blocks"),
        ({"context_length": Raw(ARRAY, struct.pack("<IQ", U8, 3) + b"abc")}, "an array of 3"),
    ],
)
def test_metadata_of_the_wrong_type_or_size_is_one_line(tmp_path, changes, says):
    path = small_llama(tmp_path / "bad.gguf", small_metadata(**changes))
    start = time.perf_counter()
    _refused(path, tmp_path, says)
    assert time.perf_counter() - start < 10


def _table(offset: int = 0, dims=(5, 8), kind=GGML_F32):
    return [("token_embd.weight", dims, kind, offset)]


@pytest.mark.parametrize(
    ("offset", "says"),
    [
        (2**64 - 32, "past the end of the file"),  # start + offset wraps to 0 in 64 bits
        (2**63, "past the end of the file"),
        (64, "past the end of the file"),  # in range, but the bytes run past the end
    ],
)
def test_a_tensor_offset_outside_the_file_is_refused(tmp_path, offset, says):
    path = write_gguf(tmp_path / "wrap.gguf", small_metadata(), _table(offset), b"\0" * 160)
    with pytest.raises(ModelError, match=says) as err:
        read_gguf(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize(
    ("dims", "kind", "says"),
    [
        ((2**62, 2**62), GGML_F32, "past the end of the file"),  # the product is 2^124 bytes
        ((5, 0), GGML_F32, "has shape"),
        ((5, 7), 2, "Q4_0 blocks of 32"),  # a row that is not whole blocks
        ((5, 8), 1234, "unknown ggml type 1234"),
        ((1, 1, 1, 1, 1), GGML_F32, "5 dimensions"),
    ],
)
def test_a_tensor_record_that_cannot_be_is_refused(tmp_path, dims, kind, says):
    path = write_gguf(tmp_path / "bad.gguf", small_metadata(), _table(0, dims, kind), b"\0" * 160)
    with pytest.raises(SpillError, match=says) as err:
        read_gguf(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def _header(n_tensors: int, n_kv: int, body: bytes = b"") -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + body + b"\0" * 64


def _key(name: str, kind: int, value: bytes) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode() + struct.pack("<I", kind) + value


@pytest.mark.parametrize(
    "data",
    [
        _header(2**63, 1),  # counts larger than the file could hold
        _header(0, 2**40),
        _header(0, 1, struct.pack("<Q", 2**62)),  # a key of 2^62 bytes
        _header(0, 1, _key("x", STRING, struct.pack("<Q", 2**50))),
        _header(0, 1, _key("x", ARRAY, struct.pack("<IQ", U8, 2**60))),
        _header(0, 1, _key("x", ARRAY, struct.pack("<IQ", STRING, 2**40))),
        _header(0, 1, _key("x", 99, b"")),
        _header(0, 2, _key("x", U8, b"\1") + _key("x", U8, b"\1")),  # a key twice
    ],
)
def test_counts_and_lengths_are_checked_before_anything_is_allocated(tmp_path, data):
    path = tmp_path / "bomb.gguf"
    path.write_bytes(data)
    tracemalloc.start()
    try:
        with pytest.raises(ModelError) as err:
            read_gguf(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "\n" not in str(err.value) and str(path) in str(err.value)
    assert peak < 8 << 20, peak


def test_arrays_are_skipped_unread_or_refused_past_the_cap(tmp_path):
    """2M numbers under a key nobody reads: skipped in one seek, never made into objects; 2M
    strings (any key) or 2M token types: over the cap, refused in one line before reading them."""
    junk = Raw(ARRAY, struct.pack("<IQ", U8, 2_000_000) + b"\1" * 2_000_000)
    path = small_llama(tmp_path / "junk.gguf", small_metadata(**{"general.junk": junk}))
    tracemalloc.start()
    try:
        file = read_gguf(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert file.metadata["general.junk"] == Unread(2_000_000) and len(file.tensors) == 11
    assert peak < 8 << 20, peak
    many = MAX_ELEMENTS + 1
    strings = Raw(ARRAY, struct.pack("<IQ", STRING, many) + b"\1\0\0\0\0\0\0\0z" * many)
    types = Raw(ARRAY, struct.pack("<IQ", U8, many) + b"\1" * many)
    for key, value, says in (
        ("general.junk", strings, f"{many} strings, more than spill reads"),
        ("tokenizer.ggml.token_type", types, f"{many} elements, more than spill reads"),
    ):
        path = small_llama(tmp_path / "big.gguf", small_metadata(**{key: value}))
        _refused(path, tmp_path, says)
