"""llama.cpp's GGUF architectures that spill reads and writes, as one table both ways (``ARCHES`` of
``Arch``; ``WRITTEN_AS``: the architecture each spill family is written as).

An ``Arch`` says what a GGUF of that architecture holds beyond a Llama's tensors, the way
llama.cpp's ``convert_hf_to_gguf.py`` writes it and its loader reads it. Mistral is written as
``llama`` (without a sliding window), so its GGUF imports as a Llama. Phi-3's longrope is what
``convert_hf_to_gguf.py`` writes for it: ``rope_factors_long/short`` (``LONGROPE``) beside the
original context length and the attention factor, read back into the config.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GLOBAL = {  # GGUF tensor -> HF name
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER = {  # GGUF per-layer tensor -> HF name under model.layers.{i}.
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
BIASES = {  # a Qwen2's: llama.cpp keeps them F32
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}
QK_NORMS = {  # a Qwen3's, over head_dim
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
GEMMA_NORMS = {  # a Gemma 3's norms around attention and MLP; its ffn_norm is the pre-MLP one
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
FUSED = {  # a Phi-3's: q, k, v rows in one matrix; ffn_up holds gate's rows, then up's
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}
ROUTED = {  # a Qwen3-MoE's: the router, and each projection of every expert stacked (E, out, in)
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj.weight",
}
LONGROPE = ("rope_factors_long.weight", "rope_factors_short.weight")  # F32, (rotary dims / 2,)
_SPLIT = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "ffn_gate.weight", "ffn_up.weight")
_DENSE = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(\w+)\.weight")  # one expert's projection


def stacked(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """A layer's tensors (``ModelConfig.layer_shapes``) with its experts' projections stacked
    as ``ROUTED`` names them (``mlp.experts.gate_proj.weight``: (experts, out, in)), in place of
    the first expert's; a dense layer's as they are."""
    count = 1 + max((int(m[1]) for k in shapes if (m := EXPERT.fullmatch(k))), default=-1)
    out = {}
    for k, shape in shapes.items():
        m = EXPERT.fullmatch(k)
        if m is None:
            out[k] = shape
        elif m[1] == "0":
            out[f"mlp.experts.{m[2]}.weight"] = (count, *shape)
    return out


# What an architecture holds: whether attn_q/attn_k rows are interleaved for its rotary
# (``permute``: llama.cpp's NORM rope; NEOX families such as Qwen keep HF's halves), q/k/v biases
# (Qwen2), per-head q/k norms (Qwen3's attn_q_norm / attn_k_norm), Phi-3's fused attn_qkv and
# gate+up ffn_up with a partial rotary (``rope.dimension_count``) and longrope (``LONGROPE``, with
# ``rope.scaling.original_context_length`` and ``rope.scaling.attn_factor``), and llama.cpp's NoPE step
# (SmolLM3: every fourth layer has no rotary, a step llama.cpp fixes in code and reads from no key).
# Gemma 3 (``gemma3``) stores every norm as llama.cpp multiplies by it, (1 + w) for HF's w
# (``norm_shift``), has four norms a block (its ``ffn_norm`` is the pre-feedforward one) and fixes
# in code what its config.json says in keys: with a ``sliding_window`` every sixth layer attends to
# all keys and the others slide on a rotary base of 10000 (``swa_step``, ``swa_rope_base``), queries
# are scaled by head_dim ** -0.5 except at 62 blocks (the 27B: (hidden // heads) ** -0.5,
# ``wide_query_layers``), embeddings by sqrt(hidden). Ministral 3 (``mistral3``) is a Llama with
# YaRN (``rope.scaling.*``; ``yarn_log_multiplier`` is transformers' ``mscale_all_dim`` beside an
# ``mscale`` of 1) and llama 4's query temperature (``attention.temperature_scale``, counted in
# the original context length). Qwen3-MoE (``qwen3moe``) routes every layer: the router
# ``ffn_gate_inp`` and each expert projection stacked (``ffn_gate_exps``, ``ROUTED``) in place of
# the dense MLP, with ``expert_count``, ``expert_used_count`` and ``expert_feed_forward_length``.
@dataclass(frozen=True)
class Arch:
    family: str  # the model_type its GGUF imports as
    architecture: str  # config.json's architectures entry
    permute: bool  # attn_q/attn_k rows interleaved for llama.cpp's NORM rotary
    biases: bool = False  # attn_q/attn_k/attn_v biases
    qk_norm: bool = False  # attn_q_norm / attn_k_norm
    no_rope_step: int = 0  # every no_rope_step-th layer has no rotary (llama.cpp's fixed step)
    bias_keys: bool = True  # config.json says attention_bias/mlp_bias (Qwen2's class has none)
    fused: bool = False  # attn_qkv and a gate+up ffn_up in place of the five split matrices
    partial_rotary: bool = False  # rope.dimension_count may be less than the head size
    longrope: bool = False  # rope_factors_long/short, the original context, the attention factor
    activation: tuple[str, str] = ("hidden_act", "silu")  # config.json's key and value
    norm_shift: float = 0.0  # every *norm.weight is stored as norm_shift + w (Gemma's 1 + w)
    feedforward_norms: bool = False  # post_attention_norm, ffn_norm (pre-MLP), post_ffw_norm
    swa_step: int = 0  # with a window, every swa_step-th layer attends to all keys
    swa_rope_base: float = 0.0  # the sliding layers' rotary base, fixed in llama.cpp's code
    scaled_query: bool = False  # queries scaled by query_pre_attn_scalar ** -0.5 (Gemma)
    wide_query_layers: int = 0  # at this many blocks the scalar is hidden // heads, not head_dim
    yarn: bool = False  # YaRN rope scaling (its factor, betas, original length, log multiplier)
    temperature: bool = False  # queries times 1 + scale * log(1 + floor(p / original length))
    experts: bool = False  # every layer routed: ffn_gate_inp and stacked ffn_*_exps (``ROUTED``)

    def layer_names(self) -> dict[str, str]:
        """GGUF per-layer tensor -> HF name under ``model.layers.{i}.``."""
        names = {k: v for k, v in LAYER.items() if k not in _SPLIT} | FUSED if self.fused else LAYER
        names = names | (BIASES if self.biases else {}) | (QK_NORMS if self.qk_norm else {})
        if self.experts:
            names = {k: v for k, v in names.items() if k not in _DENSE} | ROUTED
        return names | (GEMMA_NORMS if self.feedforward_norms else {})

    def no_rope(self, layers: int) -> tuple[int, ...]:
        """The layers llama.cpp runs without a rotary."""
        step = self.no_rope_step
        return tuple(i for i in range(layers) if step and (i + 1) % step == 0)

    def windowed(self, layers: int) -> tuple[int, ...]:
        """The layers llama.cpp runs within the sliding window, when the GGUF gives one."""
        step = self.swa_step
        return tuple(i for i in range(layers) if step and (i + 1) % step != 0)

    def query_pre_attn_scalar(self, hidden: int, heads: int, head_dim: int, layers: int):
        """The query_pre_attn_scalar llama.cpp's scale amounts to; None where queries are
        scaled by head_dim ** -0.5 with no key for it."""
        if not self.scaled_query:
            return None
        return hidden // heads if layers == self.wide_query_layers else head_dim

    def config_keys(self, layers: int, hidden: int, heads: int, head_dim: int, window: int) -> dict:
        """config.json keys beyond the shared ones, as this family's config class reads them;
        ``window`` is the GGUF's sliding_window (0: none)."""
        keys = {"attention_bias": False, "mlp_bias": False} if self.bias_keys else {}
        keys[self.activation[0]] = self.activation[1]
        if self.no_rope_step:
            skip = self.no_rope(layers)
            keys |= {
                "no_rope_layers": [int(i not in skip) for i in range(layers)],
                "no_rope_layer_interval": self.no_rope_step,
                "use_sliding_window": False,
            }
        if self.swa_step:
            slide = self.windowed(layers) if window else ()
            types = ["sliding_attention" if i in slide else "full_attention" for i in range(layers)]
            keys |= {"layer_types": types, "rope_local_base_freq": self.swa_rope_base}
            keys |= {"sliding_window": window} if window else {}
        if self.scaled_query:
            scalar = self.query_pre_attn_scalar(hidden, heads, head_dim, layers)
            keys["query_pre_attn_scalar"] = scalar
        return keys


