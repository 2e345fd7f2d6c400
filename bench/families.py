"""What each model family costs against a Llama of the same size (issue 37), for
docs/reports/017-families.md. One run, one process; each round measures every family on every
engine in turn (the sides alternate), and the table takes each figure's median over the rounds;
nothing here asserts a time.

    python bench/families.py [--rounds 3] [--json OUT]

The models are random, made by transformers (``XxxForCausalLM(config)``, ``save_pretrained``,
float32): 4 layers of hidden 256, 8 heads of 32 (4 KV heads), MLP 688, a 4096-token vocabulary,
each family's own parts on (Qwen3's q/k norms, a Mistral window of 64 on every layer, SmolLM3's
NoPE every 4th layer, Gemma 3's sliding/full layers with a window of 64, Phi-3's fused linears
and half-rotated heads), and a Llama of exactly that shape. On each engine, float32, resident:

- score: ``runner.score`` of 8 rows of 128 tokens (gold log-probs of the last 64), tokens/s;
- run: ``runner.generate`` greedy, batch 1, 32 new tokens after a 64-token prompt, tokens/s;
- tune: one LoRA step (r 8 on every linear, 2 micro-batches of 4 x 128, AdamW), tokens/s;
- gap: the largest |spill - transformers| over the score rows' gold log-probs.

Each figure is the fastest of 3 calls (the machine is shared; interference only adds time).
Every round measures each family right beside the Llama on the same engine, in turns first, and
its ratio to the Llama is the median of those adjacent pairs' ratios; the tok/s columns are
medians over every measurement of that family and engine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPE = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
FAMILIES = {  # name -> (transformers class prefix, config class, the family's own keys)
    "llama": ("Llama", "LlamaConfig", {}),
    "qwen3": ("Qwen3", "Qwen3Config", {}),
    "mistral": ("Mistral", "MistralConfig", {"sliding_window": 64}),
    "smollm3": ("SmolLM3", "SmolLM3Config", {"no_rope_layer_interval": 4}),
    "gemma3_text": (
        "Gemma3",
        "Gemma3TextConfig",
        {"sliding_window": 64, "query_pre_attn_scalar": 32, "sliding_window_pattern": 2},
    ),
    "phi3": ("Phi3", "Phi3Config", {"partial_rotary_factor": 0.5}),
}
ENGINES = ("torch", "mlx")
ROWS, SEQ, SCORED = 8, 128, 64
PROMPT, NEW = 64, 32
MICRO, ACCUM = 4, 2
REPEATS = 3


def make(family: str, folder: Path) -> Path:
    import torch
    import transformers

    prefix, config_class, extra = FAMILIES[family]
    config = getattr(transformers, config_class)(**SHAPE, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).float().eval()
    model.save_pretrained(folder)
    return folder


def transformers_log_probs(folder: Path, tokens: np.ndarray) -> np.ndarray:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor(tokens)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), dim=-1)  # (B, T, V)
    picked = logp[:, SEQ - SCORED - 1 : -1].gather(2, ids[:, SEQ - SCORED :, None])[..., 0]
    return picked.numpy()  # (B, SCORED)


def timed(fn) -> tuple[float, object]:
    """The fastest of ``REPEATS`` calls (a shared machine only ever adds time), and its output."""
    best, out = float("inf"), None
    for _ in range(REPEATS):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def measure(engine_name: str, folder: Path, tokens: np.ndarray, reference: np.ndarray) -> dict:
    from spill.engines import resolve
    from spill.engines.base import AdamW, GenerateParams, LoadOptions, ModelSpec, TrainBatch
    from spill.models.config import load_config
    from spill.models.lora import LoraConfig, init_params

    cfg = load_config(folder)
    runner = resolve(engine_name).open(
        ModelSpec(folder, cfg), LoadOptions(resident=True, dtype="float32")
    )
    prompts = [t[: SEQ - SCORED] for t in tokens]
    completions = [t[SEQ - SCORED :] for t in tokens]
    runner.score(prompts[:1], completions[:1])  # warm: first-call allocations and compiles
    score_s, got = timed(lambda: runner.score(prompts, completions))
    gap = float(max(np.abs(g - r).max() for g, r in zip(got, reference, strict=True)))
    params = GenerateParams(max_new_tokens=NEW)
    run_s, gens = timed(lambda: runner.generate([tokens[0][:PROMPT]], params, [0]))
    new = len(gens[0].tokens)

    lora = LoraConfig(rank=8, alpha=16, targets=LoraConfig.parse_targets("all", cfg.linears))
    trainer = runner.trainer(lora)
    trainer.set_state(init_params(cfg, lora, 0), {}, {})
    mask = np.ones((MICRO, SEQ), bool)
    targets = mask.copy()
    targets[:, 0] = False
    scale = 1.0 / (ACCUM * MICRO * (SEQ - 1))

    def step(k: int) -> None:
        for m in range(ACCUM):
            rows = tokens[(m * MICRO) % ROWS : (m * MICRO) % ROWS + MICRO]
            trainer.accumulate(TrainBatch(rows, mask, targets, scale, k * ACCUM + m))
        trainer.apply(AdamW(lr=1e-3, step=k + 1))

    steps = iter(range(REPEATS + 1))
    step(next(steps))  # warm
    tune_s, _ = timed(lambda: step(next(steps)))
    runner.close()
    return {
        "score_tps": ROWS * SEQ / score_s,
        "run_tps": new / run_s,
        "tune_tps": ACCUM * MICRO * SEQ / tune_s,
        "gap": gap,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, SHAPE["vocab_size"], (ROWS, SEQ)).astype(np.int64)
    results: dict[str, dict[str, list[dict]]] = {f: {e: [] for e in ENGINES} for f in FAMILIES}
    ratios: dict[str, dict[str, list[dict]]] = {f: {e: [] for e in ENGINES} for f in FAMILIES}
    keys = ("score_tps", "run_tps", "tune_tps")
    with tempfile.TemporaryDirectory() as tmp:
        folders = {f: make(f, Path(tmp) / f) for f in FAMILIES}
        refs = {f: transformers_log_probs(folders[f], tokens) for f in FAMILIES}
        for r in range(args.rounds):
            for k, family in enumerate(FAMILIES):
                for engine in ENGINES if r % 2 == 0 else ENGINES[::-1]:
                    # the family and the Llama back to back, in turns first, for the ratio
                    pair = ["llama", family] if (r + k) % 2 else [family, "llama"]
                    got = {f: measure(engine, folders[f], tokens, refs[f]) for f in pair}
                    for f, figures in got.items():
                        results[f][engine].append(figures)
                        print(f"round {r} {f} {engine}: {figures}", file=sys.stderr, flush=True)
                    ratio = {x: got[family][x] / got["llama"][x] for x in keys}
                    ratios[family][engine].append(ratio)
    table = []
    for family in FAMILIES:
        for engine in ENGINES:
            rounds = results[family][engine]
            row = {"family": family, "engine": engine}
            for key in keys:
                row[key] = statistics.median(x[key] for x in rounds)
                ratio = statistics.median(x[key] for x in ratios[family][engine])
                row[key.replace("_tps", "_ratio")] = ratio
            row["gap"] = max(x["gap"] for x in rounds)
            table.append(row)
    print(
        "| family | engine | score tok/s (x llama) | run tok/s (x llama) | tune tok/s (x llama) "
        "| max log-prob gap to transformers |"
    )
    print("|---|---|---|---|---|---|")
    for row in table:
        cells = [
            f"{row[k + '_tps']:.0f} ({row[k + '_ratio']:.2f})" for k in ("score", "run", "tune")
        ]
        print(f"| {row['family']} | {row['engine']} | {' | '.join(cells)} | {row['gap']:.1e} |")
    if args.json:
        meta = {
            "machine": platform.platform(),
            "rounds": args.rounds,
            "load_average_at_end": os.getloadavg(),
        }
        args.json.write_text(json.dumps({"meta": meta, "table": table, "raw": results}, indent=1))


if __name__ == "__main__":
    main()
