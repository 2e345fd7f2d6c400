"""(b) and (c) of docs/reports/004-engines.md: tune on both engines, and runs moved between them.

Run it with ``python bench/engines.py tune`` (``--text-model tiny`` swaps SmolLM2 for a tiny llama).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from engines_common import ENGINES, MOVES, both, env_for, smollm2, spill, text_train, tiny, toy_copy

# --- distances ------------------------------------------------------------------------------------


def loss_rel(a: list[float], b: list[float]) -> dict:
    x, y = np.asarray(a, np.float64), np.asarray(b, np.float64)
    rel = np.abs(x - y) / np.maximum(np.abs(x), np.abs(y))
    return {
        "max": float(rel.max()),
        "median": float(np.median(rel)),
        "at_step": int(rel.argmax()) + 1,
    }


def cosine(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict:
    def cos(x, y):
        x, y = x.ravel().astype(np.float64), y.ravel().astype(np.float64)
        return float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y)))

    keys = sorted(a)
    per = {k: cos(a[k], b[k]) for k in keys if np.any(a[k]) or np.any(b[k])}
    worst = min(per, key=per.get)
    whole = cos(
        np.concatenate([a[k].ravel() for k in keys]), np.concatenate([b[k].ravel() for k in keys])
    )
    x = np.concatenate([a[k].ravel() for k in keys]).astype(np.float64)
    y = np.concatenate([b[k].ravel() for k in keys]).astype(np.float64)
    rel_l2 = float(np.linalg.norm(x - y) / max(np.linalg.norm(x), np.linalg.norm(y)))
    return {"all": whole, "min_tensor": per[worst], "min_tensor_name": worst, "rel_l2": rel_l2}


def checkpoint(ckpt: Path) -> tuple[list[float], dict[str, np.ndarray], list[dict]]:
    from safetensors.numpy import load_file

    state = json.loads((ckpt / "state.json").read_text())
    producers = [
        {k: p[k] for k in ("from_step", "to_step", "engine", "numerics")}
        for p in state["producers"]
    ]
    return state["losses"], load_file(ckpt / "params.safetensors"), producers


def compare(runs: dict[str, tuple]) -> dict:
    """Loss and adapter distances between every pair that (c) reports."""
    out = {}
    for a, b in [
        ("torch", "mlx"),
        ("torch>mlx", "torch"),
        ("torch>mlx", "mlx"),
        ("mlx>torch", "torch"),
        ("mlx>torch", "mlx"),
    ]:
        if a in runs and b in runs:
            la, pa, _ = runs[a]
            lb, pb, _ = runs[b]
            out[f"{a} vs {b}"] = {"loss_rel": loss_rel(la, lb), "cosine": cosine(pa, pb)}
    return out


TEXT = {
    "steps": 50,
    "batch": 4,
    "micro_batch": 4,
    "seq_len": 128,
    "rank": 8,
    "lr": 0.001,
    "warmup": 5,
    "seed": 0,
    "ckpt_every": 25,
    "dtype": "float32",
}


def tune_args(model: Path, train: Path, state: Path, engine: str, settings: dict) -> list[str]:
    args = ["tune", str(model), str(train), "--name", "text", "--state", str(state)]
    for k, v in settings.items():
        args += ["--" + k.replace("_", "-"), str(v)]
    return [*args, "--resident", "--engine", engine]


def text_runs(work: Path, threads: int, model_kind: str) -> dict:
    env = env_for(work, threads)
    if model_kind == "smollm2":
        model, settings = smollm2(work), TEXT
    else:  # a byte-level tokenizer: a ticket is a few hundred tokens
        model = tiny(work, "tiny-text", "llama", seed=5, layers=4, hidden=256)
        settings = TEXT | {"seq_len": 384}
    train = text_train(work)
    root = work / "text"
    shutil.rmtree(root, ignore_errors=True)
    half, steps = TEXT["ckpt_every"], TEXT["steps"]
    summaries = both(
        spill, {e: (tune_args(model, train, root / e, e, settings), env) for e in ENGINES}
    )
    for first, then in MOVES.values():  # the clean run's step-25 checkpoint, continued elsewhere
        dst = root / f"{first}>{then}"
        shutil.copytree(root / first, dst)
        shutil.rmtree(dst / "ckpt" / f"step-{steps}")
        shutil.rmtree(dst / "adapter")
    jobs = {
        m: (tune_args(model, train, root / m, then, settings), env)
        for m, (_, then) in MOVES.items()
    }
    for m, c in both(spill, jobs).items():
        if f"step {half} of {steps}" not in c["_stderr"] or "this run moved" not in c["_stderr"]:
            raise SystemExit(f"{m} did not continue from step {half}:\n{c['_stderr']}")
    runs = {
        n: checkpoint(root / n / "ckpt" / f"step-{steps}")
        for n in ["torch", "mlx", "torch>mlx", "mlx>torch"]
    }
    return {
        "model": "SmolLM2-135M-Instruct" if model_kind == "smollm2" else "tiny llama 4x256",
        "settings": settings | {"targets": "q_proj,v_proj", "resident": True, "rows": 200},
        "moved_at": half,
        "losses": {n: r[0] for n, r in runs.items()},
        "producers": {n: r[2] for n, r in runs.items()},
        "tokens_per_s": {e: summaries[e]["tokens_per_s"] for e in ENGINES},
        "seconds": {e: summaries[e]["seconds"] for e in ENGINES},
        "distances": compare(runs),
    }


def toy_runs(work: Path, threads: int) -> dict:
    env = env_for(work, threads)
    root = work / "toy"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)

    def build(name: str, engine: str, stop: str | None = None) -> dict:
        args = ["build", str(toy_copy(root, name)), "--state", str(root / f"{name}.state")]
        args += ["--engine", engine] + (["--stop-after", stop] if stop else [])
        return spill(args, env)

    builds = both(build, {e: (e, e) for e in ENGINES})
    both(build, {m: (m, first, "tune:150") for m, (first, _) in MOVES.items()})
    builds |= both(build, {m: (m, then) for m, (_, then) in MOVES.items()})
    runs = {
        n: checkpoint(root / f"{n}.state" / "stages" / "tune" / "ckpt" / "step-300") for n in builds
    }
    scores = {}
    for n, b in builds.items():
        st = b["stages"]
        scores[n] = {
            "base": st["eval:base"]["result"]["accuracy"],
            "tuned": st["eval"]["result"]["accuracy"],
            "rows": st["eval"]["result"]["rows"],
            "tuned_gold_logprob_per_token": st["eval"]["result"]["gold_logprob_per_token"],
            "eval_engine": st["eval"]["producers"][0]["engine"],
        }
    return {
        "model": "tiny:llama:2:2x64 (projects/toy: 300 steps, rank 8 all linears, lr 0.005)",
        "moved_at": 150,
        "losses": {n: r[0] for n, r in runs.items()},
        "producers": {n: r[2] for n, r in runs.items()},
        "scores": scores,
        "distances": compare(runs),
    }


def tune(work: Path, threads: int, text_model: str) -> dict:
    out = {"text": text_runs(work, threads, text_model), "toy": toy_runs(work, threads)}
    for what, r in out.items():
        for pair_name, d in r["distances"].items():
            print(
                f"(b/c) {what}: {pair_name}: loss max rel {d['loss_rel']['max']:.3g} "
                f"(step {d['loss_rel']['at_step']}), median {d['loss_rel']['median']:.3g}; "
                f"adapter 1-cosine {1 - d['cosine']['all']:.3g} "
                f"(worst tensor {1 - d['cosine']['min_tensor']:.3g}), "
                f"relative L2 {d['cosine']['rel_l2']:.3g}"
            )
    for n, s in out["toy"]["scores"].items():
        print(
            f"(b) toy {n}: base {s['base']:.3f}, tuned {s['tuned']:.3f} "
            f"on {s['rows']} held-out rows"
        )
    return out


if __name__ == "__main__":  # the same as ``python bench/engines.py tune ...``
    import sys

    from engines import main

    main(["tune", *sys.argv[1:]])
