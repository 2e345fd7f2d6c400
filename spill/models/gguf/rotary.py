"""The rotary a GGUF holds beyond its base frequency, read into transformers 5's config keys: a
Phi-3's longrope (``longrope_config``), a Ministral 3's YaRN and llama 4 query temperature
(``yarn_config``); and written from spill's config (``rope_tensors``, ``yarn_log_mul``)."""

from __future__ import annotations

import math

import numpy as np

from spill.errors import ModelError
from spill.models.family_keys import yarn_mscale
from spill.models.gguf.arch import LONGROPE
from spill.models.gguf.reader import GGUFFile


def f32(value: float) -> float:
    """A float32 metadata value as its shortest decimal (9.99999974e-06 -> 1e-05, same float32)."""
    return float(str(np.float32(value)))


# A Phi-3's longrope as transformers 5 saves it; the attention factor only where it is not the one
# transformers derives from max / original (the GGUF holds it in float32, as the engines use it).
def longrope_config(gguf: GGUFFile, arch: str, rotary: int, config: dict) -> dict:
    """config.json keys of the longrope in ``rope_factors_long/short`` and the two keys
    ``convert_hf_to_gguf.py`` writes beside them."""
    found = {t.name: t for t in gguf.tensors if t.name in LONGROPE}
    if len(found) != 2 or any(t.shape != (rotary // 2,) for t in found.values()):
        raise ModelError(
            f"{gguf.path}: longrope needs rope_factors_long and rope_factors_short of "
            f"{rotary // 2} values each; re-convert the model"
        )
    long, short = ([f32(x) for x in gguf.read(found[n]).tolist()] for n in LONGROPE)
    original = gguf.value(f"{arch}.rope.scaling.original_context_length", int, least=1)
    attention = gguf.value(f"{arch}.rope.scaling.attn_factor", float, 1.0, 0)
    factor = config["max_position_embeddings"] / original
    derived = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    params = {"rope_type": "longrope", "rope_theta": config["rope_theta"], "long_factor": long}
    params |= {"short_factor": short, "original_max_position_embeddings": original}
    if np.float32(derived) != np.float32(attention):
        params["attention_factor"] = f32(attention)
    return {"original_max_position_embeddings": original, "rope_parameters": params}


# A Ministral 3's rotary as transformers 5 saves it (``rope_parameters``): YaRN's keys where the file
# scales (mscale 1 beside the log multiplier as mscale_all_dim, as llama.cpp derives the attention
# factor), llama 4's query temperature over the original context length.
def yarn_config(gguf: GGUFFile, arch: str, yarn: bool, config: dict) -> dict:
    """config.json's ``rope_parameters`` of a ``mistral3`` GGUF."""

    def get(key: str, default: float) -> float:
        return f32(gguf.value(f"{arch}.{key}", float, default, 0))

    original = gguf.value(f"{arch}.rope.scaling.original_context_length", int, None, 1)
    params = {"rope_type": "yarn" if yarn else "default", "rope_theta": config["rope_theta"]}
    if yarn:
        params |= {"factor": get("rope.scaling.factor", 1.0)}
        params |= {"beta_fast": get("rope.scaling.yarn_beta_fast", 32.0)}
        params |= {"beta_slow": get("rope.scaling.yarn_beta_slow", 1.0)}
        log_mul = get("rope.scaling.yarn_log_multiplier", 0.0)
        params |= {"mscale": 1.0, "mscale_all_dim": log_mul} if log_mul else {}
    params["original_max_position_embeddings"] = original or config["max_position_embeddings"]
    params["llama_4_scaling_beta"] = get("attention.temperature_scale", 0.0)
    return {"rope_parameters": params}


# llama3 rope scaling becomes llama.cpp's ``rope_freqs.weight`` (spill's importer refuses such a
# file: rope scaling).
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


# YaRN's attention factor as llama.cpp's mistral3 derives it: mscale 1 over ``yarn_log_multiplier``.
def yarn_log_mul(cfg) -> float | None:
    """The ``yarn_log_multiplier`` whose attention factor is the config's, to 6 decimals; None
    where no multiplier gives it (an ``mscale`` other than 1, an attention factor apart)."""
    factor = cfg.rope_scaling_dict["factor"]
    full = yarn_mscale(factor)  # the factor's own: llama.cpp's without a multiplier
    if np.float32(cfg.rope_attention) == np.float32(full):
        return 0.0
    if factor <= 1:
        return None
    mul = round((full / cfg.rope_attention - 1.0) / (0.1 * math.log(factor)), 6)
    got = full / yarn_mscale(factor, mul)
    return mul if mul > 0 and abs(got - cfg.rope_attention) <= 1e-6 * cfg.rope_attention else None


def rope_tensors(cfg) -> dict[str, np.ndarray]:
    """The rotary factor tensors llama.cpp reads: ``rope_freqs.weight`` for llama3 scaling, a
    Phi-3's longrope factors (``LONGROPE``, float32 as the engines use them); none otherwise."""
    if cfg.rope_kind == "llama3":
        return {"rope_freqs.weight": rope_freqs(cfg)}
    if cfg.rope_long:
        long, short = (np.asarray(f, dtype=np.float32) for f in (cfg.rope_long, cfg.rope_short))
        return dict(zip(LONGROPE, (long, short), strict=True))
    return {}
