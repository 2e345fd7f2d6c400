"""(a) of docs/reports/004-engines.md: greedy tokens and log-probs, torch vs MLX, float32.

Each engine runs in its own process (``bench/engines.py _worker SPEC``, the worker below):
greedy generation of 32 tokens for 20 prompts (batch 4, left-padded), then both engines score
the torch engine's greedy tokens. Run it with ``python bench/engines.py agree``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from engines_common import ENGINES, both, env_for, smollm2, tickets, tiny, worker


def run_worker(spec: dict) -> None:
    """One engine's generate or score of ``spec``; prints the result as one JSON line."""
    from spill.engines import resolve
    from spill.engines.base import GenerateParams, LoadOptions, ModelSpec
    from spill.models.config import load_config

    folder = Path(spec["model"])
    runner = resolve(spec["engine"]).open(
        ModelSpec(folder, load_config(folder)), LoadOptions(dtype="float32", resident=True)
    )
    prompts = [np.asarray(p, dtype=np.int64) for p in spec["prompts"]]
    out: dict = {"line": runner.info.line()}
    b = spec["batch"]
    if spec["op"] == "generate":
        params = GenerateParams(spec["new"], 0.0, 1.0, tuple(spec["stop"]))
        toks = []
        for lo in range(0, len(prompts), b):
            chunk = prompts[lo : lo + b]
            toks += [g.tokens.tolist() for g in runner.generate(chunk, params, [0] * len(chunk))]
        out["tokens"] = toks
    else:  # score
        comps = [np.asarray(c, dtype=np.int64) for c in spec["completions"]]
        lps = []
        for lo in range(0, len(prompts), b):
            lps += [x.tolist() for x in runner.score(prompts[lo : lo + b], comps[lo : lo + b])]
        out["logprobs"] = lps
    runner.close()
    print(json.dumps(out))


QUESTIONS = [
    "What is the capital of France?",
    "Name three fruits.",
    "What is 2 + 2?",
    "Who wrote Romeo and Juliet?",
]


def agree(work: Path, threads: int) -> dict:
    from spill.models.tokenizer import Tokenizer

    env = env_for(work, threads)
    models = {
        "tiny llama (4x64)": tiny(work, "tiny-llama", "llama", seed=7),
        "tiny qwen2 (4x64)": tiny(work, "tiny-qwen2", "qwen2", seed=7),
        "SmolLM2-135M": smollm2(work),
    }
    texts = QUESTIONS + [f"Which team handles this ticket? {r['text']}" for r in tickets(16)]
    out = {}
    for name, folder in models.items():
        tok = Tokenizer(folder)
        prompts = [tok.encode_chat([{"role": "user", "content": t}]) for t in texts]
        base = {"model": str(folder), "prompts": prompts, "batch": 4}
        t0 = time.perf_counter()
        gen_spec = {**base, "op": "generate", "new": 32, "stop": list(tok.eos_ids)}
        gen = both(worker, {e: ({**gen_spec, "engine": e}, env) for e in ENGINES})
        ref = gen["torch"]["tokens"]
        score_spec = {**base, "op": "score", "completions": ref}
        scored = both(worker, {e: ({**score_spec, "engine": e}, env) for e in ENGINES})
        pairs = list(zip(gen["torch"]["tokens"], gen["mlx"]["tokens"], strict=True))
        same = [a == b for a, b in pairs]
        lp_t = np.concatenate([np.asarray(x, np.float64) for x in scored["torch"]["logprobs"]])
        lp_m = np.concatenate([np.asarray(x, np.float64) for x in scored["mlx"]["logprobs"]])
        diff = np.abs(lp_t - lp_m)
        first_diff = []
        for i, (a, b) in enumerate(pairs):
            if a != b:
                n = min(len(a), len(b))
                k = next((j for j in range(n) if a[j] != b[j]), n)
                first_diff.append({"prompt": i, "token": k})
        out[name] = {
            "greedy_identical": sum(same),
            "prompts": len(same),
            "new_tokens": 32,
            "max_abs_logprob_diff": float(diff.max()),
            "median_abs_logprob_diff": float(np.median(diff)),
            "logprob_at_max_diff": float(lp_t[diff.argmax()]),
            "scored_tokens": int(diff.size),
            "first_differences": first_diff,
            "lines": {e: gen[e]["line"] for e in ENGINES},
            "seconds": round(time.perf_counter() - t0, 1),
        }
        print(
            f"(a) {name}: greedy identical on {sum(same)} of {len(same)}; "
            f"max |log-prob torch - mlx| {diff.max():.3g} (median {np.median(diff):.2g}) "
            f"over {diff.size} tokens"
        )
    return out


if __name__ == "__main__":  # the same as ``python bench/engines.py agree ...``
    import sys

    from engines import main

    main(["agree", *sys.argv[1:]])
