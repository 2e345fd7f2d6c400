"""A small GGUF reader: the key/value metadata and the tensor table, then one tensor at a time.

``gguf.GGUFReader`` builds a numpy view per string of every string array (49k tokens, 49k merges
for SmolLM2) and takes seconds; parsing the header here with ``struct`` takes a tenth of that.
Tensor bytes are read per tensor with ``pread`` and dequantized by ``gguf.quants.dequantize``, so
memory stays at one tensor while reading. Only little-endian GGUF v2/v3 files are accepted.

``tokenizer_json`` rebuilds the file's byte-level BPE tokenizer with ``tokenizers`` alone: tokens
and merges as stored, control tokens added as special, user-defined ones as plain added tokens,
and BOS/EOS added on encode only where the file's flags say so. Token strings are kept as stored
(transformers respells those outside the byte alphabet and then cannot match them whole).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from spill.errors import ModelError, UnsupportedModel

# byte-level pre-tokenizers by tokenizer.ggml.pre: None is GPT-2's regex inside ByteLevel
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {"gpt2": None, "smollm": None, "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types

MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# GGUF value type -> struct code (8 is a string, 9 an array)
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_NUMPY = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
# Types gguf.quants dequantizes exactly as ggml does; others are refused before any work.
SUPPORTED = tuple(
    GGMLQuantizationType[n]
    for n in "F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K".split()
)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: (out, in) for a matrix; GGUF stores it reversed
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    size: int
    version: int
    metadata: dict
    tensors: tuple[TensorInfo, ...]

    def check_supported(self, info: TensorInfo) -> None:
        if info.qtype not in SUPPORTED:
            raise UnsupportedModel(
                f"{self.path.name}: tensor {info.name} is stored as {info.qtype.name}; spill imports "
                f"{'/'.join(t.name for t in SUPPORTED)} GGUFs, so pick another quantization of the model"
            )

    def read(self, info: TensorInfo) -> np.ndarray:
        """The tensor dequantized to float32, in numpy shape order."""
        self.check_supported(info)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            raw = os.pread(fd, info.nbytes, info.offset)
        finally:
            os.close(fd)
        if len(raw) != info.nbytes:
            raise ModelError(
                f"{self.path}: truncated GGUF (tensor {info.name} is cut short); fetch it again"
            )
        block, size = GGML_QUANT_SIZES[info.qtype]
        rows = np.frombuffer(raw, dtype=np.uint8).reshape(
            *info.shape[:-1], info.shape[-1] // block * size
        )
        if (
            info.qtype == GGMLQuantizationType.BF16
        ):  # gguf.quants reads BF16 as int16: widen the bits
            return (rows.view("<u2").astype(np.uint32) << 16).view(np.float32)
        out = dequantize(rows, info.qtype)
        assert out.dtype == np.float32 and out.shape == info.shape, (
            info.name,
            out.dtype,
            out.shape,
        )
        return out


class _Cursor:
    """Sequential little-endian reads over a buffer; any overrun is a truncated file."""

    def __init__(self, buf):  # bytes or mmap: slicing either copies, so nothing stays exported
        self.buf, self.pos = buf, 0

    def unpack(self, code: str):
        (value,) = struct.unpack_from("<" + code, self.buf, self.pos)
        self.pos += struct.calcsize(code)
        return value

    def string(self) -> str:
        n = self.unpack("Q")
        raw = self.buf[self.pos : self.pos + n]
        if len(raw) != n:
            raise struct.error("string past the end")
        self.pos += n
        return raw.decode("utf-8")

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, n = self.unpack("I"), self.unpack("Q")
            if itype == _STRING:
                return [self.string() for _ in range(n)]
            if itype in _NUMPY:
                width = np.dtype(_NUMPY[itype]).itemsize
                raw = self.buf[self.pos : self.pos + n * width]
                if len(raw) != n * width:
                    raise struct.error("array past the end")
                self.pos += n * width
                return np.frombuffer(raw, dtype=_NUMPY[itype]).tolist()
            if itype == 7:  # bool
                return [self.unpack("?") for _ in range(n)]
            return [self.value(itype) for _ in range(n)]  # nested arrays
        if vtype not in _SCALARS:
            raise ValueError(f"unknown value type {vtype}")
        return self.unpack(_SCALARS[vtype])


def _header(path: Path, buf, size: int) -> GGUFFile:
    cur = _Cursor(buf)
    if buf[:4] != MAGIC:
        raise ModelError(f"{path}: not a GGUF file (no GGUF magic); give a .gguf model file")
    version = cur.unpack("4xI")
    if version not in (2, 3):
        what = "big-endian" if version & 0xFFFF == 0 else f"version {version}"
        raise UnsupportedModel(
            f"{path}: {what} GGUF is not supported; re-convert it with a current llama.cpp"
        )
    n_tensors, n_kv = cur.unpack("Q"), cur.unpack("Q")
    if n_tensors > size or n_kv > size:
        raise ModelError(f"{path}: corrupt GGUF header; fetch the file again")
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("I"))
    table = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.unpack("Q") for _ in range(cur.unpack("I"))]
        table.append((name, tuple(reversed(dims)), cur.unpack("I"), cur.unpack("Q")))
    align = int(metadata.get("general.alignment", 32))
    start = -(-cur.pos // align) * align
    tensors = []
    for name, shape, code, rel in table:
        try:
            qtype = GGMLQuantizationType(code)
        except ValueError:
            raise UnsupportedModel(
                f"{path}: tensor {name} has unknown ggml type {code}; re-convert it"
            ) from None
        block, tsize = GGML_QUANT_SIZES[qtype]
        if not shape or shape[-1] % block:
            raise ModelError(
                f"{path}: tensor {name} has shape {shape} that {qtype.name} cannot hold"
            )
        nbytes = int(np.prod(shape, dtype=np.int64)) // block * tsize
        if start + rel + nbytes > size:
            raise ModelError(
                f"{path}: truncated GGUF ({size} bytes, tensor {name} needs {start + rel + nbytes}); fetch it again"
            )
        tensors.append(TensorInfo(name, shape, qtype, start + rel, nbytes))
    return GGUFFile(path, size, version, metadata, tuple(tensors))


def read_gguf(path: Path) -> GGUFFile:
    """Parse a GGUF file's header; a non-GGUF, truncated or corrupt file is one ``ModelError`` line."""
    import mmap

    path = Path(path)
    if not path.is_file():
        raise ModelError(f"{path}: no such file; give the path of a .gguf model file")
    size = path.stat().st_size
    if size < 24:
        raise ModelError(f"{path}: not a GGUF file ({size} bytes); give a .gguf model file")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        try:
            return _header(path, mm, size)
        except (struct.error, ValueError, UnicodeDecodeError, OverflowError, MemoryError):
            raise ModelError(
                f"{path}: truncated or corrupt GGUF header; fetch the file again"
            ) from None


