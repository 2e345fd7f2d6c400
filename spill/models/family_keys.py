"""config.json's keys as each family's transformers config class derives them: the rotary
sets (``rope_parameters``, one or one per layer type, and the older ``rope_theta`` /
``rope_scaling`` keys), the sliding-window layers, and every family's ``read`` (its keys ->
the ``ModelConfig`` fields it sets), which ``models/config.FAMILIES`` names.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from spill.errors import UnsupportedModel

# a decoder layer's linears, named as the HF weights below ``model.layers.<k>.`` (every family)
ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
LINEARS = ATTENTION + MLP  # every linear an adapter may target (the default ModelConfig.linears)
# Phi-3's fused linears: q, k and v in one matrix (rows in that order), gate and up in one
FUSED = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


EXPERTS = "mlp.experts."  # an MoE layer's routed experts' names begin so, below the layer
EXPERT_LINEARS = ("gate_proj", "up_proj", "down_proj")  # each expert's, in its SwiGLU order


def expert_linears(experts: int) -> tuple[str, ...]:
    """An MoE layer's expert linears by their hub names (``mlp.experts.<e>.gate_proj``)."""
    return tuple(f"{EXPERTS}{e}.{p}" for e in range(experts) for p in EXPERT_LINEARS)


def rope_parameters(raw: dict) -> dict:
    """transformers 5's ``rope_parameters``: one set, or one per layer type (all equal here)."""
    params = raw.get("rope_parameters") or {}
    if params and all(isinstance(v, dict) for v in params.values()):  # keyed by layer type
        sets = list(params.values())
        if any(p != sets[0] for p in sets):
            raise UnsupportedModel(
                f"rotary parameters that differ by layer type ({', '.join(params)}) are not "
                "supported; spill runs one rotary embedding for every layer"
            )
        params = sets[0]
    return params


def rope(raw: dict, default_theta: float) -> tuple[float, tuple[tuple[str, float], ...]]:
    params = rope_parameters(raw)
    theta = raw.get("rope_theta", params.get("rope_theta", default_theta))
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


# -- the families: what each one's config class derives from its config.json keys -------------


class Inconsistent(Exception):
    """config.json's keys contradict each other (a per-layer list shorter than the layers)."""


def sliding_layers(raw: dict, layers: int, sliding: Callable[[int], bool]) -> dict:
    """``sliding_window`` and the layers it applies to: ``layer_types`` when config.json lists
    them, else ``sliding(i)``; none without a window."""
    window = raw.get("sliding_window")
    if window is None:
        return {}
    types = raw.get("layer_types")
    if types is not None and len(types) < layers:
        raise Inconsistent(f"layer_types lists {len(types)} layers for {layers}")
    chosen = [
        types[i] == "sliding_attention" if types is not None else sliding(i) for i in range(layers)
    ]
    return {"sliding_window": int(window), "windowed": tuple(i for i in range(layers) if chosen[i])}


def llama(raw: dict, layers: int) -> dict:
    bias = bool(raw.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": bool(raw.get("mlp_bias", False))}


def qwen_window(raw: dict, layers: int) -> dict:
    """Qwen2/Qwen3: a window only with ``use_sliding_window``, on layers from ``max_window_layers``."""
    if not raw.get("use_sliding_window", False):
        return {}
    first = int(raw.get("max_window_layers", 28))
    return sliding_layers(raw, layers, lambda i: i >= first)


def qwen2(raw: dict, layers: int) -> dict:
    return {"qkv_bias": True, "o_bias": False, "mlp_bias": False} | qwen_window(raw, layers)


def qwen3(raw: dict, layers: int) -> dict:
    bias = bool(raw.get("attention_bias", False))
    found = {"qkv_bias": bias, "o_bias": bias, "mlp_bias": False, "qk_norm": True}
    return found | qwen_window(raw, layers)


def qwen3_moe(raw: dict, layers: int) -> dict:
    """Qwen3-MoE: Qwen3's attention; a layer routes each token to ``num_experts_per_tok`` of
    ``num_experts`` SwiGLU experts (``moe_intermediate_size`` wide) unless it is in
    ``mlp_only_layers`` or not every ``decoder_sparse_step``-th (a dense MLP then). ``linears``
    is the attention, which every layer has; adapters go on the experts only when asked
    (``models/lora``)."""
    experts = int(raw.get("num_experts", raw.get("num_local_experts", 128)))
    step, dense = int(raw.get("decoder_sparse_step", 1)), set(raw.get("mlp_only_layers") or ())
    top = int(raw.get("num_experts_per_tok", 8))
    if experts > 0 and not 0 < top <= experts:
        raise Inconsistent(f"num_experts_per_tok is {top} for {experts} experts")
    sparse = tuple(
        i for i in range(layers) if experts > 0 and i not in dense and (i + 1) % step == 0
    )
    found = qwen3(raw, layers) | {"linears": ATTENTION, "sparse": sparse}
    return found | {
        "experts": experts,
        "experts_per_token": top,
        "expert_size": int(raw.get("moe_intermediate_size", 768)),
        "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
    }


def mistral(raw: dict, layers: int) -> dict:
    # every layer slides when a window is set; Mistral's attention ignores ``layer_types``
    window = raw.get("sliding_window")
    found = {"qkv_bias": False, "o_bias": False, "mlp_bias": False}
    if window is None:
        return found
    return found | {"sliding_window": int(window), "windowed": tuple(range(layers))}


def smollm3(raw: dict, layers: int) -> dict:
    """Llama with NoPE layers: ``no_rope_layers`` (1 = rotary, 0 = none, at least one entry a
    layer), else every ``no_rope_layer_interval``-th layer has none."""
    flags = raw.get("no_rope_layers")
    if flags is None:
        every = int(raw.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % every != 0) for i in range(layers)]
    if len(flags) < layers:
        raise Inconsistent(f"no_rope_layers lists {len(flags)} layers for {layers}")
    found = llama(raw, layers) | {"no_rope": tuple(i for i in range(layers) if not flags[i])}
    if not raw.get("use_sliding_window", False):
        return found
    return found | sliding_layers(raw, layers, lambda i: not flags[i])


