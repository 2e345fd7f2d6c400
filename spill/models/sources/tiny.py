"""Deterministic tiny random models of every family, for tests and examples.

Everything comes from ``numpy.random.default_rng(seed)`` in a fixed order and is written by
spill's own safetensors writer, so the same arguments give the same bytes on any machine. The
tokenizer is a real byte-level BPE (every byte is a token, no merges) with ChatML special tokens,
so chat templates, special tokens and decoding behave as on a hub model.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from spill.errors import SpillError
from spill.ground.paths import models_dir
from spill.models.cache import MARKER, write_marker
from spill.models.config import parse_config
from spill.models.integrity import record
from spill.models.names import TinyName, safe_name
from spill.store.safetensors_io import float32_to_bf16_bits, write_file

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    keep = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def tokenizer_json() -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tok.to_str(pretty=True)


# what each family's tiny config.json says beside the shared shape, given (layers, head_dim):
# its own keys, as transformers' config class writes them (a Qwen3 head twice hidden / heads wide,
# as Qwen3-0.6B's; a Mistral window shorter than the tests' sequences; a SmolLM3 NoPE layer
# every fourth)
_FAMILY_KEYS: dict[str, Callable[[int, int], dict]] = {
    "llama": lambda layers, head: {
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "qwen2": lambda layers, head: {"rms_norm_eps": 1e-6, "tie_word_embeddings": False},
    "qwen3": lambda layers, head: {
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "head_dim": 2 * head,
    },
    "qwen3_moe": lambda layers, head: {  # Qwen3-30B-A3B's routing: top 8 of 128, renormalized
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "head_dim": 2 * head,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 4 * head,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "mistral": lambda layers, head: {
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "sliding_window": 32,
    },
    "smollm3": lambda layers, head: {
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "no_rope_layer_interval": 4,
        "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(layers)],
    },
    "gemma3_text": lambda layers, head: {  # every third layer full, the others a 32-key window
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": head,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "sliding_window": 32,
        "layer_types": [
            "full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(layers)
        ],
    },
    "phi3": lambda layers, head: {  # Phi-4-mini's 3/4 of a head rotated; longrope past 32
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": 32,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0 + 0.25 * j for j in range(int(head * 0.75) // 2)],
            "long_factor": [2.0 + j for j in range(int(head * 0.75) // 2)],
        },
    },
    "ministral3": lambda layers, head: {  # YaRN and the query scaling past 32 positions
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "llama_4_scaling_beta": 0.1,
        },
    },
}
TINY_FAMILIES = tuple(_FAMILY_KEYS)
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mistral": "MistralForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "ministral3": "Ministral3ForCausalLM",
}


def _config(family: str, layers: int, hidden: int, vocab: int) -> dict:
    heads = max(2, hidden // 16)
    kv = heads // 2 if heads % 2 == 0 else heads
    eos = vocab - 1  # <|im_end|>
    return {
        "architectures": [_ARCHITECTURES[family]],
        "model_type": family,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": hidden * 2 + hidden // 2,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "bos_token_id": vocab - 3,
        "eos_token_id": eos,
        "pad_token_id": vocab - 3,
        "torch_dtype": "bfloat16",
        **_FAMILY_KEYS[family](layers, hidden // heads),
    }


def _fused(prefix: str, parts: dict, fused: str, linears) -> dict[str, np.ndarray]:
    """``parts`` (q, k, v or gate, up) under ``prefix``, their weights stacked as ``fused`` when
    the family holds that linear (Phi-3's qkv_proj, gate_up_proj)."""
    if fused not in linears:
        return {prefix + k: v for k, v in parts.items()}
    weights = [v for k, v in parts.items() if k.endswith(".weight")]
    return {prefix + fused + ".weight": np.concatenate(weights)} | {
        prefix + k: v for k, v in parts.items() if not k.endswith(".weight")
    }


def _tensors(cfg: dict, rng: np.random.Generator) -> dict[str, np.ndarray]:
    shape = parse_config(cfg)
    h, i, v, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], shape.head_dim
    q = cfg["num_attention_heads"] * d
    kv = cfg["num_key_value_heads"] * d

    def w(*shape, std=0.02):
        return rng.normal(0.0, std, size=shape).astype(np.float32)

    def norm(n):  # a scale near 1: a weight near 1, or near 0 where norms scale by (1 + w)
        return (1.0 - shape.norm_offset + rng.normal(0.0, 0.1, size=(n,))).astype(np.float32)

    out = {"model.embed_tokens.weight": w(v, h, std=0.5)}
    for k in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{k}."
        out[p + "input_layernorm.weight"] = norm(h)
        attn = {}
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            attn[f"self_attn.{name}.weight"] = w(rows, h, std=0.1)
            if shape.qkv_bias:
                attn[f"self_attn.{name}.bias"] = w(rows, std=0.1)
        out |= _fused(p, attn, "self_attn.qkv_proj", shape.linears)
        out[p + "self_attn.o_proj.weight"] = w(h, q, std=0.1)
        if shape.qk_norm:
            out[p + "self_attn.q_norm.weight"] = norm(d)
            out[p + "self_attn.k_norm.weight"] = norm(d)
        out[p + "post_attention_layernorm.weight"] = norm(h)
        if shape.feedforward_norms:
            out[p + "pre_feedforward_layernorm.weight"] = norm(h)
            out[p + "post_feedforward_layernorm.weight"] = norm(h)
        if k in shape.sparse:  # the router wide enough that each token's choice is clear
            out[p + "mlp.gate.weight"] = w(shape.experts, h, std=0.3)
            for e, (n, o) in shape.layer_linears(k).items():
                if e.startswith("mlp.experts."):
                    out[p + e + ".weight"] = w(o, n, std=0.1)
            continue
        mlp = {"mlp.gate_proj.weight": w(i, h, std=0.1), "mlp.up_proj.weight": w(i, h, std=0.1)}
        out |= _fused(p, mlp, "mlp.gate_up_proj", shape.linears)
        out[p + "mlp.down_proj.weight"] = w(h, i, std=0.1)
    out["model.norm.weight"] = norm(h)
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = w(v, h, std=0.1)
    return out