def tokenizer_json(meta: dict, tokenizer_config: dict) -> str:
    """Byte-level BPE from the GGUF vocabulary, serialized as ``tokenizer.json``."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "gpt2")
    if kind != "gpt2":
        raise UnsupportedModel(
            f"tokenizer model {kind!r} is not supported; spill imports byte-level BPE (gpt2) GGUF tokenizers"
        )
    if pre not in _PRE_SPLITS:
        raise UnsupportedModel(
            f"pre-tokenizer {pre!r} is not supported; spill imports {', '.join(_PRE_SPLITS)} GGUF tokenizers"
        )
    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise UnsupportedModel(
            "the GGUF vocabulary repeats a token; spill cannot rebuild its tokenizer"
        )
    merges = []
    for m in meta.get("tokenizer.ggml.merges", []):
        pair = tuple(m.split(" "))
        if len(pair) != 2:
            raise ModelError(f"GGUF merge {m!r} is not a pair; re-convert the model")
        merges.append(pair)
    tok = Tokenizer(
        models.BPE(
            vocab, merges, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False
        )
    )
    if _PRE_SPLITS[pre] is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise ModelError(f"{len(types)} token types for {len(tokens)} tokens; re-convert the model")
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == _CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == _USER_DEFINED
        ]
    )
    # BOS/EOS added on encode only where the file asks (llama.cpp's add_bos/add_eos flags)
    ends = {}
    for flag, key in (("add_bos_token", "bos_token"), ("add_eos_token", "eos_token")):
        text = tokenizer_config[key]
        ends[key] = [text] if tokenizer_config[flag] and text is not None else []
    bos, eos = ends["bos_token"], ends["eos_token"]
    single = [f"{t}:0" for t in bos] + ["$A:0"] + [f"{t}:0" for t in eos]
    pair = single + [f"{t}:1" for t in bos] + ["$B:1"] + [f"{t}:1" for t in eos]
    specials = [(t, vocab[t]) for t in dict.fromkeys(bos + eos)]
    tok.post_processor = processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(pair), special_tokens=specials
    )
    return tok.to_str(pretty=True)
