"""GGUF files through a bounded parser of spill's own (``read_gguf`` -> ``GGUFFile``): metadata,
tensor table, one tensor at a time (``pread``, ``gguf.quants``); v2/v3 only. Each count and length
is checked against the bytes left in the file before anything is read or allocated, and each
tensor's shape, type and bytes against the file's size; a non-GGUF, truncated or corrupt file is one
``ModelError`` line. ``tokenizer_json`` rebuilds the file's byte-level BPE tokenizer, or its
sentencepiece one (``spm``), with ``tokenizers`` alone.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from spill.errors import ModelError, UnsupportedModel
from spill.models.gguf import spm

# byte-level pre-tokenizers by tokenizer.ggml.pre (None: GPT-2's regex inside ByteLevel), both ways
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (  # Llama 3's, with single digits
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_SPLITS = {
    "gpt2": None,
    "gpt-2": None,
    "smollm": None,
    "llama-bpe": LLAMA3_SPLIT,
    "llama3": LLAMA3_SPLIT,
    "qwen2": QWEN2_SPLIT,
}
MAGIC = b"GGUF"

# Types gguf.quants dequantizes exactly as ggml does; others are refused before any work.
SUPPORTED = tuple(
    GGMLQuantizationType[n]
    for n in "F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K".split()
)


@dataclass(frozen=True)
class Unread:
    """An array the importer does not use: its length; its bytes were skipped, not read."""

    count: int


_NEED = object()
_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


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

    def value(self, key: str, kind: type, default=_NEED, least: float | None = None):
        """Metadata ``key`` as a ``kind`` (int, float, str, bool) of ``least`` or more, else
        ``default`` when absent; missing (no default) or of another type: one line."""
        if key not in self.metadata:
            if default is _NEED:
                raise ModelError(f"{self.path}: GGUF metadata lacks '{key}'; re-convert the model")
            return default
        v = self.metadata[key]
        ok = type(v) in (int, float) and math.isfinite(v) if kind is float else type(v) is kind
        if not ok or (least is not None and v < least):
            shown = f"an array of {v.count}" if isinstance(v, Unread) else repr(v)[:40]
            least_ = f" of at least {least}" if least is not None else ""
            raise ModelError(
                f"{self.path}: GGUF metadata '{key}' is {shown}, not {_KINDS[kind]}{least_}; the "
                "file is damaged or not a model: re-convert it or fetch it again"
            )
        return v

    def array(self, key: str, kind: type, required: bool) -> list | None:
        """A ``KEPT_ARRAYS`` entry whose elements are ``kind`` (str or int), else one line."""
        v = self.metadata.get(key)
        if v is None and not required:
            return None
        if not isinstance(v, list) or not v or type(v[0]) is not kind:  # GGUF arrays are uniform
            shown = "missing" if v is None else f"{type(v).__name__} {repr(v)[:40]}"
            raise ModelError(
                f"{self.path}: GGUF metadata '{key}' is {shown}, not a list of {kind.__name__}s; "
                "the file is damaged or not a model: re-convert it or fetch it again"
            )
        return v

    def check_supported(self, info: TensorInfo) -> None:
        if info.qtype not in SUPPORTED:
            raise UnsupportedModel(
                f"{self.path.name}: tensor {info.name} is stored as {info.qtype.name}; spill imports "
                f"{'/'.join(t.name for t in SUPPORTED)} GGUFs, so pick another quantization of the model"
            )

    def raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's stored bytes, uint8 (*shape[:-1], bytes per row)."""
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
        return np.frombuffer(raw, dtype=np.uint8).reshape(
            *info.shape[:-1], info.shape[-1] // block * size
        )

    def read(self, info: TensorInfo) -> np.ndarray:
        """The tensor dequantized to float32, in numpy shape order."""
        self.check_supported(info)
        rows = self.raw(info)
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


