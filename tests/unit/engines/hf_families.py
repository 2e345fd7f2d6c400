"""Small random models of the Qwen3, Mistral, SmolLM3, Gemma 3 (text), Phi-3 and Ministral 3
families, made and saved by transformers itself (``XxxForCausalLM(XxxConfig(...))``, ``save_pretrained``), with the
tiny llama's tokenizer.

Each variant shows what its family adds: Qwen3 an explicit ``head_dim`` (not hidden / heads),
per-head q/k norms and, in ``qwen3-windowed``, ``attention_bias`` and sliding layers from
``max_window_layers``; Mistral a ``sliding_window`` shorter than the test sequences; SmolLM3 a
NoPE layer between rotary ones; Ministral 3 YaRN and query scaling past its original 16
positions; and Qwen2's ``use_sliding_window``, which spill now honours too.
``MLX_LM`` names a variant of each family that mlx-lm runs as transformers does, and
``for_mlx_lm`` adds the config.json keys mlx-lm reads; ``STORED`` each family in bfloat16 shards
with its head tied the other way. ``make_vision`` wraps the Gemma 3 text
model in a ``gemma3`` (vision) folder. Weights are drawn wider than transformers' initializer and every norm weight is moved off 1, so
greedy picks are clear and the q/k norm weights matter.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

SHAPE = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=112,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=256,
    eos_token_id=258,
    pad_token_id=256,
    initializer_range=0.1,
)
LONGROPE = {"short_factor": [1.0, 1.3, 2.0, 3.5], "long_factor": [1.5, 4.0, 9.0, 20.0]}
PHI3 = dict(
    partial_rotary_factor=0.5,
    rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, **LONGROPE},
)
# Ministral 3: YaRN over an original length of 16 (factor 4; its attention factor from the
# factor, or from mscale / mscale_all_dim), so the test rows' positions past 16 turn by the ramp
# and their queries are scaled by 1 + beta * log(1 + floor(p / 16))
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0}
YARN |= {"beta_slow": 1.0, "original_max_position_embeddings": 16, "llama_4_scaling_beta": 0.3}
VARIANTS = {
    "qwen3": ("Qwen3", dict(num_hidden_layers=3, head_dim=24, tie_word_embeddings=False)),
    "qwen3-windowed": (
        "Qwen3",
        dict(
            num_hidden_layers=3,
            head_dim=32,
            attention_bias=True,
            use_sliding_window=True,
            sliding_window=6,
            max_window_layers=1,
            tie_word_embeddings=True,
        ),
    ),
    "mistral": ("Mistral", dict(num_hidden_layers=2, sliding_window=7, rope_theta=5000.0)),
    "qwen2-windowed": (
        "Qwen2",
        dict(num_hidden_layers=2, use_sliding_window=True, sliding_window=6, max_window_layers=1),
    ),
    "smollm3": ("SmolLM3", dict(num_hidden_layers=3, no_rope_layers=[1, 0, 1])),
    # Gemma 3 text: a full layer between sliding ones (window 6, each type its own rotary base),
    # query_pre_attn_scalar apart from head_dim, the tied head
    "gemma3": (
        "Gemma3",
        dict(
            num_hidden_layers=3,
            head_dim=24,
            query_pre_attn_scalar=20,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
    ),
    # Phi-3: fused qkv/gate_up, half the head rotated, longrope; "phi3-long" pretrained on 16
    # positions, so longer forwards turn by the long factors (and a window of 7, a tied head)
    "phi3": ("Phi3", dict(num_hidden_layers=2, original_max_position_embeddings=64, **PHI3)),
    "phi3-long": (
        "Phi3",
        dict(
            num_hidden_layers=3,
            original_max_position_embeddings=16,
            sliding_window=7,
            tie_word_embeddings=True,
            **PHI3,
        ),
    ),
    "ministral3": ("Ministral3", dict(num_hidden_layers=2, head_dim=24, rope_parameters=YARN)),
    "ministral3-windowed": (
        "Ministral3",
        dict(
            num_hidden_layers=2,
            head_dim=16,
            sliding_window=7,
            tie_word_embeddings=True,
            rope_parameters=YARN | {"mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 8.0},
        ),
    ),
}
# Qwen3-MoE (issue 41): routed experts beside a dense layer (``mlp_only_layers``), top-k weights
# renormalized; and every other layer sparse (``decoder_sparse_step`` 2) with biased attention,
# top 3 of 6 as they come out of the softmax. Apart from VARIANTS: llama.cpp's qwen3moe takes
# neither (tests/func/test_export_moe.py), and the dense families' tests run over VARIANTS.
MOE = {
    "qwen3_moe": (
        "Qwen3Moe",
        dict(
            num_hidden_layers=3,
            head_dim=24,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
        ),
    ),
    "qwen3_moe-step": (
        "Qwen3Moe",
        dict(
            num_hidden_layers=2,
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            decoder_sparse_step=2,
            attention_bias=True,
            tie_word_embeddings=True,
        ),
    ),
}
# what mlx-lm (0.32) runs as transformers does, each family once: its llama.py has no layer that
# slides without a full one (so Mistral comes without a window) and its qwen3.py no biases;
# "phi3-long" turns by the long factors past its original length of 16, where mlx-lm turns by them
# at every length (so the two agree on rows past 16 tokens only)
MLX_LM = {
    "qwen3": VARIANTS["qwen3"],
    "mistral-full": ("Mistral", dict(num_hidden_layers=2, sliding_window=None, rope_theta=5000.0)),
    "smollm3": VARIANTS["smollm3"],
    "gemma3": VARIANTS["gemma3"],
    "phi3-half": ("Phi3", dict(num_hidden_layers=2, partial_rotary_factor=0.5)),
    "phi3-long": (
        "Phi3",
        dict(
            num_hidden_layers=3,
            original_max_position_embeddings=16,
            tie_word_embeddings=True,
            **PHI3,
        ),
    ),
    "ministral3": VARIANTS["ministral3"],
}
# each family once more, stored as people download it: bfloat16, in several shards, with the head
# tied the other way from its VARIANTS entry (Mistral tied, SmolLM3 and Gemma 3 untied: ties no
# float32 variant has); make(..., dtype="bfloat16", max_shard_size=SHARD)
TIES = {"qwen3": True, "mistral": True, "smollm3": False, "gemma3": False}
TIES |= {"phi3": True, "ministral3": True}
STORED = {
    v: (VARIANTS[v][0], {**VARIANTS[v][1], "tie_word_embeddings": t}) for v, t in TIES.items()
}
SHARD = "40KB"  # the bfloat16 embedding alone is 40 KiB: 6-10 files a model
CONFIGS = {"Gemma3": "Gemma3TextConfig"}  # a config class not named <name>Config
TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def make(
    variant: str,
    folder: Path,
    tokenizer_from: Path,
    seed: int = 0,
    spec: tuple | None = None,
    dtype: str = "float32",
    max_shard_size: str | None = None,
) -> Path:
    """Save the ``variant`` model (or ``spec``: a (class name, config keys) pair as VARIANTS
    holds), float32 or ``dtype``, in shards of ``max_shard_size`` if given, into ``folder``
    beside a copy of the tokenizer."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    name, extra = spec or VARIANTS.get(variant) or MOE[variant]
    kw = {**SHAPE, **extra}
    theta = kw.pop("rope_theta", None)
    if theta is not None:
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    config = getattr(transformers, CONFIGS.get(name, f"{name}Config"))(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name}ForCausalLM")(config).float().eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" in key:
                p.add_(torch.randn_like(p) * 0.2)
            elif key.endswith("mlp.gate.weight"):  # a router whose choices are clear
                p.copy_(torch.randn_like(p) * 0.3)
            elif key.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.1)
    model = model.to(getattr(torch, dtype))
    shards = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(folder, **shards)
    for f in TOKENIZER:
        shutil.copy(tokenizer_from / f, folder / f)
    return folder


