"""Two processes against two threads on this host's cores (issue 23), for
docs/reports/014-procs.md. Everything is measured in one run, sides alternating; nothing here
asserts a time.

    python bench/procs.py [--rounds 2] [--steps 6] [--json OUT]

The work: bench/tune.py's (SmolLM2-135M's float import, LoRA r16 alpha 32 on all seven linears,
dropout 0, 4 x 128 tokens a step, AdamW lr 1e-4), with the step's 4 rows as two micro-batches
of 2 (``--batch 4 --micro-batch 2``): the unit two processes share. Sides, each a fresh
``spill tune`` (the real CLI) in its own worker process:

* ``world 1 x 2 threads``: one process, torch on two threads (OMP/MKL/OpenBLAS 2);
* ``world 2 x 1 thread``: ``--procs 2`` (torch's elastic launcher), one thread a rank;
* ``world 1 x 1 thread``: one process on one thread, the run whose bits world 2 must equal.

Tokens/s are steady-state, from the arrival of the progress line of step 1 to that of step N
(``SPILL_PROGRESS=lines``, one line a step, read as it arrives), so loading, rendezvous, the first
step and the final save are excluded. Peak RSS: the worker's own ``ru_maxrss`` (world 1) and
each rank's (``--procs`` reports them in its summary); the launcher's is listed beside. The time
in collectives (``communication_s``: the stop vote and the gradient all-gather, waiting for the
slower rank included) is given as a fraction of the run's step time. Finally the last
checkpoints are compared tensor by tensor: world 2 against world 1 on one thread (the promise:
equal) and on two threads (intra-op threads may change float32 sums).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.tune import ALPHA, LENGTH, LR, RANK, ROWS, env_for, model_folder, train_file  # noqa: E402

PY = sys.executable
REPO = Path(__file__).resolve().parents[1]
MICRO = 2
SIDES = {  # name: (threads, extra flags)
    "world 1 x 2 threads": (2, []),
    "world 2 x 1 thread": (1, ["--procs", "2"]),
    "world 1 x 1 thread": (1, []),
}


def worker(spec: dict) -> None:
    """One ``spill tune`` in this process (its ranks, with ``--procs``, in their own); prints
    the summary, then this process's peak RSS on the last line."""
    import resource

    from spill import cli

    steps = spec["steps"]
    args = ["tune", spec["model"], spec["train"], "--name", "bench", "--state", spec["state"]]
    args += ["--steps", str(steps), "--ckpt-every", str(steps), "--rank", str(RANK)]
    args += ["--alpha", str(ALPHA), "--targets", "all", "--dropout", "0", "--lr", str(LR)]
    args += ["--warmup", "0", "--batch", str(ROWS), "--micro-batch", str(MICRO)]
    args += ["--seq-len", str(LENGTH), "--seed", "0", "--dtype", "float32", "--json"]
    code = cli.main([*args, *spec["flags"]])
    print(
        json.dumps(
            {"code": code, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        )
    )


def run_side(spec: dict, env: dict) -> dict:
    env = {**env, "SPILL_PROGRESS": "lines", "SPILL_PROGRESS_EVERY": "0"}
    proc = subprocess.Popen(
        [PY, __file__, "_worker", json.dumps(spec)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
    )
    arrivals, err = {}, []
    for line in proc.stderr:  # read as it arrives: each step's line is timed here
        err.append(line)
        if line.startswith("tune: step "):
            arrivals[int(line.split()[2].split("/")[0])] = time.perf_counter()
    out = proc.stdout.read()
    proc.wait()
    *summary, last = out.strip().splitlines()
    tail = json.loads(last)
    if proc.returncode != 0 or tail["code"] != 0:
        raise SystemExit(f"spill tune failed ({tail['code']}):\n{''.join(err)[-3000:]}")
    doc = json.loads("\n".join(summary))
    n = spec["steps"]
    step_s = (arrivals[n] - arrivals[1]) / (n - 1)
    procs = doc.get("procs", 1)
    got = {
        "tokens_per_s": ROWS * LENGTH / step_s,
        "step_s": round(step_s, 3),
        "prerun": [ln.strip() for ln in err if ln.startswith("spill tune")],
        "worker_rss_mb": round(tail["rss_mb"], 1),
        "peak_rss_mb_per_rank": doc.get("peak_rss_mb") or [round(tail["rss_mb"], 1)],
        "seconds": doc["seconds"],
    }
    if procs > 1:
        got["communication_s"] = doc["communication_s"]
        got["communication_fraction"] = round(doc["communication_s"] / doc["seconds"], 3)
    return got


def compare(a: str, b: str) -> dict:
    """The newest checkpoints of two states, tensor by tensor."""
    import numpy as np

    from spill.control.place import Place
    from spill.payloads.checkpoint import latest_checkpoint, load_checkpoint
    from spill.store.location import location

    pa, oa, sa = load_checkpoint(latest_checkpoint(Place(location(a))))
    pb, ob, sb = load_checkpoint(latest_checkpoint(Place(location(b))))
    tensors = {**pa, **oa}
    other = {**pb, **ob}
    equal = sum(np.array_equal(tensors[k], other[k]) for k in other)
    worst = max(float(np.max(np.abs(tensors[k] - other[k]))) for k in other)
    return {
        "tensors": len(other),
        "equal": int(equal),
        "max_abs_diff": worst,
        "losses_equal": sa["losses"] == sb["losses"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--home", type=Path, default=Path(tempfile.gettempdir()) / "spill-bench-tune")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    home = a.home / "home"
    home.mkdir(parents=True, exist_ok=True)
    folder = model_folder(home)
    train = train_file(a.home / "train.jsonl")
    base = {"model": str(folder), "train": str(train), "steps": a.steps}
    results: dict[str, list[dict]] = {k: [] for k in SIDES}
    states: dict[str, str] = {}
    for r in range(a.rounds):
        for name in SIDES if r % 2 == 0 else reversed(SIDES):
            threads, flags = SIDES[name]
            state = a.home / "state-procs" / f"{name.replace(' ', '-')}-{r}"
            shutil.rmtree(state, ignore_errors=True)
            got = run_side(
                base | {"flags": flags, "state": str(state)}, env_for(home, threads, REPO)
            )
            got["load_average"] = os.getloadavg()[0]
            results[name].append(got)
            states[name] = str(state)
            print(f"round {r + 1} {name}: {got['tokens_per_s']:.1f} tok/s ({got['step_s']} s/step), "
                  f"peak RSS per rank {got['peak_rss_mb_per_rank']} MB"
                  + (f", {got['communication_fraction']:.1%} of the run in collectives"
                     if "communication_fraction" in got else ""), flush=True)  # fmt: skip
    two, one = "world 2 x 1 thread", "world 1 x 2 threads"
    speed = [
        x["tokens_per_s"] / y["tokens_per_s"]
        for x, y in zip(results[two], results[one], strict=True)
    ]
    vs_one_thread = [
        x["tokens_per_s"] / y["tokens_per_s"]
        for x, y in zip(results[two], results["world 1 x 1 thread"], strict=True)
    ]
    bits = {
        "world 2 x 1 thread vs world 1 x 1 thread": compare(
            states[two], states["world 1 x 1 thread"]
        ),
        "world 2 x 1 thread vs world 1 x 2 threads": compare(states[two], states[one]),
    }
    lines = [
        f"{two} vs {one}: tokens/s {' and '.join(f'{s:.2f}x' for s in speed)} "
        f"(median {statistics.median(speed):.2f}x; goal >= 1.5x)",
        f"{two} vs world 1 x 1 thread: median {statistics.median(vs_one_thread):.2f}x",
        *(f"bits, {k}: {v['equal']}/{v['tensors']} tensors equal, max |diff| {v['max_abs_diff']:.3g}, "
          f"losses equal {v['losses_equal']}" for k, v in bits.items()),
    ]  # fmt: skip
    for line in lines:
        print(line)
    if a.json:
        doc = {
            "machine": {
                "cpu": platform.processor() or platform.machine(),
                "cores": os.cpu_count(),
                "python": platform.python_version(),
            },
            "settings": {
                "rows": ROWS,
                "micro_batch": MICRO,
                "length": LENGTH,
                "rank": RANK,
                "alpha": ALPHA,
                "steps": a.steps,
                "rounds": a.rounds,
            },  # fmt: skip
            "results": results,
            "ratios": {
                "world2_vs_world1_2threads": speed,
                "world2_vs_world1_1thread": vs_one_thread,
            },
            "bits": bits,
            "lines": lines,
        }
        a.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "_worker":
        worker(json.loads(sys.argv[2]))
    else:
        sys.exit(main())
