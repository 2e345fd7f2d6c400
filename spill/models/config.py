"""A model's architecture, read once from an HF ``config.json`` into a frozen dataclass
(``load_config``, ``parse_config`` -> ``ModelConfig``).

Every family shares one shape (RMSNorm, rotary attention with grouped KV heads, SwiGLU MLP): Llama
(SmolLM2, Llama 3.x), Qwen2 (Qwen2.5), Qwen3, Mistral, SmolLM3, Gemma 3's text model
(``gemma3_text``), Phi-3 and Ministral 3's text model (``ministral3``). What differs is read once into fields the family files and kernels use
(``qk_norm``, ``no_rope``, ``windowed``, ``norm_offset``, ``embed_scale``, ``local_rope_theta``,
...).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from spill.errors import ModelError, UnsupportedModel
from spill.models.family_keys import (
    ATTENTION,
    EXPERTS,
    LINEARS,
    MLP,
    Inconsistent,
    expert_linears,
    gemma3,
    gemma3_rope,
    llama,
    ministral3,
    ministral3_rope,
    mistral,
    phi3,
    phi3_rope,
    qwen2,
    qwen3,
    qwen3_moe,
    rope,
    smollm3,
)
from spill.models.family_keys import FUSED as FUSED  # lora's, beside LINEARS


# Per family: Qwen2 (Qwen2.5: q/k/v biases), Qwen3 (per-head q/k RMSNorm before the rotary, an
# explicit ``head_dim``), Mistral (a sliding window on every layer when ``sliding_window`` is set),
# SmolLM3 (Llama with NoPE layers), Gemma 3 (norms as ``x * (offset + w)``, two more norms a layer,
# scaled embeddings and query, sliding layers with their own rotary base), Ministral 3 (Mistral
# with YaRN and position-dependent query scaling).
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
    qkv_bias: bool  # q/k/v projections have biases (Qwen2 always; others ``attention_bias``)
    o_bias: bool  # o_proj has a bias (``attention_bias`` of Llama, Qwen3, SmolLM3)
    mlp_bias: bool
    max_position_embeddings: int
    rope_scaling: tuple[tuple[str, float], ...] = ()  # llama3 scaling, as sorted (key, value)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # config.json "quantization" as sorted (module, bits, group_size); module "" is the default
    quantization: tuple[tuple[str, int, int], ...] = ()
    qk_norm: bool = False  # per-head q_norm / k_norm RMSNorm over head_dim, before the rotary
    no_rope: tuple[int, ...] = ()  # layers that apply no rotary embedding (SmolLM3's NoPE)
    sliding_window: int | None = None
    windowed: tuple[int, ...] = ()  # layers whose queries see only the last sliding_window keys
    linears: tuple[str, ...] = LINEARS  # a layer's linears, the modules an adapter may target
    partial_rotary_factor: float = 1.0  # the rotary turns the first head_dim * this of a head
    # longrope (Phi-3): inverse frequencies over short_factor, or over long_factor in a forward
    # whose positions reach past rope_original; cos and sin times rope_attention
    rope_short: tuple[float, ...] = ()
    rope_long: tuple[float, ...] = ()
    rope_original: int = 0  # also the length llama 4 query scaling counts positions in
    rope_attention: float = 1.0  # longrope's and YaRN's attention factor
    # Ministral 3 (llama 4 scaling): queries times 1 + query_beta * log(1 + floor(p / rope_original))
    query_beta: float = 0.0
    norm_offset: float = 0.0  # every RMSNorm scales by (norm_offset + w), in float32 when not 0
    embed_scale: float = 1.0  # embeddings times this, cast to the model's dtype first
    query_scale: float | None = None  # attention scores' scale; None: head_dim ** -0.5
    local_rope_theta: float | None = None  # the windowed layers' rotary base; None: rope_theta
    feedforward_norms: bool = False  # pre_/post_feedforward_layernorm around the MLP (Gemma)
    text_of: str | None = None  # the multimodal model_type (gemma3) whose text part this is
    # mixture of experts (Qwen3-MoE): the ``sparse`` layers route each token to
    # ``experts_per_token`` of ``experts`` SwiGLU experts ``expert_size`` wide (``mlp.gate`` the
    # router, top-k weights renormalized with ``norm_topk_prob``); the others have the dense MLP
    experts: int = 0
    experts_per_token: int = 0
    expert_size: int = 0
    norm_topk_prob: bool = False
    sparse: tuple[int, ...] = ()

    def quant_spec(self, module: str) -> tuple[int, int]:
        """(bits, group_size) of a quantized module (``model.layers.0.mlp.up_proj``)."""
        specs = {m: (b, g) for m, b, g in self.quantization}
        stacked = re.sub(r"\.mlp\.experts\.\d+\.", ".mlp.switch_mlp.", module)  # mlx-lm's name
        return specs.get(module, specs.get(stacked, specs[""]))

    @property
    def rope_scaling_dict(self) -> dict[str, float]:
        return dict(self.rope_scaling)

    @property
    def rope_kind(self) -> str:
        """How ``rope_scaling`` turns the inverse frequencies: "yarn" (its keys have beta_fast),
        "llama3", or "default" (none)."""
        if not self.rope_scaling:
            return "default"
        return "yarn" if "beta_fast" in self.rope_scaling_dict else "llama3"

    @property
    def rotary_dim(self) -> int:
        """How many of a head's leading features the rotary turns (transformers' ``dim``)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def largest_layer(self) -> int:
        """A layer with the most parameters: an MoE model's first sparse layer, as a rule."""
        first: dict[bool, int] = {}
        for i in range(self.num_hidden_layers):
            first.setdefault(i in self.sparse, i)
        return max(first.values(), key=self._layer_params)

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each of a layer's ``linears``, relative to ``model.layers.<k>.``."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        io = ((h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h))
        known = dict(zip(LINEARS, io, strict=True))
        known |= {"self_attn.qkv_proj": (h, q + 2 * kv), "mlp.gate_up_proj": (h, 2 * i)}
        return {m: known[m] for m in self.linears}

    def layer_linears(self, layer: int) -> dict[str, tuple[int, int]]:
        """(in, out) of every linear layer ``layer`` holds: ``linear_shapes``, and an MoE model's
        experts (``mlp.experts.<e>.gate_proj``) or dense MLP beside its attention."""
        io = self.linear_shapes()
        if not self.experts:
            return io
        if layer not in self.sparse:
            return io | replace(self, linears=LINEARS, experts=0).linear_shapes()
        h, e = self.hidden_size, self.expert_size
        io |= {"mlp.gate": (h, self.experts)}
        sizes = ((h, e), (h, e), (e, h))
        return io | dict(zip(expert_linears(self.experts), sizes * self.experts, strict=True))

    def layer_shapes(
        self, layer: int | None = None, routed: bool = True
    ) -> dict[str, tuple[int, ...]]:
        """Decoder layer ``layer``'s tensors (None: the largest's), relative to
        ``model.layers.<k>.``, with their shapes; without the routed experts unless ``routed``."""
        h, d = self.hidden_size, self.head_dim
        io = self.layer_linears(self.largest_layer if layer is None else layer)
        shapes = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
        shapes |= {m + ".weight": (o, n) for m, (n, o) in io.items()}
        biased = [
            (ATTENTION[:3], self.qkv_bias),
            (ATTENTION[3:], self.o_bias),
            (MLP, self.mlp_bias),
        ]
        shapes |= {m + ".bias": (io[m][1],) for g, on in biased if on for m in g if m in io}
        if self.qk_norm:
            shapes |= {"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}
        if self.feedforward_norms:
            shapes |= {f"{k}_feedforward_layernorm.weight": (h,) for k in ("pre", "post")}
        if not routed:
            return {k: s for k, s in shapes.items() if not k.startswith(EXPERTS)}
        return shapes

    def layer_keys(self, layer: int | None = None, routed: bool = True) -> tuple[str, ...]:
        """Names of decoder layer ``layer``'s tensors (None: the largest's), relative to
        ``model.layers.<k>.``; without the routed experts unless ``routed``."""
        return tuple(self.layer_shapes(layer, routed))

    def layer_params(self, layer: int | None = None, routed: bool = True) -> int:
        """Number of parameters of decoder layer ``layer`` (None: the largest)."""
        return self._layer_params(self.largest_layer if layer is None else layer, routed)

    def _layer_params(self, layer: int, routed: bool = True) -> int:
        shapes = self.layer_shapes(layer, routed).values()
        return sum(math.prod(shape) for shape in shapes)

    def model_params(self) -> int:
        """Parameters of every decoder layer together."""
        return sum(self._layer_params(i) for i in range(self.num_hidden_layers))

    def to_dict(self) -> dict:
        return asdict(self)


# A family's ``read`` (in ``models/family_keys``) turns its config.json keys into the fields the way
# transformers' config class does, defaults included. transformers 5 writes ``rope_theta`` only
# inside ``rope_parameters`` (nested per layer type for some families); both places are read.
@dataclass(frozen=True)
class Family:
    """A family's defaults where its config.json may be silent, and its own keys' reading."""

    examples: str  # the models people know it by, for messages
    read: Callable[[dict, int], dict]  # (config.json, layers) -> the ModelConfig fields it sets
    default_theta: float = 10000.0
    default_head_dim: int | None = None  # None: hidden_size // num_attention_heads
    default_tied: bool = False
    rope: Callable[[dict, float], tuple[float, tuple]] = rope  # (theta, scaling) of full layers


FAMILIES: dict[str, Family] = {
    "llama": Family("SmolLM2, Llama 3.x", llama),
    "qwen2": Family("Qwen2.5", qwen2),
    "qwen3": Family("Qwen3 dense", qwen3, default_head_dim=128),
    "qwen3_moe": Family("Qwen3-MoE", qwen3_moe),  # head_dim: hidden // heads unless given
    "mistral": Family("Mistral", mistral),
    "smollm3": Family("SmolLM3", smollm3, default_theta=2000000.0, default_tied=True),
    "gemma3_text": Family(
        "Gemma 3 text", gemma3, 1000000.0, 256, default_tied=True, rope=gemma3_rope
    ),
    "phi3": Family("Phi-3, Phi-4-mini", phi3, rope=phi3_rope),
    "ministral3": Family("Ministral 3 text", ministral3, 1000000.0, 128, rope=ministral3_rope),
}
# multimodal model_types whose text part spill runs (its text_config; the weights under
# models/weights.TEXT_PREFIXES), the vision tower left aside
TEXT_PART = {"gemma3": "gemma3_text", "mistral3": "ministral3"}


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


def text_config(raw: dict, where: str = "config.json") -> dict:
    """A multimodal config.json's text model as its own config.json (``text_config``, with the
    top level's tied head and quantization where it alone has them); a text model's as it is."""
    model_type = raw.get("model_type")
    if model_type not in TEXT_PART:
        return raw
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ModelError(
            f"{where}: model_type {model_type!r} without a text_config object; the model "
            "folder's config.json is incomplete"
        )
    top = {k: raw[k] for k in ("tie_word_embeddings", "quantization") if k in raw}
    own = text.get("model_type")  # a mistral3 folder's text is ministral3 or mistral
    return top | text | {"model_type": own if own in FAMILIES else TEXT_PART[model_type]}


def parse_config(raw: dict, where: str = "config.json") -> ModelConfig:
    model_type = raw.get("model_type")
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if model_type in TEXT_PART:
        return replace(parse_config(text_config(raw, where), where), text_of=model_type)
    if family is None:
        known = "; ".join(f"{n} ({f.examples})" for n, f in FAMILIES.items())
        raise UnsupportedModel(
            f"{where}: model_type {model_type!r} is not supported; spill runs {known} models"
        )
    try:
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        layers = int(raw["num_hidden_layers"])
        theta, scaling = family.rope(raw, family.default_theta)
        head_dim = raw.get("head_dim") or family.default_head_dim or hidden // heads
        return ModelConfig(
            family=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", family.default_tied)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            rope_scaling=scaling,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_ids(raw.get("eos_token_id")),
            quantization=_quantization(raw.get("quantization"), where),
            **family.read(raw, layers),
        )
    except Inconsistent as e:
        raise ModelError(f"{where}: {e}; the model folder's config.json is inconsistent") from None
    except KeyError as e:
        raise ModelError(
            f"{where}: missing key {e.args[0]!r}; the model folder's config.json is incomplete"
        ) from None
    except (ValueError, TypeError, ZeroDivisionError, AttributeError, IndexError) as e:
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
