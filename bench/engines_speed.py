"""(d) of docs/reports/004-engines.md: tune and generation tokens/s on each engine, with MLX on
OpenBLAS and on its bundled BLAS. Run it with ``python bench/engines.py speed``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from engines_common import env_for, smollm2, spill, text_train, tickets, tiny

CONFIGS = {
    "torch": ("torch", {}),
    "mlx+OpenBLAS": ("mlx", {}),
    "mlx+bundled": ("mlx", {"SPILL_MLX_BLAS": "bundled"}),
}


TUNE_FLAGS = (
    "--name s --steps 4 --batch 4 --micro-batch 4 --seq-len 128 --rank 8 --dtype float32 --resident"
).split()
RUN_FLAGS = "--max-new-tokens 32 --batch 4 --dtype float32 --resident".split()


def speed(work: Path, threads: int, repeats: int) -> dict:
    models = {  # name: (folder, --seq-len); the tiny tokenizer is byte-level
        "SmolLM2-135M": (smollm2(work), 128),
        "tiny llama 8x512": (tiny(work, "tiny-512", "llama", seed=1, layers=8, hidden=512), 384),
    }
    train = text_train(work)
    out: dict = {"threads": threads, "repeats": repeats, "models": {}}
    for name, (folder, seq_len) in models.items():
        prompts = work / f"gen-{folder.name}.jsonl"
        with open(prompts, "w") as f:
            for i, r in enumerate(tickets(8)):
                f.write(json.dumps({"id": i, "prompt": f"Ticket: {r['text']}\nTeam:"}) + "\n")
        samples: dict = {c: {"tune": [], "generate": []} for c in CONFIGS}
        lines = {}
        for rep in range(repeats):  # alternate, so a busy moment hits every engine alike
            for c, (engine, extra) in CONFIGS.items():
                env = env_for(work, threads, **extra)
                state = work / "speed" / f"{folder.name}-{c}-{rep}"
                shutil.rmtree(state, ignore_errors=True)
                tune_args = ["tune", str(folder), str(train), "--state", str(state), *TUNE_FLAGS]
                tune_args += ["--seq-len", str(seq_len)]
                t = spill([*tune_args, "--engine", engine], env)
                out_file = str(state / "out.jsonl")
                run_args = ["run", str(folder), str(prompts), "--out", out_file, *RUN_FLAGS]
                g = spill([*run_args, "--engine", engine], env)
                samples[c]["tune"].append(t["tokens_per_s"])
                samples[c]["generate"].append(g["tokens_per_s"])
                lines[c] = next(x for x in t["_stderr"].splitlines() if "· engine" in x)
        best = {c: {k: max(v) for k, v in s.items()} for c, s in samples.items()}
        ratios = {
            c: {k: round(best[c][k] / best["torch"][k], 3) for k in ("tune", "generate")}
            for c in CONFIGS
            if c != "torch"
        }
        out["models"][name] = {
            "tokens_per_s": samples,
            "best": best,
            "ratio_to_torch": ratios,
            "lines": lines,
            "seq_len": seq_len,
        }
        for c in CONFIGS:
            print(
                f"(d) {name} {c}: tune {best[c]['tune']:.1f} tok/s, generate "
                f"{best[c]['generate']:.1f} tok/s"
                + (
                    f" ({ratios[c]['tune']:.2f}x / {ratios[c]['generate']:.2f}x torch)"
                    if c in ratios
                    else ""
                )
            )
    return out


if __name__ == "__main__":  # the same as ``python bench/engines.py speed ...``
    import sys

    from engines import main

    main(["speed", *sys.argv[1:]])