# GGUF value types: scalars by struct format; 8 is a string, 9 an array
_SCALARS = dict(enumerate("<B <b <H <h <I <i <f <?".split())) | {10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
KEPT_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")
KEPT_ARRAYS += ("tokenizer.ggml.scores",)  # a sentencepiece vocabulary's merge order
MAX_ELEMENTS = 1 << 20  # per array read (vocabularies run 32k-262k); string arrays skipped too
MAX_DIMS = 4  # ggml's
_WINDOW = 1 << 20


# Not ``gguf.GGUFReader``: it makes a numpy view per array element (an 8 MB file with one 2M-element
# array took 1.44 GB and 49 s) and trusts every count. Only ``KEPT_ARRAYS`` are read
# (``MAX_ELEMENTS`` at most), others skipped unread. Shapes are checked with Python integers (an
# offset of 2^64-32 is refused, not wrapped onto the header).
class _Cursor:
    """Reads a GGUF header through a 1 MiB window; every length is checked against the bytes
    left in the file before it is read or anything is sized from it."""

    def __init__(self, f, size: int, where: Path):
        self.f, self.size, self.where = f, size, where
        self.base, self.buf, self.i = 0, b"", 0  # file offset of buf[0]; position in buf

    @property
    def pos(self) -> int:
        return self.base + self.i

    def corrupt(self, what: str) -> ModelError:
        return ModelError(f"{self.where}: corrupt GGUF ({what}); fetch the file again")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise ModelError(
                f"{self.where}: truncated or corrupt GGUF ({what} runs past the "
                f"end of the file); fetch the file again"
            )

    def take(self, n: int, what: str) -> bytes:
        self.need(n, what)
        if self.i + n > len(self.buf):
            self.base, self.i = self.pos, 0
            self.f.seek(self.base)
            self.buf = self.f.read(max(n, _WINDOW))
        out = self.buf[self.i : self.i + n]
        self.i += n
        return out

    def skip(self, n: int, what: str) -> None:
        self.need(n, what)
        if self.i + n <= len(self.buf):
            self.i += n
        else:
            self.base, self.buf, self.i = self.pos + n, b"", 0

    def scalar(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        try:
            return self.take(n, what).decode("utf-8")
        except UnicodeDecodeError:
            raise self.corrupt(f"{what} is not UTF-8") from None

    def value(self, kind: int, key: str):
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind], key)
        if kind == _STRING:
            return self.string(key)
        if kind != _ARRAY:
            raise self.corrupt(f"{key} has unknown value type {kind}")
        kind, count = self.scalar("<I", key), self.scalar("<Q", key)
        if kind == _STRING:
            self.need(count * 8, f"the {count}-element array {key}")
            if count > MAX_ELEMENTS:
                raise UnsupportedModel(
                    f"{self.where}: GGUF array {key} has {count} strings, more than spill reads "
                    f"({MAX_ELEMENTS}); this is not a model spill can import"
                )
            if key not in KEPT_ARRAYS:
                for _ in range(count):
                    self.skip(self.scalar("<Q", key), key)
                return Unread(count)
            return [self.string(key) for _ in range(count)]
        if kind not in _SCALARS:  # nested arrays: no model format uses them
            raise self.corrupt(f"{key} is an array of value type {kind}")
        fmt = _SCALARS[kind]
        nbytes = count * struct.calcsize(fmt)
        if key not in KEPT_ARRAYS:
            self.skip(nbytes, f"the {count}-element array {key}")
            return Unread(count)
        self.need(nbytes, f"the {count}-element array {key}")
        if count > MAX_ELEMENTS:
            raise UnsupportedModel(
                f"{self.where}: GGUF array {key} has {count} elements, more than spill reads "
                f"({MAX_ELEMENTS}); this is not a model spill can import"
            )
        return np.frombuffer(self.take(nbytes, key), dtype=fmt).tolist()