# a vision tower as small as SigLIP allows: two 14-pixel patches a side, one layer
VISION = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
)


def make_vision(folder: Path, tokenizer_from: Path, tied: bool = True, seed: int = 0) -> Path:
    """A ``gemma3`` folder: ``Gemma3ForConditionalGeneration`` around the ``gemma3`` variant's
    text model (its tied head, or an untied one) and a random vision tower, saved by
    transformers (its text weights as ``language_model.model.*``)."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    text = {**SHAPE, **VARIANTS["gemma3"][1], "tie_word_embeddings": tied}
    config = transformers.Gemma3Config(
        text_config=text, vision_config=VISION, mm_tokens_per_image=4, tie_word_embeddings=tied
    )
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" in key:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(folder)
    for f in TOKENIZER:
        shutil.copy(tokenizer_from / f, folder / f)
    return folder


def for_mlx_lm(folder: Path) -> Path:
    """config.json with the older keys mlx-lm 0.32 reads beside transformers 5's nested
    ``rope_parameters`` (which its qwen3.py alone reads): ``rope_theta`` at the top level, Gemma 3's
    ``rope_local_base_freq`` and ``sliding_window_pattern`` (its layer_types periodic), Phi-3's
    longrope as ``rope_scaling`` and its ``partial_rotary_factor``; the same model for spill."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    params = config.get("rope_parameters") or {}
    if "full_attention" in params:
        config["rope_theta"] = params["full_attention"]["rope_theta"]
        config["rope_local_base_freq"] = params["sliding_attention"]["rope_theta"]
        every = config["layer_types"].index("full_attention") + 1
        assert all(
            (t == "full_attention") == ((i + 1) % every == 0)
            for i, t in enumerate(config["layer_types"])
        )
        config["sliding_window_pattern"] = every
    else:
        config["rope_theta"] = params["rope_theta"]
        if params.get("rope_type") == "longrope":
            factors = {k: params[k] for k in ("short_factor", "long_factor")}
            config["rope_scaling"] = {"type": "longrope", **factors}
        if "partial_rotary_factor" in params:
            config["partial_rotary_factor"] = params["partial_rotary_factor"]
    path.write_text(json.dumps(config, indent=2))
    return folder


def load(folder: Path):
    """The folder as transformers loads it, float32, in eval mode."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
