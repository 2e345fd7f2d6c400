"""An MoE adapter's experts in the stacked layouts others read: PEFT's ``target_parameters`` on
transformers 5's fused experts, and mlx-lm's ``LoRASwitchLinear`` (``stack_peft``,
``unstack_peft``, ``stack_mlx``); spill keeps one adapter per expert and linear
(``layers.<k>.mlp.experts.<e>.up_proj.lora_a``). Engine-free, numpy only.
"""

from __future__ import annotations

import re

import numpy as np

from spill.errors import SpillError
from spill.models.family_keys import EXPERTS

EXPERT = re.compile(
    r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.lora_(a|b)$"
)
DENSE_MLP = re.compile(r"layers\.\d+\.mlp\.(gate_proj|up_proj|down_proj)\.lora_[ab]$")
PEFT_PREFIX = "base_model.model.model."


def by_layer(params: dict[str, np.ndarray]) -> dict[int, dict[str, list[tuple[np.ndarray, ...]]]]:
    """Expert adapters as ``{layer: {linear: [(A, B) per expert, in expert order]}}``."""
    found: dict[int, dict[str, dict[int, dict[str, np.ndarray]]]] = {}
    for name, value in params.items():
        if m := EXPERT.match(name):
            k, e, linear, ab = int(m[1]), int(m[2]), m[3], m[4]
            found.setdefault(k, {}).setdefault(linear, {}).setdefault(e, {})[ab] = value
    return {
        k: {p: [(es[e]["a"], es[e]["b"]) for e in sorted(es)] for p, es in linears.items()}
        for k, linears in found.items()
    }


def peft_refusal(params: dict[str, np.ndarray]) -> str | None:
    """Why PEFT's layout cannot hold these expert adapters (None: it can)."""
    layers = by_layer(params)
    if not layers:
        return None
    if any(DENSE_MLP.match(n) for n in params):
        return (
            "PEFT 0.21 maps gate_proj/up_proj/down_proj of a Qwen3-MoE onto its experts' fused "
            "parameters, so a dense layer's MLP adapter has no PEFT form; use the mlx/ or spill "
            "layout"
        )
    if any(("gate_proj" in ls) != ("up_proj" in ls) for ls in layers.values()):
        return (
            "transformers 5 holds an expert's gate and up in one gate_up_proj, which PEFT adapts "
            "as one; target both gate_proj and up_proj (or 'experts') for the PEFT layout"
        )
    return None


# PEFT's ParamWrapper over an [E, out, in] parameter: lora_A.weight is [E * r, in] (expert-major),
# lora_B.weight is [out, r * E] read as (out, r, E) (expert-minor); the delta of expert e is
# B_e @ A_e times alpha / r. gate and up, one rank-2r adapter on gate_up_proj: A stacks gate's then
# up's, B is block-diagonal (gate's rows first, as transformers' chunk), alpha doubles so the
# scale stays alpha / r. Two targeted parameters of one module nest; PEFT wraps gate_up_proj (the
# first defined) first, so its tensors sit under ``experts.base_layer``.
def _peft_pair(pairs: list[tuple[np.ndarray, ...]]) -> tuple[np.ndarray, np.ndarray]:
    """(lora_A.weight, lora_B.weight) of one parameter from each expert's (A^T [r, in], B^T
    [out, r])."""
    a = np.concatenate([at for at, _ in pairs], axis=0)  # (E * r, in)
    b = np.stack([bt for _, bt in pairs], axis=-1)  # (out, r, E)
    return np.ascontiguousarray(a), np.ascontiguousarray(b.reshape(b.shape[0], -1))


