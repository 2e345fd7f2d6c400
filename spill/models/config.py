"""A model's architecture, read once from an HF ``config.json`` into a frozen dataclass.

Two families share one shape (RMSNorm, rotary attention with grouped KV heads, SwiGLU MLP):
Llama (SmolLM2, Llama 3.x) and Qwen2 (Qwen2.5, whose q/k/v projections carry biases).
transformers 5 writes ``rope_theta`` only inside ``rope_parameters``; both places are read.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from spill.errors import ModelError, UnsupportedModel

FAMILIES = ("llama", "qwen2")
# a decoder layer's linears, named as the HF weights below ``model.layers.<k>.`` (both families)
ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
LINEARS = ATTENTION + MLP  # every linear an adapter may target


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    qkv_bias: bool  # q/k/v projections have biases (always for Qwen2)
    o_bias: bool  # o_proj has a bias (Llama ``attention_bias``)
    mlp_bias: bool
    max_position_embeddings: int
    rope_scaling: tuple[tuple[str, float], ...] = ()  # llama3 scaling, as sorted (key, value)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # config.json "quantization" as sorted (module, bits, group_size); module "" is the default
    quantization: tuple[tuple[str, int, int], ...] = ()

    def quant_spec(self, module: str) -> tuple[int, int]:
        """(bits, group_size) of a quantized module (``model.layers.0.mlp.up_proj``)."""
        specs = {m: (b, g) for m, b, g in self.quantization}
        return specs.get(module, specs[""])

    @property
    def rope_scaling_dict(self) -> dict[str, float]:
        return dict(self.rope_scaling)

    def layer_keys(self) -> tuple[str, ...]:
        """Names of one decoder layer's tensors, relative to ``model.layers.<k>.``."""
        keys = ["input_layernorm.weight", "post_attention_layernorm.weight"]
        keys += [m + ".weight" for m in LINEARS]
        if self.qkv_bias:
            keys += [m + ".bias" for m in ATTENTION[:3]]
        if self.o_bias:
            keys.append("self_attn.o_proj.bias")
        if self.mlp_bias:
            keys += [m + ".bias" for m in MLP]
        return tuple(keys)

    def layer_params(self) -> int:
        """Number of parameters of one decoder layer."""
        h, i = self.hidden_size, self.intermediate_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        n = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h
        if self.qkv_bias:
            n += q + 2 * kv
        if self.o_bias:
            n += h
        if self.mlp_bias:
            n += 2 * i + h
        return n

    def to_dict(self) -> dict:
        return asdict(self)


def _rope(raw: dict) -> tuple[float, tuple[tuple[str, float], ...]]:
    params = raw.get("rope_parameters") or {}
    theta = raw.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = raw.get("rope_scaling") or (
        params if params.get("rope_type") not in (None, "default") else None
    )
    if not scaling:
        return float(theta), ()
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return float(theta), ()
    if kind != "llama3":
        raise UnsupportedModel(
            f"rope scaling {kind!r} is not supported; spill implements default and llama3 rotary embeddings"
        )
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return float(theta), tuple(sorted((k, float(scaling[k])) for k in keys))


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _quantization(entry, where: str) -> tuple[tuple[str, int, int], ...]:
    """mlx-lm's ``quantization`` (a default plus per-module entries) as sorted tuples."""
    if entry is None:
        return ()
    from spill.models.quant import module_spec

    if not isinstance(entry, dict):
        raise ModelError(f"{where}: quantization must be an object; re-import or re-quantize")
    if entry.get("mode", "affine") != "affine":
        raise UnsupportedModel(
            f"{where}: {entry['mode']} quantization is not supported; spill reads affine "
            "(mlx-lm's default) quantized models"
        )
    modules = [""] + sorted(k for k, v in entry.items() if isinstance(v, dict))
    specs = [(m, module_spec(entry, m, where)) for m in modules]  # "" reads the default
    return tuple((m, s.bits, s.group_size) for m, s in specs)


def parse_config(raw: dict, where: str = "config.json") -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        raise UnsupportedModel(
            f"{where}: model_type {model_type!r} is not supported; spill runs {', '.join(FAMILIES)} models (Qwen2.5, SmolLM2, Llama 3.x)"
        )
    try:
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        theta, scaling = _rope(raw)
        return ModelConfig(
            family=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            o_bias=model_type == "llama" and bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            rope_scaling=scaling,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_ids(raw.get("eos_token_id")),
            quantization=_quantization(raw.get("quantization"), where),
        )
    except KeyError as e:
        raise ModelError(
            f"{where}: missing key {e.args[0]!r}; the model folder's config.json is incomplete"
        ) from None
    except (ValueError, TypeError, ZeroDivisionError, AttributeError) as e:
        raise ModelError(
            f"{where}: a value of the wrong type ({str(e)[:80]}); re-download or re-import the model"
        ) from None


def load_config(folder: Path) -> ModelConfig:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ModelError(f"{path}: no config.json; point spill at an HF-layout model folder")
    try:
        raw = json.loads(path.read_bytes())
    except (UnicodeDecodeError, RecursionError) as e:
        raise ModelError(
            f"{path}: not UTF-8 JSON ({type(e).__name__}); re-download or re-import the model"
        ) from None
    except json.JSONDecodeError as e:
        raise ModelError(
            f"{path}: not valid JSON ({e.msg} at line {e.lineno}); re-download or re-import the model"
        ) from None
    if not isinstance(raw, dict):
        raise ModelError(f"{path}: not a JSON object; re-download or re-import the model")
    return parse_config(raw, str(path))
