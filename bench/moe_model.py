"""Write a random Qwen3-MoE model of Qwen3-30B-A3B's real shape, 4-bit in mlx-lm's layout, for
decoding and tuning inside a memory cgroup (issue 41).

    python bench/moe_model.py OUT --tokenizer-from FOLDER [--layers 48] [--experts 128]
        [--experts-per-token 8] [--hidden 2048] [--intermediate 6144]
        [--expert-intermediate 768] [--heads 32] [--kv-heads 4] [--head-dim 128]
        [--vocab 151936] [--sparse-step 1] [--mlp-only-layers N ...] [--bits 4]
        [--group-size 64] [--shard-size 2GB] [--seed 0]

The tensors, dtypes, shapes and config ``quantization`` that ``mlx_lm convert -q --q-bits 4
--q-group-size 64`` writes for a qwen3_moe (mlx-lm 0.32): each layer's experts stacked as
``mlp.switch_mlp.{gate,up,down}_proj`` (weight uint32 ``(E, out, in * bits / 32)``, scales and
biases bfloat16 ``(E, out, in / group)``); attention, router, embeddings and head packed the same
way unstacked, the router (``mlp.gate``) at 8 bits in groups of 64 as mlx-lm's
``quant_predicate`` asks; norms bfloat16. Generated packed, never as floats (the float model
would be ~60 GB; this one is ~17 GB): random words are valid codes, each group's scale is spread
around ``std / std(codes)`` and its bias ``-scale * (2**bits - 1) / 2`` (centred codes), so a
dequantized weight has std about 0.02 (the router 0.05, so routing is no uniform noise). One
seeded generator, a tensor at a time, shards of ``--shard-size`` with their index, and the
tokenizer files of ``--tokenizer-from`` (its ids for bos/eos; ``vocab_size`` stays the real
width unless ``--vocab`` says otherwise).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spill.ground.sizes import parse_size  # noqa: E402
from spill.store.safetensors_io import (  # noqa: E402
    bf16_bits_to_float32,
    float32_to_bf16_bits,
    write_file,
)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)
ROUTER = {"group_size": 64, "bits": 8}  # mlx_lm.models.qwen3_moe.Model.quant_predicate
STD, ROUTER_STD = 0.02, 0.05  # dequantized weights' std


def sparse(cfg: dict, k: int) -> bool:
    """Whether layer ``k`` routes to experts (as transformers and mlx-lm decide)."""
    return (
        k not in cfg["mlp_only_layers"]
        and cfg["num_experts"] > 0
        and (k + 1) % cfg["decoder_sparse_step"] == 0
    )


Quant = tuple[int, int, float]  # bits, group size, dequantized std


def tensors(cfg: dict, bits: int, group: int) -> list[tuple[str, tuple[int, ...], Quant | None]]:
    """``(name, float shape, quantization)`` of every tensor: a packed module by its name
    without ``.weight`` (shape ``(E, out, in)`` for stacked experts), a norm by its weight's
    name with None."""
    h, d, e = cfg["hidden_size"], cfg["head_dim"], cfg["num_experts"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    m, w = cfg["moe_intermediate_size"], (bits, group, STD)
    out = [("model.embed_tokens", (cfg["vocab_size"], h), w)]
    for k in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{k}."
        out += [
            (p + "input_layernorm.weight", (h,), None),
            (p + "self_attn.q_proj", (q, h), w),
            (p + "self_attn.k_proj", (kv, h), w),
            (p + "self_attn.v_proj", (kv, h), w),
            (p + "self_attn.o_proj", (h, q), w),
            (p + "self_attn.q_norm.weight", (d,), None),
            (p + "self_attn.k_norm.weight", (d,), None),
            (p + "post_attention_layernorm.weight", (h,), None),
        ]
        if sparse(cfg, k):
            out += [
                (p + "mlp.gate", (e, h), (ROUTER["bits"], ROUTER["group_size"], ROUTER_STD)),
                (p + "mlp.switch_mlp.gate_proj", (e, m, h), w),
                (p + "mlp.switch_mlp.up_proj", (e, m, h), w),
                (p + "mlp.switch_mlp.down_proj", (e, h, m), w),
            ]
        else:
            i = cfg["intermediate_size"]
            out += [
                (p + "mlp.gate_proj", (i, h), w),
                (p + "mlp.up_proj", (i, h), w),
                (p + "mlp.down_proj", (h, i), w),
            ]
    out.append(("model.norm.weight", (h,), None))
    if not cfg["tie_word_embeddings"]:
        out.append(("lm_head", (cfg["vocab_size"], h), w))
    return out


def packed(
    rng: np.random.Generator, shape: tuple[int, ...], bits: int, group: int, std: float
) -> dict[str, tuple[str, np.ndarray]]:
    """A random packed linear of float ``shape`` (``(..., out, in)``) whose dequantized values
    have std about ``std``: uniform codes, scales spread by 0.5..1.5 around the mean, centred."""
    *lead, rows, cols = shape
    words = rng.integers(0, 2**32, size=(*lead, rows, cols * bits // 32), dtype=np.uint32)
    top = 2**bits - 1
    # the std of uniform codes 0..top, and the root mean square of uniform(0.5, 1.5)
    base = std / math.sqrt(((top + 1) ** 2 - 1) / 12) / math.sqrt(13 / 12)
    spread = rng.uniform(0.5, 1.5, size=(*lead, rows, cols // group)).astype(np.float32)
    scales = float32_to_bf16_bits(spread * np.float32(base))
    biases = float32_to_bf16_bits(bf16_bits_to_float32(scales) * np.float32(-top / 2))
    return {".weight": ("U32", words), ".scales": ("BF16", scales), ".biases": ("BF16", biases)}


def config(a: argparse.Namespace, src: dict) -> dict:
    """Qwen3-30B-A3B's config.json with ``a``'s dimensions and mlx-lm's ``quantization``."""
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": a.vocab,
        "hidden_size": a.hidden,
        "intermediate_size": a.intermediate,
        "moe_intermediate_size": a.expert_intermediate,
        "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads,
        "head_dim": a.head_dim,
        "num_experts": a.experts,
        "num_experts_per_tok": a.experts_per_token,
        "norm_topk_prob": True,
        "decoder_sparse_step": a.sparse_step,
        "mlp_only_layers": sorted(a.mlp_only_layers),
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "hidden_act": "silu",
        "bos_token_id": src.get("bos_token_id"),
        "eos_token_id": src.get("eos_token_id"),
        "torch_dtype": "bfloat16",
    }
    quant: dict = {"group_size": a.group_size, "bits": a.bits, "mode": "affine"}
    for k in range(a.layers):
        if sparse(cfg, k):
            quant[f"model.layers.{k}.mlp.gate"] = dict(ROUTER)
    # mlx-lm writes both (the second for the hub's tree, mlx-lm issue 957)
    return cfg | {"quantization": quant, "quantization_config": dict(quant)}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer-from", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--experts-per-token", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=6144)  # dense layers' MLP
    ap.add_argument("--expert-intermediate", type=int, default=768)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--sparse-step", type=int, default=1)
    ap.add_argument("--mlp-only-layers", type=int, nargs="*", default=[])
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--shard-size", default="2GB")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main() -> int:
    ap = parser()
    a = ap.parse_args()
    src_cfg = a.tokenizer_from / "config.json"
    cfg = config(a, json.loads(src_cfg.read_text()) if src_cfg.exists() else {})
    plan = tensors(cfg, a.bits, a.group_size)
    for name, shape, quant in plan:
        # mlx-lm leaves such a linear float: refuse rather than write another layout
        if quant and (
            shape[-1] % a.group_size or shape[-1] % quant[1] or shape[-1] * quant[0] % 32
        ):
            ap.error(f"{name}: its input width {shape[-1]} is no multiple of the group size")
    a.out.mkdir(parents=True, exist_ok=False)
    for name in TOKENIZER_FILES:
        if (a.tokenizer_from / name).exists():
            shutil.copy(a.tokenizer_from / name, a.out / name)
    start = time.monotonic()
    rng = np.random.default_rng(a.seed)
    limit, shard, size, shards, weight_map = parse_size(a.shard_size), {}, 0, 0, {}
    total = params = 0

    def flush() -> None:
        nonlocal shard, size, shards
        if shard:
            shards += 1
            write_file(a.out / f"part-{shards:05d}.safetensors", shard, {"format": "mlx"})
            shard, size = {}, 0

    for name, shape, quant in plan:
        if quant is None:
            parts = {"": ("BF16", float32_to_bf16_bits(np.ones(shape, np.float32)))}
        else:
            parts = packed(rng, shape, *quant)
        nbytes = sum(x.nbytes for _, x in parts.values())
        if size + nbytes > limit:  # as mlx-lm's make_shards: a shard ends before it overflows
            flush()
        for part, entry in parts.items():
            shard[name + part] = entry
            weight_map[name + part] = shards + 1
        size, total, params = size + nbytes, total + nbytes, params + math.prod(shape)
    flush()
    final = {}
    for j in range(1, shards + 1):
        new = "model.safetensors" if shards == 1 else f"model-{j:05d}-of-{shards:05d}.safetensors"
        (a.out / f"part-{j:05d}.safetensors").rename(a.out / new)
        final[j] = new
    index = {
        "metadata": {"total_size": total, "total_parameters": params},
        "weight_map": {n: final[j] for n, j in sorted(weight_map.items())},
    }
    (a.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
    (a.out / "config.json").write_text(json.dumps(cfg, indent=4))
    took = time.monotonic() - start
    print(
        f"wrote {a.out}: {total} bytes ({total / 2**30:.2f} GiB) in {shards} shards, {took:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