def gemma3_rope_sets(raw: dict, default_theta: float) -> tuple[dict, dict]:
    """Gemma 3's rotary sets (full layers, sliding layers) as Gemma3TextConfig derives them:
    ``rope_parameters`` per layer type, else ``rope_theta`` and ``rope_scaling`` for the full
    layers and ``rope_local_base_freq`` for the sliding ones."""
    params = raw.get("rope_parameters") or {}
    nested = params and all(isinstance(v, dict) for v in params.values())
    full = dict((params.get("full_attention") if nested else params) or {})
    local = dict((params.get("sliding_attention") if nested else None) or {})
    full.update(raw.get("rope_scaling") or {})
    full.setdefault("rope_theta", raw.get("rope_theta", default_theta))
    local.setdefault("rope_theta", raw.get("rope_local_base_freq", 10000.0))
    return full, local


def gemma3_rope(raw: dict, default_theta: float) -> tuple[float, tuple[tuple[str, float], ...]]:
    """The full (global) layers' rotary embedding."""
    return rope({"rope_parameters": gemma3_rope_sets(raw, default_theta)[0]}, default_theta)


def gemma3(raw: dict, layers: int) -> dict:
    """Gemma 3 text: ``layer_types`` or every ``sliding_window_pattern``-th layer full (6), the
    others within ``sliding_window`` (4096) on their own rotary base; queries scaled by
    ``query_pre_attn_scalar`` ** -0.5; embeddings by sqrt(hidden); norms (1 + w)."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if raw.get(key) is not None:
            raise UnsupportedModel(f"gemma3_text with {key} is not supported; spill caps no logits")
    if raw.get("use_bidirectional_attention") or raw.get(
        "hidden_activation", "gelu_pytorch_tanh"
    ) not in (
        "gelu_pytorch_tanh",
        "gelu_tanh",
    ):
        raise UnsupportedModel(
            "gemma3_text with bidirectional attention or another hidden_activation than "
            "gelu_pytorch_tanh is not supported; spill runs the causal Gemma 3 text models"
        )
    _, local = gemma3_rope_sets(raw, 1000000.0)
    if local.get("rope_type", "default") != "default":
        raise UnsupportedModel(
            f"rope scaling {local['rope_type']!r} on sliding layers is not supported; spill "
            "scales the full layers' rotary only"
        )
    every = int(raw.get("sliding_window_pattern", 6))
    window = raw.get("sliding_window", 4096)  # Gemma3TextConfig's default when absent
    found = sliding_layers(
        {**raw, "sliding_window": window}, layers, lambda i: (i + 1) % every != 0
    )
    return (
        llama(raw, layers)
        | {"mlp_bias": False, **found}
        | {
            "qk_norm": True,
            "norm_offset": 1.0,
            "embed_scale": int(raw["hidden_size"]) ** 0.5,
            "query_scale": float(raw.get("query_pre_attn_scalar", 256)) ** -0.5,
            "local_rope_theta": float(local["rope_theta"]),
            "feedforward_norms": True,
        }
    )


def phi3_rope_set(raw: dict) -> dict:
    """Phi3Config's rotary set: ``rope_scaling`` or ``rope_parameters``; "su" and "yarn" are
    its old names of longrope."""
    params = dict(raw.get("rope_scaling") or rope_parameters(raw))
    kind = params.get("rope_type", params.get("type")) or "default"
    params["rope_type"] = "longrope" if kind in ("su", "yarn") else kind
    if params["rope_type"] not in ("default", "longrope"):
        raise UnsupportedModel(f"phi3 with rope scaling {kind!r}; Phi-3 has default or longrope")
    return params


def phi3_rope(raw: dict, default_theta: float) -> tuple[float, tuple[tuple[str, float], ...]]:
    """The base only: longrope's factors are ``phi3``'s fields."""
    theta = raw.get("rope_theta", phi3_rope_set(raw).get("rope_theta", default_theta))
    return float(theta), ()


def phi3(raw: dict, layers: int) -> dict:
    """Phi-3 / Phi-4-mini: fused qkv_proj and gate_up_proj, no biases, a window on every layer
    when ``sliding_window`` is set, partial rotary, longrope as transformers derives it
    (``original_max_position_embeddings`` from the top level, 4096 when absent; the attention
    factor from max / original unless given)."""
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"phi3 with hidden_act {raw['hidden_act']!r}; spill runs silu")
    params = phi3_rope_set(raw)
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    found = mistral(raw, layers) | {"linears": FUSED, "partial_rotary_factor": float(partial)}
    if params["rope_type"] == "default":
        return found
    original = int(raw.get("original_max_position_embeddings", 4096))
    factor = params.get("factor") or int(raw.get("max_position_embeddings", 4096)) / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    short, long = (tuple(float(f) for f in params[k]) for k in ("short_factor", "long_factor"))
    half = int(raw["hidden_size"]) // int(raw["num_attention_heads"]) * float(partial) // 2
    if len(short) != half or len(long) != half:
        raise Inconsistent(
            f"longrope lists {len(short)} short and {len(long)} long factors for {half:.0f}"
        )
    return found | {
        "rope_short": short,
        "rope_long": long,
        "rope_original": original,
        "rope_attention": float(attention),
    }


# Ministral3Config's rotary set when config.json has none
MINISTRAL3_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 1000000.0,
    "factor": 16.0,
    "original_max_position_embeddings": 16384,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale_all_dim": 1.0,
    "mscale": 1.0,
    "llama_4_scaling_beta": 0.1,
}


def ministral3_rope_set(raw: dict) -> dict:
    """Ministral3Config's rotary set as transformers standardizes it: ``rope_parameters`` (its
    YaRN default when absent), ``type`` an old name of ``rope_type``, YaRN's original length
    ``max_position_embeddings`` when not given."""
    params = dict(rope_parameters(raw) or MINISTRAL3_ROPE)
    params.setdefault("rope_type", params.get("type") or "default")
    if params["rope_type"] not in ("default", "yarn"):
        raise UnsupportedModel(
            f"ministral3 with rope scaling {params['rope_type']!r}; spill runs its yarn and default"
        )
    if params["rope_type"] == "yarn":
        original = raw.get("max_position_embeddings", 262144)
        params.setdefault("original_max_position_embeddings", original)
    return params


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def ministral3_rope(raw: dict, default_theta: float) -> tuple[float, tuple[tuple[str, float], ...]]:
    """The base and YaRN's keys (none for the default rotary), as ``_compute_yarn_parameters``
    reads them: ``factor`` from max / original when null, beta_fast 32 and beta_slow 1 when
    null, ``truncate`` true unless given."""
    params = ministral3_rope_set(raw)
    theta = float(params.get("rope_theta", raw.get("rope_theta", default_theta)))
    if params["rope_type"] == "default":
        return theta, ()
    original = float(params["original_max_position_embeddings"])
    factor = params.get("factor") or int(raw.get("max_position_embeddings", 262144)) / original
    found = {
        "factor": float(factor),
        "original_max_position_embeddings": original,
        "beta_fast": float(params.get("beta_fast") or 32),
        "beta_slow": float(params.get("beta_slow") or 1),
        "truncate": float(bool(params.get("truncate", True))),
    }
    return theta, tuple(sorted(found.items()))


def ministral3(raw: dict, layers: int) -> dict:
    """Ministral 3 text: Mistral's layer, YaRN's attention factor on cos and sin, and queries
    times ``1 + llama_4_scaling_beta * log(1 + floor(position / original))`` after the rotary
    (``original_max_position_embeddings`` of ``rope_parameters``; transformers needs both)."""
    params = ministral3_rope_set(raw)
    beta, original = (
        params.get(k) for k in ("llama_4_scaling_beta", "original_max_position_embeddings")
    )
    if beta is None or original is None:
        raise UnsupportedModel(
            "ministral3 without llama_4_scaling_beta and original_max_position_embeddings in "
            "rope_parameters; transformers' Ministral3 needs both: add them to config.json"
        )
    found = mistral(raw, layers) | {"query_beta": float(beta), "rope_original": int(original)}
    if params["rope_type"] == "default":
        return found
    factor = dict(ministral3_rope(raw, 0.0)[1])["factor"]
    attention = params.get("attention_factor")
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention is None and mscale and all_dim:
        attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
    elif attention is None:
        attention = yarn_mscale(factor)
    return found | {"rope_attention": float(attention)}
