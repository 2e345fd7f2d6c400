"""GGUF files written byte by byte, so a test can make one that no writer would: a value of the
wrong type, a count larger than the file, a tensor offset that wraps around 2^64.

``small_llama()`` is a whole, importable one-layer Llama (hidden 32, 2 heads, random weights);
``write_gguf(path, metadata, tensors)`` writes any metadata and tensor table, with ``raw(type,
bytes)`` for a value spelled out by hand.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

U8, U32, I32, F32, BOOL, STRING, ARRAY, I64 = 0, 4, 5, 6, 7, 8, 9, 11
GGML_F32, GGML_Q8_0 = 0, 8


@dataclass(frozen=True)
class Raw:
    """A metadata value given as its GGUF value type and its encoded bytes."""

    kind: int
    data: bytes


def string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def encode(value) -> tuple[int, bytes]:
    """A Python value as (GGUF value type, bytes): bool, int (u32 or i64), float (f32), str,
    or a list of str or int."""
    if isinstance(value, Raw):
        return value.kind, value.data
    if isinstance(value, bool):
        return BOOL, struct.pack("<?", value)
    if isinstance(value, int):
        return (
            (U32, struct.pack("<I", value))
            if 0 <= value < 2**32
            else (I64, struct.pack("<q", value))
        )
    if isinstance(value, float):
        return F32, struct.pack("<f", value)
    if isinstance(value, str):
        return STRING, string(value)
    if value and isinstance(value[0], str):
        return ARRAY, struct.pack("<IQ", STRING, len(value)) + b"".join(string(s) for s in value)
    return ARRAY, struct.pack("<IQ", U32, len(value)) + struct.pack(f"<{len(value)}I", *value)


def write_gguf(path: Path, metadata: dict, tensors: list[tuple[str, tuple, int, int]], data=b""):
    """``tensors``: (name, numpy shape, ggml type, offset in the data section); ``data`` follows
    the header at 32-byte alignment."""
    out = [b"GGUF", struct.pack("<IQQ", 3, len(tensors), len(metadata))]
    for key, value in metadata.items():
        kind, body = encode(value)
        out += [string(key), struct.pack("<I", kind), body]
    for name, shape, kind, offset in tensors:
        dims = tuple(reversed(shape))
        out += [string(name), struct.pack(f"<I{len(dims)}Q", len(dims), *dims)]
        out += [struct.pack("<IQ", kind, offset)]
    head = b"".join(out)
    head += b"\0" * (-len(head) % 32)
    Path(path).write_bytes(head + data)
    return Path(path)


HIDDEN, HEADS, KV, HEAD_DIM, INTER, VOCAB = 32, 2, 1, 16, 64, 5


def small_metadata(**changes) -> dict:
    """A one-layer Llama's metadata; ``changes`` by key without the ``llama.`` prefix, where a
    value of None drops the key."""
    meta = {
        "general.architecture": "llama",
        "general.name": "small",
        "llama.block_count": 1,
        "llama.context_length": 64,
        "llama.embedding_length": HIDDEN,
        "llama.feed_forward_length": INTER,
        "llama.attention.head_count": HEADS,
        "llama.attention.head_count_kv": KV,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": ["a", "b", "ab", "<s>", "</s>"],
        "tokenizer.ggml.token_type": [1, 1, 1, 3, 3],
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.bos_token_id": 3,
        "tokenizer.ggml.eos_token_id": 4,
    }
    for key, value in changes.items():
        full = key if key.startswith(("general.", "tokenizer.")) else f"llama.{key}"
        if value is None:
            meta.pop(full, None)
        else:
            meta[full] = value
    return meta


def small_tensors() -> list[tuple[str, tuple]]:
    q, kv = HEADS * HEAD_DIM, KV * HEAD_DIM
    out = [("token_embd.weight", (VOCAB, HIDDEN)), ("output_norm.weight", (HIDDEN,))]
    for name, shape in (
        ("attn_norm.weight", (HIDDEN,)),
        ("attn_q.weight", (q, HIDDEN)),
        ("attn_k.weight", (kv, HIDDEN)),
        ("attn_v.weight", (kv, HIDDEN)),
        ("attn_output.weight", (HIDDEN, q)),
        ("ffn_norm.weight", (HIDDEN,)),
        ("ffn_gate.weight", (INTER, HIDDEN)),
        ("ffn_up.weight", (INTER, HIDDEN)),
        ("ffn_down.weight", (HIDDEN, INTER)),
    ):
        out.append((f"blk.0.{name}", shape))
    return out


def small_llama(path: Path, metadata: dict | None = None, seed: int = 0, q8: bool = False) -> Path:
    """A whole one-layer Llama GGUF of random weights (``seed``), importable as it is: float32,
    or with ``q8`` its matrices as Q8_0 (so ``spill models import`` names it ``<stem>@q8_0``)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    table, data = [], b""
    for name, shape in small_tensors():
        w = rng.normal(0, 1, size=shape).astype("<f4")
        if q8 and len(shape) == 2:
            table.append((name, shape, GGML_Q8_0, len(data)))
            data += quantize(w, GGMLQuantizationType.Q8_0).tobytes()
        else:
            table.append((name, shape, GGML_F32, len(data)))
            data += w.tobytes()
        data += b"\0" * (-len(data) % 32)
    return write_gguf(path, small_metadata() if metadata is None else metadata, table, data)