def stack_peft(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """PEFT's tensors (full names) for the expert adapters in ``params``."""
    out = {}
    for k, linears in by_layer(params).items():
        stem = f"{PEFT_PREFIX}layers.{k}.{EXPERTS.rstrip('.')}"
        wrapped = {}
        if "gate_proj" in linears:
            fused = []
            for (ga, gb), (ua, ub) in zip(linears["gate_proj"], linears["up_proj"], strict=True):
                r, size = ga.shape[1], gb.shape[1]
                bt = np.zeros((2 * size, 2 * r), np.float32)
                bt[:size, :r], bt[size:, r:] = gb.T, ub.T
                fused.append((np.concatenate([ga.T, ua.T]), bt))
            wrapped["gate_up_proj"] = _peft_pair(fused)
        if "down_proj" in linears:
            wrapped["down_proj"] = _peft_pair([(a.T, b.T) for a, b in linears["down_proj"]])
        for depth, (_, (a, b)) in enumerate(reversed(wrapped.items())):
            at = stem + ".base_layer" * depth
            out[f"{at}.lora_A.weight"], out[f"{at}.lora_B.weight"] = a, b
    return out


def peft_fields(params: dict[str, np.ndarray], rank: int, alpha: float) -> dict:
    """The ``adapter_config.json`` fields the expert adapters add (none without experts)."""
    linears = {p for ls in by_layer(params).values() for p in ls}
    if not linears:
        return {}
    names = (["gate_up_proj"] if "gate_proj" in linears else []) + (
        ["down_proj"] if "down_proj" in linears else []
    )
    fields: dict = {"target_parameters": [EXPERTS + n for n in names]}
    if "gate_proj" in linears:
        fields |= {"rank_pattern": {"gate_up_proj": 2 * rank}}
        fields |= {"alpha_pattern": {"gate_up_proj": 2 * alpha}}
    return fields


def unstack_peft(
    tensors: dict[str, np.ndarray], targets: list[str], rank: int, where: str
) -> dict[str, np.ndarray]:
    """spill's expert adapters from PEFT's stacked ``tensors`` (``experts`` keys, popped) of the
    parameters ``targets`` (``mlp.experts.gate_up_proj``...)."""
    names = [t.rsplit(".", 1)[-1] for t in targets]
    if unknown := sorted(set(names) - {"gate_up_proj", "down_proj"}):
        raise SpillError(f"{where}: target_parameters {unknown} are not experts spill adapts")
    nested = [n for n in ("gate_up_proj", "down_proj") if n in names]  # inner first
    out = {}
    layers = sorted(
        {int(m[1]) for key in tensors if (m := re.search(r"layers\.(\d+)\.mlp\.experts\.", key))}
    )
    for k in layers:
        stem = f"{PEFT_PREFIX}layers.{k}.{EXPERTS.rstrip('.')}"
        for depth, name in enumerate(reversed(nested)):
            at = stem + ".base_layer" * depth
            a, b = tensors.pop(f"{at}.lora_A.weight"), tensors.pop(f"{at}.lora_B.weight")
            r = 2 * rank if name == "gate_up_proj" else rank
            experts = a.shape[0] // r
            a = a.reshape(experts, r, a.shape[1])  # (E, r, in)
            b = b.reshape(b.shape[0], r, experts).transpose(2, 0, 1)  # (E, out, r)
            for e in range(experts):
                put = f"layers.{k}.mlp.experts.{e}."
                if name == "down_proj":
                    out[put + "down_proj.lora_a"], out[put + "down_proj.lora_b"] = a[e].T, b[e].T
                    continue
                size = b.shape[1] // 2
                if b[e, :size, rank:].any() or b[e, size:, :rank].any():
                    raise SpillError(
                        f"{where}: layer {k} expert {e}'s gate_up_proj adapter mixes gate and "
                        "up in one rank; spill holds them apart and cannot read it"
                    )
                out[put + "gate_proj.lora_a"] = a[e, :rank].T
                out[put + "gate_proj.lora_b"] = b[e, :size, :rank].T
                out[put + "up_proj.lora_a"] = a[e, rank:].T
                out[put + "up_proj.lora_b"] = b[e, size:, rank:].T
    return {n: np.ascontiguousarray(v, dtype=np.float32) for n, v in out.items()}


def stack_mlx(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """mlx-lm's ``LoRASwitchLinear`` tensors: ``model.layers.<k>.mlp.switch_mlp.<linear>.lora_a``
    (E, r, in) and ``lora_b`` (E, out, r), the delta of expert e ``scale * lora_b[e] @ lora_a[e]``."""
    out = {}
    for k, linears in by_layer(params).items():
        for linear, pairs in linears.items():
            stem = f"model.layers.{k}.mlp.switch_mlp.{linear}"
            # stacked transposes keep their strides: safetensors wants C order
            out[stem + ".lora_a"] = np.ascontiguousarray(np.stack([a.T for a, _ in pairs]))
            out[stem + ".lora_b"] = np.ascontiguousarray(np.stack([b.T for _, b in pairs]))
    return out