def read_gguf(path: Path) -> GGUFFile:
    """Parse a GGUF file's header; a non-GGUF, truncated or corrupt file is one ``ModelError`` line."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"{path}: no such file; give the path of a .gguf model file")
    size = path.stat().st_size
    if size < 24:
        raise ModelError(f"{path}: not a GGUF file ({size} bytes); give a .gguf model file")
    with open(path, "rb") as f:
        cur = _Cursor(f, size, path)
        head = cur.take(8, "the header")
        if head[:4] != MAGIC:
            raise ModelError(f"{path}: not a GGUF file (no GGUF magic); give a .gguf model file")
        version = int.from_bytes(head[4:], "little")
        if version not in (2, 3):
            what = "big-endian" if version & 0xFFFF == 0 else f"version {version}"
            raise UnsupportedModel(
                f"{path}: {what} GGUF is not supported; re-convert it with a current llama.cpp"
            )
        n_tensors, n_kv = cur.scalar("<Q", "the header"), cur.scalar("<Q", "the header")
        # the least bytes one entry takes: a key/value 8 + 4 + 1, a tensor record 8 + 4 + 8 + 4 + 8
        cur.need(n_kv * 13 + n_tensors * 32, f"{n_kv} keys and {n_tensors} tensor records")
        metadata: dict = {}
        for _ in range(n_kv):
            key = cur.string("a metadata key")
            if key in metadata:
                raise cur.corrupt(f"metadata key {key} appears twice")
            metadata[key] = cur.value(cur.scalar("<I", key), key)
        records = [_record(cur) for _ in range(n_tensors)]
        align = metadata.get("general.alignment", 32)
        if type(align) is not int or not 0 < align <= 1 << 16 or align & (align - 1):
            raise cur.corrupt(f"general.alignment is {align!r}, not a power of two")
        start = -(-cur.pos // align) * align
    tensors = tuple(_tensor(cur, start, *r) for r in records)
    if len({t.name for t in tensors}) != len(tensors):
        raise cur.corrupt("a tensor name appears twice")
    return GGUFFile(path, size, version, metadata, tensors)


def _record(cur: _Cursor) -> tuple[str, list[int], int, int]:
    name = cur.string("a tensor name")
    n_dims = cur.scalar("<I", name)
    if not 1 <= n_dims <= MAX_DIMS:
        raise cur.corrupt(f"tensor {name} has {n_dims} dimensions")
    dims = [cur.scalar("<Q", name) for _ in range(n_dims)]
    return name, dims, cur.scalar("<I", name), cur.scalar("<Q", name)


def _tensor(cur: _Cursor, start: int, name: str, dims: list[int], kind: int, offset: int):
    """A tensor record checked against the file: known type, whole blocks, bytes inside it."""
    try:
        qtype = GGMLQuantizationType(kind)
        block, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise UnsupportedModel(
            f"{cur.where}: tensor {name} has unknown ggml type {kind}; re-convert it with a "
            "current llama.cpp, or pick another quantization of the model"
        ) from None
    if min(dims) < 1 or dims[0] % block:
        raise cur.corrupt(f"tensor {name} has shape {dims} for {qtype.name} blocks of {block}")
    nbytes = math.prod(dims) // block * type_size  # Python integers: nothing wraps
    if start + offset + nbytes > cur.size:
        raise ModelError(
            f"{cur.where}: truncated or corrupt GGUF (tensor {name}'s {nbytes} bytes at offset "
            f"{offset} lie past the end of the file); fetch the file again"
        )
    return TensorInfo(name, tuple(reversed(dims)), qtype, start + offset, nbytes)


# Tokens and merges as stored, control tokens added as special, user-defined ones as plain added
# tokens, and BOS/EOS added on encode only where the file's flags say so. Token strings are kept as
# stored (transformers respells those outside the byte alphabet and then cannot match them whole;
# a sentencepiece file's user-defined spaces stay spaces, matched in the text as llama.cpp does).
def tokenizer_json(meta: dict, tokenizer_config: dict) -> str:
    """Byte-level BPE, or sentencepiece's BPE (``spm``: a ``llama`` tokenizer model), from the
    GGUF vocabulary, serialized as ``tokenizer.json``."""
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
    if kind not in ("gpt2", "llama"):
        raise UnsupportedModel(
            f"tokenizer model {kind!r} is not supported; spill imports byte-level BPE (gpt2) and "
            "sentencepiece BPE (llama) GGUF tokenizers; use the HF model"
        )
    if kind == "gpt2" and pre not in PRE_SPLITS:
        raise UnsupportedModel(
            f"pre-tokenizer {pre!r} is not supported; spill imports {', '.join(PRE_SPLITS)} GGUF tokenizers"
        )
    tokens = meta["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise UnsupportedModel(
            "the GGUF vocabulary repeats a token; spill cannot rebuild its tokenizer"
        )
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise ModelError(f"{len(types)} token types for {len(tokens)} tokens; re-convert the model")
    merges = []
    for m in meta.get("tokenizer.ggml.merges", []):
        pair = tuple(m.split(" "))
        if len(pair) != 2:
            raise ModelError(f"GGUF merge {m!r} is not a pair; re-convert the model")
        merges.append(pair)
    if kind == "llama":
        tok, tokens, types = spm.tokenizer(meta, tokens, merges, types)
    else:
        try:
            bpe = models.BPE(
                vocab, merges, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False
            )
        except Exception as e:  # tokenizers raises a bare Exception (a merge of unknown tokens)
            raise ModelError(
                f"the GGUF vocabulary cannot be rebuilt ({e}); re-convert the model"
            ) from None
        tok = Tokenizer(bpe)
        if PRE_SPLITS[pre] is None:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            split = pre_tokenizers.Split(Regex(PRE_SPLITS[pre]), behavior="isolated")
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
            )
        tok.decoder = decoders.ByteLevel()

    def added(which: int) -> list:
        found = [t for t, k in zip(tokens, types, strict=True) if k == which]
        return [AddedToken(t, special=which == spm.CONTROL, normalized=False) for t in found]

    tok.add_special_tokens(added(spm.CONTROL))
    tok.add_tokens(added(spm.USER_DEFINED))
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