ARCHES = {
    "llama": Arch("llama", "LlamaForCausalLM", permute=True),
    "qwen2": Arch("qwen2", "Qwen2ForCausalLM", False, biases=True, bias_keys=False),
    "qwen3": Arch("qwen3", "Qwen3ForCausalLM", permute=False, qk_norm=True),
    "qwen3moe": Arch("qwen3_moe", "Qwen3MoeForCausalLM", permute=False, qk_norm=True, experts=True),
    "smollm3": Arch("smollm3", "SmolLM3ForCausalLM", permute=True, no_rope_step=4),
    "phi3": Arch(
        "phi3",
        "Phi3ForCausalLM",
        False,
        bias_keys=False,
        fused=True,
        partial_rotary=True,
        longrope=True,
    ),
    "gemma3": Arch(
        "gemma3_text",
        "Gemma3ForCausalLM",
        permute=False,
        qk_norm=True,
        activation=("hidden_activation", "gelu_pytorch_tanh"),
        norm_shift=1.0,
        feedforward_norms=True,
        swa_step=6,
        swa_rope_base=10000.0,
        scaled_query=True,
        wide_query_layers=62,
    ),
    "mistral3": Arch(
        "ministral3", "Ministral3ForCausalLM", permute=True, yarn=True, temperature=True
    ),
}
# spill family -> the llama.cpp architecture its GGUF is written as
# Mistral is written as ``llama``, as llama.cpp converts it (without a sliding window, which
# llama.cpp's llama does not run), so its GGUF imports as a Llama.
WRITTEN_AS = {a.family: name for name, a in ARCHES.items()} | {"mistral": "llama"}
