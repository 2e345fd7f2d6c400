"""``spill export --format gguf``: the merged model as one GGUF file for llama.cpp and Ollama.

Written through ``gguf.GGUFWriter`` as llama.cpp's ``convert_hf_to_gguf.py`` writes it:
tensor names are the exact inverse of spill's importer (``spill.models.gguf_import``: its own
tables, inverted, so the two cannot drift apart); Llama's attn_q/attn_k rows get llama.cpp's
rotary interleave (``permute``, undone by the importer's ``_unpermute``), Qwen2's do not (and
keep their q/k/v biases); llama3 rope scaling becomes llama.cpp's ``rope_freqs.weight``
(``rope_freqs``; spill's importer refuses such a file: rope scaling); 1-D tensors (norms,
biases) stay F32 as llama.cpp keeps them; with ``--quantize`` every matrix whose rows split into 32-value blocks is Q8_0/Q4_0/Q4_1 by
``gguf.quants`` (ggml's reference quantizers), any other stays in ``--dtype``. The tokenizer is
byte-level BPE from ``tokenizer.json`` (tokens, merges, token types, the pre-tokenizer's
llama.cpp name), with the chat template. Tensor infos are declared first and the data written
one merged tensor at a time, so memory stays at one tensor. An Ollama ``Modelfile`` that names
the file and its stop tokens is written beside it. With ``--quantize`` the rounding of the adapted
matrices is measured against the tune's own change (``_Shift``) and said; a tokenizer without
merges (which llama.cpp refuses) is said in one note.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

from spill.errors import UnsupportedModel
from spill.jobs.export.merge import Inputs, merged, plan
from spill.models.gguf_import import _BIASES, _GLOBAL, _LAYER
from spill.models.gguf_reader import _LLAMA3_SPLIT, _QWEN2_SPLIT

NAMES = {hf: g for g, hf in _GLOBAL.items()}
LAYER_NAMES = {hf: g for g, hf in {**_LAYER, **_BIASES}.items()}
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5  # llama.cpp token types
_FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "bf16": 32}


def gguf_name(hf: str) -> str:
    if hf in NAMES:
        return NAMES[hf]
    k, rest = hf.removeprefix("model.layers.").split(".", 1)
    return f"blk.{k}.{LAYER_NAMES[rest]}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary row interleave of attn_q/attn_k (``convert_hf_to_gguf`` ``permute``):
    per head, rows ``[first half; second half]`` become pairs. (d, in) -> (d, in)."""
    d, n_in = w.shape
    return w.reshape(heads, 2, d // heads // 2, n_in).swapaxes(1, 2).reshape(d, n_in)


def rope_freqs(cfg) -> np.ndarray:
    """llama.cpp's ``rope_freqs.weight`` for llama3 rope scaling, as ``convert_hf_to_gguf``
    computes it: per rotary pair, the factor its frequency is divided by. (head_dim / 2,)"""
    s = cfg.rope_scaling_dict
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    dim = cfg.head_dim
    freqs = 1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


# families whose GGUF form this writer knows (llama.cpp's tensor names, Llama's q/k permutation)
ARCHES = ("llama", "qwen2")


def _refuse_unwritable(inputs: Inputs) -> None:
    cfg = inputs.config
    if cfg.family not in ARCHES:
        raise UnsupportedModel(
            f"{inputs.base_name}: spill writes no GGUF of a {cfg.family} model yet (only "
            f"{' and '.join(ARCHES)}); export --format hf or --format mlx"
        )
    if cfg.rope_scaling and cfg.family != "llama":
        raise UnsupportedModel(
            f"{inputs.base_name}: rope scaling on a {cfg.family} model has no GGUF form spill "
            "writes; export --format hf"
        )
    if cfg.o_bias or cfg.mlp_bias or (cfg.family == "llama" and cfg.qkv_bias):
        raise UnsupportedModel(
            f"{inputs.base_name} has attention or MLP biases that a llama GGUF does not hold; "
            "export --format hf"
        )


def _pre(tokenizer: dict, where: Path) -> str:
    """llama.cpp's name for the tokenizer's pre-tokenizer (``tokenizer.ggml.pre``)."""
    pre = tokenizer.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [p.get("type") for p in parts]
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"  # llama.cpp's spelling (convert_hf_to_gguf writes it)
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits"):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not parts[1].get("use_regex", True):
        regex = (parts[0].get("pattern") or {}).get("Regex")
        found = {_LLAMA3_SPLIT: "llama-bpe", _QWEN2_SPLIT: "qwen2"}.get(regex)
        if found:
            return found
    raise UnsupportedModel(
        f"{where}: its pre-tokenizer ({'+'.join(map(str, kinds)) or 'none'}) has no llama.cpp "
        "name spill knows (gpt-2, smollm, llama-bpe, qwen2); export --format hf"
    )


def add_tokenizer(
    writer, inputs: Inputs, progress: Callable[[str], object] = lambda line: None
) -> list[str]:
    """The vocabulary, merges, special ids and chat template; the texts that end generation.
    A BPE without merges (the tiny test models' byte-only vocabulary) is written without the
    merges key (gguf writes no empty array), which llama.cpp refuses ("cannot find tokenizer
    merges"): said in one note, since transformers and spill's importer read the file."""
    folder = inputs.base_folder
    where = folder / "tokenizer.json"
    tok = json.loads(where.read_bytes())
    model = tok.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise UnsupportedModel(
            f"{where}: not a byte-level BPE tokenizer; spill writes GGUF for gpt2-style "
            "tokenizers only, export --format hf"
        )
    size = max(inputs.config.vocab_size, *(t["id"] + 1 for t in tok.get("added_tokens", [])))
    tokens: list[str | None] = [None] * size
    types = [_NORMAL] * size
    for text, i in model["vocab"].items():
        tokens[i] = text
    for t in tok.get("added_tokens", []):
        tokens[t["id"]] = t["content"]
        types[t["id"]] = _CONTROL if t.get("special") else _USER_DEFINED
    for i, t in enumerate(tokens):
        if t is None:  # a padded embedding row (Qwen2.5): llama.cpp's own filler
            tokens[i], types[i] = f"[PAD{i}]", _UNUSED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre(tok, where))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if not merges:
        progress(
            f'{where} has no BPE merges: llama.cpp and Ollama refuse this GGUF ("cannot find '
            'tokenizer merges"); transformers and spill read it, or export --format hf'
        )
    tc_path = folder / "tokenizer_config.json"
    tc = json.loads(tc_path.read_bytes()) if tc_path.is_file() else {}
    cfg = inputs.config
    if cfg.bos_token_id is not None:
        writer.add_bos_token_id(cfg.bos_token_id)
    gen_path = folder / "generation_config.json"
    gen = json.loads(gen_path.read_bytes()).get("eos_token_id") if gen_path.is_file() else None
    gen = gen if isinstance(gen, list) else [gen] if isinstance(gen, int) else []
    eos = list(dict.fromkeys([*cfg.eos_token_ids, *gen]))  # every end of generation
    if eos:
        writer.add_eos_token_id(eos[0])
    if len(eos) > 1:  # llama.cpp stops on eot too (the importer reads it back the same way)
        writer.add_eot_token_id(eos[1])
    pad = inputs.raw_config.get("pad_token_id")
    if isinstance(pad, int):
        writer.add_pad_token_id(pad)
    writer.add_add_bos_token(bool(tc.get("add_bos_token", False)))
    writer.add_add_eos_token(bool(tc.get("add_eos_token", False)))
    template = tc.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if template:
        writer.add_chat_template(template)
    return [tokens[i] for i in eos if 0 <= i < size]