def write_tiny(
    out: Path,
    family: str = "llama",
    seed: int = 0,
    layers: int = 4,
    hidden: int = 64,
    shards: int = 1,
) -> Path:
    """Write a tiny random HF-layout model folder to ``out`` and return it."""
    if family not in TINY_FAMILIES:
        raise SpillError(f"unknown family {family!r}; use --family {'|'.join(TINY_FAMILIES)}")
    if hidden % 16 or hidden < 32 or layers < 1 or shards < 1:
        raise SpillError(
            "tiny models need --hidden a multiple of 16 (>= 32), --layers >= 1 and --shards >= 1"
        )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer_json()
    vocab = 256 + len(SPECIALS)
    cfg = _config(family, layers, hidden, vocab)
    tensors = _tensors(cfg, np.random.default_rng(seed))
    names = list(tensors)
    groups = [names[j::shards] for j in range(shards)] if shards > 1 else [names]
    weight_map = {}
    for j, group in enumerate(groups):
        fname = (
            "model.safetensors" if shards == 1 else f"model-{j + 1:05d}-of-{shards:05d}.safetensors"
        )
        write_file(
            out / fname,
            {n: ("BF16", float32_to_bf16_bits(tensors[n])) for n in group},
            {"format": "pt"},
        )
        weight_map.update({n: fname for n in group})
    if shards > 1:
        index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "tokenizer.json").write_text(tok)
    tok_cfg = {
        "chat_template": CHATML,
        "bos_token": SPECIALS[0],
        "eos_token": SPECIALS[2],
        "pad_token": SPECIALS[0],
        "model_max_length": 2048,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": [cfg["eos_token_id"], vocab - 3]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    (out / MARKER).unlink(missing_ok=True)  # a folder written again gets a fresh record
    # every file's sha256, as written; no stat keys, so the same arguments give the same bytes
    record(out, stat_cache=False, source="tiny", family=family, seed=seed)
    return out


def tiny_folder(spec: TinyName) -> Path:
    """Where the tiny model ``spec`` lives in the cache."""
    return models_dir() / "tiny" / safe_name(spec.name)


def generate_tiny(spec: TinyName, folder: Path) -> Path:
    """Write the tiny model ``spec`` and its cache record into ``folder`` (the same bytes on
    every machine)."""
    write_tiny(folder, spec.family, spec.seed, spec.layers, spec.hidden)
    write_marker(folder, name=spec.name, model_id=spec.name)
    return folder
