"""``spill export --format gguf`` (``write``): the merged model as one GGUF file for llama.cpp and
Ollama, with an Ollama ``Modelfile`` that names the file and its stop tokens beside it.

Each family is written as llama.cpp's architecture for it (Mistral as ``llama``, Gemma 3 as
``gemma3``, Ministral 3 as ``mistral3``, Qwen3-MoE as ``qwen3moe``: ``export.experts``); what that
architecture cannot express, and a tokenizer without merges, are refused in one line before
anything is written. With ``--quantize`` every matrix whose rows split into 32-value blocks is
Q8_0/Q4_0/Q4_1, and what the rounding costs the tune is measured and said (``export.shift``).
Memory stays at one merged tensor (or one stack of experts)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFWriter, RopeScalingType
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize as ggml_quantize

from spill.errors import UnsupportedModel
from spill.jobs.export import experts
from spill.jobs.export.merge import Inputs
from spill.jobs.export.shift import WeightShift, measure, seen_rows
from spill.models.gguf import spm
from spill.models.gguf.arch import (
    ARCHES,
    BIASES,
    FUSED,
    GLOBAL,
    LAYER,
    QK_NORMS,
    WRITTEN_AS,
    Arch,
)
from spill.models.gguf.reader import LLAMA3_SPLIT, QWEN2_SPLIT
from spill.models.gguf.rotary import rope_freqs as rope_freqs  # the writer's, named here too
from spill.models.gguf.rotary import rope_tensors, yarn_log_mul

# Written through ``gguf.GGUFWriter`` as llama.cpp's ``convert_hf_to_gguf.py`` writes it: tensor
# names are the exact inverse of spill's importer (``spill.models.gguf.arch``: one table, read both
# ways, so the two cannot drift apart).
NAMES = {hf: g for g, hf in GLOBAL.items()}
# each table inverted on its own: LAYER's and FUSED's ffn_up are the same GGUF name
LAYER_NAMES = {hf: g for table in (LAYER, BIASES, QK_NORMS, FUSED) for g, hf in table.items()}
_FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "bf16": 32}


def gguf_name(hf: str, arch: Arch | None = None) -> str:
    """llama.cpp's name of an HF tensor, as ``arch`` names it (Gemma 3's ffn_norm is its
    pre-feedforward norm, not Llama's post-attention one); any family's without ``arch``."""
    if hf in NAMES:
        return NAMES[hf]
    k, rest = hf.removeprefix("model.layers.").split(".", 1)
    names = {h: g for g, h in arch.layer_names().items()} if arch else LAYER_NAMES
    return f"blk.{k}.{names[rest]}"


# Llama's and SmolLM3's attn_q/attn_k rows get llama.cpp's rotary interleave (``permute``, undone by
# the importer's ``_unpermute``), Qwen's do not (Qwen2 keeps its q/k/v biases, Qwen3 its
# attn_q_norm/attn_k_norm).
def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary row interleave of attn_q/attn_k (``convert_hf_to_gguf`` ``permute``):
    per head, rows ``[first half; second half]`` become pairs. (d, in) -> (d, in)."""
    d, n_in = w.shape
    return w.reshape(heads, 2, d // heads // 2, n_in).swapaxes(1, 2).reshape(d, n_in)


# Refused: a sliding window, or for Gemma 3 sliding layers off llama.cpp's fixed pattern or another
# local rotary base, a query scale it would not infer, biases it has no tensor for, NoPE layers off
# llama.cpp's fixed step. Gemma 3's norms are written as llama.cpp multiplies by
# them, 1 + w in float32, and its window as ``sliding_window``.
def _refuse_unwritable(inputs: Inputs) -> None:
    """One line, before anything is written, for what llama.cpp's architecture of the family
    (``models.gguf.arch.WRITTEN_AS``) cannot express."""
    cfg = inputs.config
    if cfg.family not in WRITTEN_AS:
        raise UnsupportedModel(
            f"{inputs.base_name}: spill writes no GGUF of a {cfg.family} model yet (only "
            f"{', '.join(WRITTEN_AS)}); export --format hf or --format mlx"
        )
    name, layers = WRITTEN_AS[cfg.family], cfg.num_hidden_layers
    arch = ARCHES[name]
    if arch.experts:  # every layer routed, top-k renormalized
        experts.refuse(inputs, name)
    if cfg.windowed and not arch.swa_step:  # Qwen's use_sliding_window, Mistral's window
        raise UnsupportedModel(
            f"{inputs.base_name}: its sliding-window layers have no GGUF form spill writes "
            f"(llama.cpp's {name} attends to every key); export --format hf or --format mlx"
        )
    if arch.swa_step and cfg.windowed != arch.windowed(layers):  # llama.cpp's pattern is fixed
        raise UnsupportedModel(
            f"{inputs.base_name}: its sliding layers {list(cfg.windowed)} are not llama.cpp's "
            f"{name}'s (all but every {arch.swa_step}th); export --format hf or --format mlx"
        )
    if arch.swa_step and cfg.local_rope_theta != arch.swa_rope_base:
        raise UnsupportedModel(
            f"{inputs.base_name}: its sliding layers' rotary base {cfg.local_rope_theta:g} is not "
            f"llama.cpp's {name}'s ({arch.swa_rope_base:g}); export --format hf or --format mlx"
        )
    scalar = arch.query_pre_attn_scalar(
        cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, layers
    )
    if cfg.query_scale != (None if scalar is None else float(scalar) ** -0.5):
        raise UnsupportedModel(
            f"{inputs.base_name}: its query_pre_attn_scalar {cfg.query_scale**-2:g} is not the "
            f"{scalar} llama.cpp's {name} scales queries by; export --format hf or --format mlx"
        )
    written = "yarn" if arch.yarn else "llama3" if name == "llama" else "default"
    if cfg.rope_kind not in ("default", written):  # llama3's as rope_freqs, YaRN's as keys
        raise UnsupportedModel(
            f"{inputs.base_name}: rope scaling on a {cfg.family} model has no GGUF form spill "
            "writes; export --format hf"
        )
    if arch.yarn and cfg.rope_scaling and not cfg.rope_scaling_dict["truncate"]:
        raise UnsupportedModel(
            f"{inputs.base_name}: YaRN with truncate false has no GGUF form (llama.cpp rounds "
            "the ramp's ends); export --format hf or --format mlx"
        )
    if arch.yarn and cfg.rope_scaling and yarn_log_mul(cfg) is None:
        raise UnsupportedModel(
            f"{inputs.base_name}: its YaRN attention factor {cfg.rope_attention:g} is not one "
            f"llama.cpp's {name} derives (mscale 1 over mscale_all_dim); export --format hf"
        )
    if cfg.o_bias or cfg.mlp_bias or (cfg.qkv_bias and not arch.biases):
        raise UnsupportedModel(
            f"{inputs.base_name} has attention or MLP biases that a {name} GGUF does not "
            "hold; export --format hf"
        )
    if cfg.rope_long and not arch.longrope:  # Phi-3's is written (rope_factors_long/short)
        raise UnsupportedModel(
            f"{inputs.base_name}: longrope on a {cfg.family} model has no GGUF form spill writes "
            "yet; export --format hf or --format mlx"
        )
    if cfg.no_rope != arch.no_rope(cfg.num_hidden_layers):  # llama.cpp's step is fixed
        raise UnsupportedModel(
            f"{inputs.base_name}: its layers without rotary {list(cfg.no_rope)} are not "
            f"llama.cpp's {name}'s (every {arch.no_rope_step}th); export --format hf"
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
        found = {LLAMA3_SPLIT: "llama-bpe", QWEN2_SPLIT: "qwen2"}.get(regex)
        if found:
            return found
    raise UnsupportedModel(
        f"{where}: its pre-tokenizer ({'+'.join(map(str, kinds)) or 'none'}) has no llama.cpp "
        "name spill knows (gpt-2, smollm, llama-bpe, qwen2); export --format hf"
    )


def read_tokenizer(inputs: Inputs) -> tuple[dict, str | None]:
    """``tokenizer.json`` and its pre-tokenizer's llama.cpp name (None: sentencepiece's), refused
    in one line before anything is written where llama.cpp could not serve it: not BPE, spaces not
    "▁" (``spm.space_prefix``), byte-level without merges (the tiny models': llama.cpp refuses a
    gpt2 vocabulary without them, and tokenizers any placeholder merge of a byte-only vocabulary)."""
    where = inputs.base_folder / "tokenizer.json"
    tok = json.loads(where.read_bytes())
    model = tok.get("model") or {}
    if model.get("type") == "BPE" and model.get("byte_fallback"):
        spm.space_prefix(tok, where)  # refuses what llama.cpp would tokenize otherwise
        return tok, None
    if model.get("type") != "BPE":
        raise UnsupportedModel(
            f"{where}: a {model.get('type')} tokenizer; spill writes GGUF for byte-level and "
            "sentencepiece BPE tokenizers only, export --format hf"
        )
    if not model.get("merges"):
        raise UnsupportedModel(
            f"{where} has no BPE merges (a byte-only vocabulary), which llama.cpp and Ollama "
            'refuse in a GGUF ("cannot find tokenizer merges"); export --format hf'
        )
    return tok, _pre(tok, where)


def add_tokenizer(writer, inputs: Inputs, tok: dict, pre: str | None) -> list[str]:
    """The vocabulary (byte-level BPE's tokens, merges, types, pre-tokenizer name; ``pre`` None:
    sentencepiece's, scored by merge rank, ``spm``), special ids, chat template; the stop texts."""
    folder = inputs.base_folder
    model = tok["model"]
    size = max(inputs.config.vocab_size, *(t["id"] + 1 for t in tok.get("added_tokens", [])))
    tokens: list[str | None] = [None] * size
    types = [spm.NORMAL] * size
    for text, i in model["vocab"].items():
        tokens[i] = text
    for t in tok.get("added_tokens", []):
        tokens[t["id"]] = t["content"]
        types[t["id"]] = spm.CONTROL if t.get("special") else spm.USER_DEFINED
    for i, t in enumerate(tokens):
        if t is None:  # a padded embedding row (Qwen2.5): llama.cpp's own filler
            tokens[i], types[i] = f"[PAD{i}]", spm.UNUSED
    if pre is None:  # sentencepiece's: llama.cpp's "llama" vocabulary, scored
        tokens, types = spm.add_vocabulary(writer, tok, tokens, types, folder / "tokenizer.json")
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    writer.add_token_list(tokens)
    writer.add_token_types(types)
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


# 1-D tensors (norms, biases) stay F32 as llama.cpp keeps them; with ``--quantize`` every matrix
# whose rows split into 32-value blocks is Q8_0/Q4_0/Q4_1 by ``gguf.quants`` (ggml's reference
# quantizers), any other stays in ``--dtype``.
def _storage(name: str, shape: tuple[int, ...], dtype: str, quantize: str | None):
    """The GGML type a tensor is stored as."""
    if len(shape) == 1:
        return T.F32
    if quantize:
        qtype = T[quantize.upper()]
        if shape[-1] % GGML_QUANT_SIZES[qtype][0] == 0:
            return qtype
    return {"f32": T.F32, "f16": T.F16, "bf16": T.BF16}[dtype]


# Tensor infos are declared first and the data written one merged tensor at a time, so memory stays
# at one tensor.
def write(
    inputs: Inputs,
    dest: Path,
    dtype: str,
    quantize: str | None,
    progress: Callable[[str], object],
) -> dict:
    """Fill ``dest`` with ``model-<type>.gguf`` and a ``Modelfile``; what export.json adds."""
    _refuse_unwritable(inputs)
    tok, pre = read_tokenizer(inputs)
    cfg = inputs.config
    arch = ARCHES[WRITTEN_AS[cfg.family]]
    kind = quantize or dtype
    path = dest / f"model-{kind}.gguf"
    writer = GGUFWriter(path, WRITTEN_AS[cfg.family])
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
    writer.add_rope_dimension_count(cfg.rotary_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if arch.experts:
        experts.add_keys(writer, inputs)
    if cfg.windowed:  # llama.cpp's own pattern of sliding layers (checked above)
        writer.add_sliding_window(cfg.sliding_window)
    stops = add_tokenizer(writer, inputs, tok, pre)

    stored, types = {}, Counter()
    extra = rope_tensors(cfg)  # llama3 scaling's or longrope's factors: written first
    if cfg.rope_long:  # as convert_hf_to_gguf.py writes a Phi-3's longrope
        writer.add_rope_scaling_orig_ctx_len(cfg.rope_original)
        writer.add_rope_scaling_attn_factors(cfg.rope_attention)
    if arch.yarn and cfg.rope_scaling:  # as convert_hf_to_gguf.py writes a Ministral 3's
        yarn = cfg.rope_scaling_dict
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(yarn["factor"])
        writer.add_rope_scaling_yarn_beta_fast(yarn["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(yarn["beta_slow"])
        if yarn_log_mul(cfg):
            writer.add_rope_scaling_yarn_log_mul(yarn_log_mul(cfg))
    if arch.temperature and cfg.query_beta:  # counted in the original length, as llama.cpp's
        writer.add_attn_temperature_scale(cfg.query_beta)
    if arch.yarn and (cfg.rope_scaling or cfg.query_beta):
        writer.add_rope_scaling_orig_ctx_len(cfg.rope_original)
    for name, factors in extra.items():
        writer.add_tensor_info(name, factors.shape, np.float32, factors.nbytes)
        types["F32"] += 1
    tensors = experts.layout(inputs)  # plan's, an MoE layer's experts stacked
    for name, shape, parts in tensors:
        qtype = _storage(name, shape, dtype, quantize)
        block, size = GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape)) // block * size
        writer.add_tensor_info(gguf_name(name, arch), shape, np.float32, nbytes, raw_dtype=qtype)
        stored |= dict.fromkeys((name, *parts), qtype)  # shift.py's as_stored reads the parts
        types[qtype.name] += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for factors in extra.values():
        writer.write_tensor_data(factors)
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    rows = seen_rows(inputs) if quantize else ""
    weights = WeightShift(inputs, rows) if quantize and isinstance(rows, str) else None
    for name, w in experts.stream(inputs, tensors):
        module = name.rsplit(".", 2)[-2]
        if arch.permute and module in heads and name.endswith(".weight"):
            w = permute(w, heads[module])
        if arch.norm_shift and name.endswith("norm.weight"):
            w = w + np.float32(arch.norm_shift)  # what llama.cpp multiplies by (Gemma's 1 + w)
        qtype = stored[name]
        if qtype.name == "F32":
            data = w
        elif qtype.name == "F16":
            data = w.astype(np.float16)
        else:
            data = ggml_quantize(w, qtype)  # BF16 and the block types, as uint8 rows
            if weights is not None and qtype.name == quantize.upper():
                weights.add(name, w, data, qtype)
        writer.write_tensor_data(np.ascontiguousarray(data))
    writer.close()
    progress(f"wrote {path.name} ({', '.join(f'{n} {t}' for t, n in sorted(types.items()))})")
    extra_json = {}
    if quantize:
        measured = measure(inputs, dest, quantize, stored, rows, weights, progress)
        extra_json = {"quantization_shift": measured} if measured else {}
    modelfile = [
        f"# Ollama: ollama create NAME -f Modelfile (merged by spill from {inputs.base_name})",
        f"FROM ./{path.name}",
        *(f"PARAMETER stop {json.dumps(s)}" for s in stops),
    ]
    (dest / "Modelfile").write_text("\n".join(modelfile) + "\n", encoding="utf-8")
    return {"gguf": {"file": path.name, "types": dict(sorted(types.items())), **extra_json}}
