"""Generation speed when layers stream (issue 13, part B), for docs/reports/011-speed-rows.md.
Everything is measured in one run, sides alternating, best round per side; nothing here asserts
a time.

    python bench/generate.py [ring|bound|profile|all] [--rounds 2] [--threads N] [--json OUT]

* ``ring``: SmolLM2-135M (``spill models import smollm2:135m``, offline), float32, ``--rows``
  chat prompts, ``--new`` tokens per row (no stop ids: every row makes them all), greedy. Four
  sides: resident and ``--ring 2`` at batch 8 (the old fixed default) and at the auto batch (what
  a row job now picks for the streamed runner from the memory budget,
  ``StreamRunner.plan_batch``). Ratios: streamed / resident at each batch, and streamed at the
  auto batch / resident at 8 (what a user who did not set ``--batch`` gets on each side now).
* ``bound``: a generated llama (``write_tiny``, ``--layers`` x ``--hidden``, bf16 on disk,
  float32 compute, or ``--bound-dtype bfloat16``: no conversion) opened with ``--memory`` =
  model bytes / 8 in the compute dtype (so the ring gets 2 of 16 layers). A decode step reads every layer's bytes from the file; the bound is
  steps/s = read rate / bytes per step, for two read rates measured here on the same files
  (``read()`` in 16 MiB chunks): page cache (the files read once before: what a decode step
  finds, since the model fits in RAM) and cold-ish (each file's pages evicted with
  ``posix_fadvise(DONTNEED)`` first; this evicts clean cached pages of that file only, it is not
  a global cache drop). Streamed steps/s is timed over decode steps only (a generate of
  ``--new`` + 1 tokens minus one of 1 token: the prefill cancels). Also the resident decode
  step at the same batch: the compute the step cannot go below.
* ``profile``: ``torch.profiler`` over decode steps only (the prefill is skipped by a schedule
  stepped on each forward), SmolLM2, float32, resident and ring 2, at batch 8 and the auto
  batch; the top entries by self CPU time (all threads the profiler sees).

The machine is shared (other long jobs run throughout): absolute rates are noisy, ratios within
one run are what counts. Torch keeps its default threads (one per core) unless ``--threads``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "What is 17 times 23?",
    "Give me a synonym for happy.",
    "Who wrote Hamlet?",
    "What is the boiling point of water?",
    "Name three colours of the rainbow.",
    "List three prime numbers.",
    "What does a compiler do?",
    "Name a famous painter.",
    "How many legs does a spider have?",
    "Translate 'good morning' to French.",
    "Why is the sky blue?",
]


def smollm2() -> Path:
    from spill.models.resolve import resolve_model

    return Path(resolve_model("smollm2:135m", None).folder)


def open_runner(folder: Path, **opts):
    from spill.engines import resolve
    from spill.engines.base import LoadOptions, ModelSpec
    from spill.models.config import load_config

    return resolve("torch").open(ModelSpec(folder, load_config(folder)), LoadOptions(**opts))


def chat_prompts(folder: Path, n: int) -> list[np.ndarray]:
    from spill.models.tokenizer import Tokenizer

    tok = Tokenizer(folder)
    qs = (QUESTIONS * (n // len(QUESTIONS) + 1))[:n]
    return [np.asarray(tok.encode_chat([{"role": "user", "content": q}])) for q in qs]


def generate_all(runner, prompts, batch: int, new: int) -> tuple[int, float]:
    """(tokens, seconds) for every prompt, ``batch`` at a time, exactly ``new`` tokens a row."""
    from spill.engines.base import GenerateParams

    params = GenerateParams(max_new_tokens=new)  # no stop ids
    start, n = time.perf_counter(), 0
    for lo in range(0, len(prompts), batch):
        chunk = prompts[lo : lo + batch]
        n += sum(len(g.tokens) for g in runner.generate(chunk, params, list(range(len(chunk)))))
    return n, time.perf_counter() - start


def auto_batch(runner, prompts, new: int):
    return runner.plan_batch(max(len(p) for p in prompts) + new, len(prompts))


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# --- (1) streamed vs resident on SmolLM2 ----------------------------------------------------


def bench_ring(rows: int, new: int, rounds: int) -> dict:
    folder = smollm2()
    prompts = chat_prompts(folder, rows)
    runners = {
        "resident": open_runner(folder, resident=True, dtype="float32"),
        "ring2": open_runner(folder, ring=2, dtype="float32"),
    }
    plan = auto_batch(runners["ring2"], prompts, new)
    print(f"ring: {rows} rows x {new} tokens; auto {plan.line()}", flush=True)
    sides = [(m, b) for b in (8, plan.rows) for m in runners]
    for mode, b in sides:  # warm-up: the slot pool, the allocator
        generate_all(runners[mode], prompts[:b], b, 2)
    best: dict[str, float] = {}
    for r in range(rounds):
        for mode, b in sides if r % 2 == 0 else sides[::-1]:
            n, s = generate_all(runners[mode], prompts, b, new)
            key = f"{mode}@{b}"
            best[key] = max(best.get(key, 0.0), n / s)
            print(f"  round {r + 1} {key}: {n / s:.1f} tok/s ({n} tokens, {s:.1f} s)", flush=True)
    for runner in runners.values():
        runner.close()
    a = plan.rows
    ratios = {
        "ring2/resident at 8": best["ring2@8"] / best["resident@8"],
        f"ring2/resident at {a}": best[f"ring2@{a}"] / best[f"resident@{a}"],
        f"ring2@{a}/resident@8": best[f"ring2@{a}"] / best["resident@8"],
        f"ring2@{a}/ring2@8": best[f"ring2@{a}"] / best["ring2@8"],
    }
    for k, v in ratios.items():
        print(f"ring: {k} = {v:.2f}x", flush=True)
    return {
        "rows": rows,
        "new_tokens": new,
        "rounds": rounds,
        "auto_batch": a,
        "auto_why": plan.why,
        "tokens_per_s": {k: round(v, 2) for k, v in best.items()},
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "load_average_after": load_average(),
    }


# --- (2) a model 8x the ring budget against the read bound ----------------------------------


def read_rate(files: list[Path], evict: bool) -> float:
    """Bytes/s of a sequential ``read()`` of ``files`` in 16 MiB chunks."""
    total, seconds = 0, 0.0
    for p in files:
        with open(p, "rb", buffering=0) as f:
            if evict:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            start = time.perf_counter()
            while chunk := f.read(1 << 24):
                total += len(chunk)
            seconds += time.perf_counter() - start
    return total / seconds


def decode_steps_per_s(runner, prompts, batch: int, new: int) -> float:
    """Decode steps/s: a generate of ``new`` + 1 tokens minus one of 1 (the prefill cancels)."""
    _, one = generate_all(runner, prompts[:batch], batch, 1)
    _, many = generate_all(runner, prompts[:batch], batch, new + 1)
    return new / max(many - one, 1e-9)


def bench_bound(
    layers: int, hidden: int, rows: int, new: int, rounds: int, work: Path, dtype: str
) -> dict:
    from spill.models.config import load_config
    from spill.models.sources.tiny import write_tiny
    from spill.models.weights import weight_files

    folder = work / f"tiny-llama-h{hidden}-l{layers}"
    if not (folder / "config.json").is_file():
        write_tiny(folder, "llama", seed=0, layers=layers, hidden=hidden)
    cfg = load_config(folder)
    files = [folder / s for s in weight_files(folder).shards]
    model_bytes = cfg.layer_params() * layers * (4 if dtype == "float32" else 2)
    memory = model_bytes // 8
    step_bytes = cfg.layer_params() * layers * 2  # bf16 on disk: every layer, once a step
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, size=32) for _ in range(rows)]
    streamed = open_runner(folder, memory=memory, dtype=dtype)
    resident = open_runner(folder, resident=True, dtype=dtype)
    plan = auto_batch(streamed, prompts, new)
    print(
        f"bound: {layers} x hidden {hidden}, {model_bytes / 1e6:.0f} MB {dtype} = 8x --memory "
        f"{memory / 1e6:.0f} MB (ring {streamed.info.ring}); {step_bytes / 1e6:.0f} MB read "
        f"a decode step; auto {plan.line()}",
        flush=True,
    )
    batches = sorted({1, plan.rows})
    best: dict[str, float] = {}
    for r in range(rounds):
        cold = read_rate(files, evict=True)
        warm = read_rate(files, evict=False)
        best["read_cold_Bps"] = max(best.get("read_cold_Bps", 0.0), cold)
        best["read_warm_Bps"] = max(best.get("read_warm_Bps", 0.0), warm)
        for b in batches if r % 2 == 0 else batches[::-1]:
            for name, runner in (("streamed", streamed), ("resident", resident)):
                sps = decode_steps_per_s(runner, prompts, b, new)
                key = f"{name}@{b}"
                best[key] = max(best.get(key, 0.0), sps)
                print(f"  round {r + 1} {key}: {sps:.2f} steps/s", flush=True)
        print(f"  round {r + 1} read: cold-ish {cold / 1e9:.2f} GB/s, cache {warm / 1e9:.2f} GB/s")
    streamed.close()
    resident.close()
    out: dict = {
        "layers": layers,
        "hidden": hidden,
        "dtype": dtype,
        "model_bytes": model_bytes,
        "memory": memory,
        "ring": streamed.info.ring,
        "bytes_per_step": step_bytes,
        "auto_batch": plan.rows,
        "read_GBps": {
            "cold_ish": round(best["read_cold_Bps"] / 1e9, 2),
            "page_cache": round(best["read_warm_Bps"] / 1e9, 2),
        },
        "per_batch": {},
    }
    for b in batches:
        sps = best[f"streamed@{b}"]
        bound = {k: best[f"read_{k}_Bps"] / step_bytes for k in ("warm", "cold")}
        row = {
            "streamed_steps_per_s": round(sps, 3),
            "streamed_tokens_per_s": round(sps * b, 2),
            "resident_steps_per_s": round(best[f"resident@{b}"], 3),
            "bound_steps_per_s_page_cache": round(bound["warm"], 3),
            "bound_steps_per_s_cold_ish": round(bound["cold"], 3),
            "fraction_of_bound_page_cache": round(sps / bound["warm"], 3),
            "fraction_of_bound_cold_ish": round(sps / bound["cold"], 3),
            "fraction_of_min_bound_and_resident": round(
                sps / min(bound["warm"], best[f"resident@{b}"]), 3
            ),
        }
        out["per_batch"][b] = row
        print(f"bound: batch {b}: {json.dumps(row)}", flush=True)
    out["load_average_after"] = load_average()
    return out


# --- profile of decode steps -----------------------------------------------------------------


def profile_decode(runner, prompts, batch: int, new: int, top: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile, schedule

    from spill.engines.core.model import Model

    forward = Model.forward
    sched = schedule(wait=1, warmup=1, active=new - 2, repeat=1)  # the prefill is forward 1
    with profile(activities=[ProfilerActivity.CPU], schedule=sched) as prof:

        def stepped(self, *a, **k):
            out = forward(self, *a, **k)
            prof.step()
            return out

        Model.forward = stepped
        try:
            generate_all(runner, prompts[:batch], batch, new + 1)
        finally:
            Model.forward = forward
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) or 1
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [
        {
            "name": e.key,
            "self_ms": round(e.self_cpu_time_total / 1e3, 1),
            "share": round(e.self_cpu_time_total / total, 3),
            "calls": e.count,
        }
        for e in rows
    ]


def bench_profile(rows: int, new: int, top: int = 10) -> dict:
    folder = smollm2()
    prompts = chat_prompts(folder, rows)
    out = {}
    streamed = open_runner(folder, ring=2, dtype="float32")
    batches = sorted({8, auto_batch(streamed, prompts, new).rows})
    for mode, runner in (("ring2", streamed), ("resident", None)):
        runner = runner or open_runner(folder, resident=True, dtype="float32")
        for b in batches:
            generate_all(runner, prompts[:b], b, 2)  # warm-up
            steps = decode_steps_per_s(runner, prompts, b, new)
            table = profile_decode(runner, prompts, b, new, top)
            out[f"{mode}@{b}"] = {"decode_steps_per_s": round(steps, 3), "top": table}
            print(f"profile {mode}@{b}: {steps:.2f} decode steps/s", flush=True)
            for e in table:
                print(f"    {e['self_ms']:9.1f} ms {e['share']:6.1%} {e['calls']:6d}  {e['name']}")
        runner.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", nargs="?", default="all", choices=["ring", "bound", "profile", "all"])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--bound-rows", type=int, default=16)
    p.add_argument("--bound-dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--work", type=Path, default=Path("/tmp/spill-bench-generate"))
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)

    result: dict = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(),
            "load_average_before": load_average(),
        }
    }
    a.work.mkdir(parents=True, exist_ok=True)
    if a.what in ("ring", "all"):
        result["ring"] = bench_ring(a.rows, a.new, a.rounds)
    if a.what in ("bound", "all"):
        result["bound"] = bench_bound(
            a.layers, a.hidden, a.bound_rows, 8, a.rounds, a.work, a.bound_dtype
        )
    if a.what in ("profile", "all"):
        result["profile"] = bench_profile(a.rows, a.new)
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
