"""Write a random dense Llama-layout model of a real size, for runs bigger than memory
(issue 38, docs/reports/016-bigger-than-memory.md).

    python bench/big_model.py OUT --tokenizer-from FOLDER [--layers 34] [--hidden 2560]
        [--intermediate 6912] [--heads 20] [--kv-heads 4] [--shard-size 1GB]

bfloat16 safetensors in shards with their index, a ``config.json`` (tied embeddings, the
tokenizer's vocabulary size) and the tokenizer files of ``--tokenizer-from`` (a real BPE with
merges, so llama.cpp loads the model's GGUF export: SmolLM2's float import, for example).
Weights are normal with std 0.02 (norms 1), one seeded generator, written a tensor at a time.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spill.ground.sizes import parse_size  # noqa: E402
from spill.store.safetensors_io import float32_to_bf16_bits, write_file  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    out = [("model.embed_tokens.weight", (cfg["vocab_size"], h))]
    for k in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{k}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
        ]
    return out + [("model.norm.weight", (h,))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokenizer-from", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=34)
    ap.add_argument("--hidden", type=int, default=2560)
    ap.add_argument("--intermediate", type=int, default=6912)
    ap.add_argument("--heads", type=int, default=20)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--shard-size", default="1GB")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    src = json.loads((a.tokenizer_from / "config.json").read_text())
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": src["vocab_size"],
        "hidden_size": a.hidden,
        "intermediate_size": a.intermediate,
        "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads,
        "head_dim": a.hidden // a.heads,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "bos_token_id": src.get("bos_token_id"),
        "eos_token_id": src.get("eos_token_id"),
        "torch_dtype": "bfloat16",
    }
    a.out.mkdir(parents=True, exist_ok=False)
    for name in TOKENIZER_FILES:
        if (a.tokenizer_from / name).exists():
            shutil.copy(a.tokenizer_from / name, a.out / name)
    rng = np.random.default_rng(a.seed)
    limit, shard, size, shards, weight_map = parse_size(a.shard_size), {}, 0, [], {}

    def flush() -> None:
        nonlocal shard, size
        if shard:
            shards.append(shard)
            write_file(a.out / f"part-{len(shards):05d}.safetensors", shard)
            shard, size = {}, 0

    total = 0
    for name, shape in shapes(cfg):
        if len(shape) == 1:
            x = np.ones(shape, np.float32)
        else:
            x = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        shard[name] = ("BF16", float32_to_bf16_bits(x))
        weight_map[name] = len(shards) + 1
        size += x.size * 2
        total += x.size * 2
        if size >= limit:
            flush()
    flush()
    count = len(shards)
    final = {}
    for j in range(1, count + 1):
        new = f"model-{j:05d}-of-{count:05d}.safetensors"
        (a.out / f"part-{j:05d}.safetensors").rename(a.out / new)
        final[j] = new
    index = {
        "metadata": {"total_size": total},
        "weight_map": {n: final[j] for n, j in weight_map.items()},
    }
    (a.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (a.out / "config.json").write_text(json.dumps(cfg, indent=1))
    print(f"wrote {a.out}: {total / 2**30:.2f} GiB in {count} shards")
    return 0


if __name__ == "__main__":
    sys.exit(main())