def _storage(name: str, shape: tuple[int, ...], dtype: str, quantize: str | None):
    """The GGML type a tensor is stored as."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as T

    if len(shape) == 1:
        return T.F32
    if quantize:
        qtype = T[quantize.upper()]
        if shape[-1] % GGML_QUANT_SIZES[qtype][0] == 0:
            return qtype
    return {"f32": T.F32, "f16": T.F16, "bf16": T.BF16}[dtype]


def write(
    inputs: Inputs,
    dest: Path,
    dtype: str,
    quantize: str | None,
    progress: Callable[[str], object],
) -> dict:
    """Fill ``dest`` with ``model-<type>.gguf`` and a ``Modelfile``; what export.json adds."""
    from collections import Counter

    from gguf import GGML_QUANT_SIZES, GGUFWriter
    from gguf.quants import quantize as ggml_quantize

    _refuse_unwritable(inputs)
    cfg = inputs.config
    arch = cfg.family
    kind = quantize or dtype
    path = dest / f"model-{kind}.gguf"
    writer = GGUFWriter(path, arch)
    writer.add_name(Path(inputs.base_name).name + "-spill-lora")
    writer.add_file_type(_FILE_TYPES[kind])
    if quantize:
        writer.add_quantization_version(2)  # GGML_QNT_VERSION
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    stops = add_tokenizer(writer, inputs, progress)

    stored, types = {}, Counter()
    extra = rope_freqs(cfg) if cfg.rope_scaling else None  # llama3 scaling: written first
    if extra is not None:
        writer.add_tensor_info("rope_freqs.weight", extra.shape, np.float32, extra.nbytes)
        types["F32"] += 1
    for name, shape in plan(inputs):
        qtype = _storage(name, shape, dtype, quantize)
        block, size = GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape)) // block * size
        writer.add_tensor_info(gguf_name(name), shape, np.float32, nbytes, raw_dtype=qtype)
        stored[name] = qtype
        types[qtype.name] += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    if extra is not None:
        writer.write_tensor_data(extra)
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    shift = _Shift(inputs)
    for name, w in merged(inputs):
        module = name.rsplit(".", 2)[-2]
        if arch == "llama" and module in heads and name.endswith(".weight"):
            w = permute(w, heads[module])
        qtype = stored[name]
        if qtype.name == "F32":
            data = w
        elif qtype.name == "F16":
            data = w.astype(np.float16)
        else:
            data = ggml_quantize(w, qtype)  # BF16 and the block types, as uint8 rows
            if quantize and qtype.name == quantize.upper():
                shift.add(name, w, data, qtype)
        writer.write_tensor_data(np.ascontiguousarray(data))
    writer.close()
    progress(f"wrote {path.name} ({', '.join(f'{n} {t}' for t, n in sorted(types.items()))})")
    extra_json = {}
    if quantize and shift.tune2 > 0:
        extra_json["quantization_shift"] = shift.result()
        progress(shift.line(quantize))
    modelfile = [
        f"# Ollama: ollama create NAME -f Modelfile (merged by spill from {inputs.base_name})",
        f"FROM ./{path.name}",
        *(f"PARAMETER stop {json.dumps(s)}" for s in stops),
    ]
    (dest / "Modelfile").write_text("\n".join(modelfile) + "\n", encoding="utf-8")
    return {"gguf": {"file": path.name, "types": dict(sorted(types.items())), **extra_json}}


class _Shift:
    """How far ``--quantize`` moves the adapted matrices, against how far the tune moved them:
    the Frobenius norm of (dequantized - float merge) over every adapted matrix stored in the
    block type, divided by that of the tune's own change (``scale * (A @ B).T``). Near or above
    1, the rounding is as large as what the tune learned (a short tune's small delta)."""

    def __init__(self, inputs: Inputs):
        self.params = inputs.adapter.params
        self.scale = np.float32(inputs.adapter.lora.scale)
        self.tune2 = self.error2 = 0.0
        self.matrices = 0

    def add(self, name: str, w: np.ndarray, data: np.ndarray, qtype) -> None:
        from gguf.quants import dequantize

        stem = name.rsplit(".", 1)[0].removeprefix("model.")
        if not name.endswith(".weight") or f"{stem}.lora_a" not in self.params:
            return
        a, b = self.params[f"{stem}.lora_a"], self.params[f"{stem}.lora_b"]
        delta = self.scale * (a @ b)  # (in, out): the norm is the transpose's, and the
        error = dequantize(data, qtype) - w  # q/k permutation moves rows, not their norms
        self.tune2 += float(np.sum(np.square(delta, dtype=np.float64)))
        self.error2 += float(np.sum(np.square(error, dtype=np.float64)))
        self.matrices += 1

    def result(self) -> dict:
        return {
            "matrices": self.matrices,
            "tune_norm": round(math.sqrt(self.tune2), 6),
            "quantization_norm": round(math.sqrt(self.error2), 6),
            "ratio": round(math.sqrt(self.error2 / self.tune2), 4),
        }

    def line(self, quantize: str) -> str:
        r = self.result()
        warn = (
            "; the rounding is at least as large as what the tune learned: check the export "
            "on your rows, or export q8_0 or a float dtype"
            if r["ratio"] >= 1
            else ""
        )
        return (
            f"{quantize} moves the {r['matrices']} adapted matrices by {r['ratio']:.2f}x the "
            f"tune's own change (Frobenius norms {r['quantization_norm']:.4g} against "
            f"{r['tune_norm']:.4g}){warn}"
        )
