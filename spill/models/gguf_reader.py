"""GGUF files through ``gguf.GGUFReader``: the key/value metadata, the tensor table, one tensor at a time.

The header is parsed by the ``gguf`` package's own reader, the maintained reference. A
hand-written ``struct`` parser was faster (SmolLM2's header 0.1 s against 2.9 s; the whole
one-time ``spill models import smollm2:135m`` 3.6-4.6 s against 5.6-7.4 s on a loaded 2-core
VM), but a few seconds once per model is not worth a second copy of the format. Its memmap is dropped once the table is read; tensor bytes are
read per tensor with ``pread`` and dequantized by ``gguf.quants.dequantize``, so memory stays
at one tensor. Only little-endian GGUF v2/v3 files are accepted; whatever ``gguf`` raises on a
cut or corrupt file becomes one ``ModelError`` line.

``tokenizer_json`` rebuilds the file's byte-level BPE tokenizer with ``tokenizers`` alone: tokens
and merges as stored, control tokens added as special, user-defined ones as plain added tokens,
and BOS/EOS added on encode only where the file's flags say so. Token strings are kept as stored
(transformers respells those outside the byte alphabet and then cannot match them whole).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from spill.errors import ModelError, UnsupportedModel

# byte-level pre-tokenizers by tokenizer.ggml.pre: None is GPT-2's regex inside ByteLevel
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (  # Llama 3's, with single digits
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    "gpt2": None,
    "gpt-2": None,
    "smollm": None,
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
MAGIC = b"GGUF"

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


def read_gguf(path: Path) -> GGUFFile:
    """Parse a GGUF file's header; a non-GGUF, truncated or corrupt file is one ``ModelError`` line."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"{path}: no such file; give the path of a .gguf model file")
    size = path.stat().st_size
    if size < 24:
        raise ModelError(f"{path}: not a GGUF file ({size} bytes); give a .gguf model file")
    with open(path, "rb") as f:
        head = f.read(8)
    if head[:4] != MAGIC:
        raise ModelError(f"{path}: not a GGUF file (no GGUF magic); give a .gguf model file")
    version = int.from_bytes(head[4:], "little")
    if version not in (2, 3):
        what = "big-endian" if version & 0xFFFF == 0 else f"version {version}"
        raise UnsupportedModel(
            f"{path}: {what} GGUF is not supported; re-convert it with a current llama.cpp"
        )
    try:
        reader = GGUFReader(path)
        metadata = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        tensors = tuple(_info(t) for t in reader.tensors)
    except (ValueError, IndexError, KeyError, UnicodeDecodeError, OverflowError, MemoryError):
        # gguf raises these for a cut or corrupt header, an unknown ggml type, a short tensor
        raise ModelError(f"{path}: truncated or corrupt GGUF; fetch the file again") from None
    return GGUFFile(path, size, version, metadata, tensors)


def _info(t) -> TensorInfo:
    """A ``gguf.ReaderTensor`` as spill's plain record: numpy shape order, absolute offset."""
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    return TensorInfo(
        t.name, shape, GGMLQuantizationType(t.tensor_type), int(t.data_offset), int(t.n_bytes)
    )


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
