"""Build benchmarks for docs/reports/003-build.md. Each compares two things measured in the
same run, alternating, and prints the ratio; nothing here asserts a time.

    python bench/build.py startup     # finished `spill build` / `spill status` vs `import yaml`
    python bench/build.py overhead    # a toy build vs the same stages as bare spill commands
    python bench/build.py all --json docs/reports/003-build.json

Everything runs on projects/toy in ``--work`` (default /tmp/spill-bench-build) with its own
SPILL_HOME, so the tiny model is generated there and no network is needed.
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def timed(cmd: list[str], env: dict, check: bool = True) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if check and proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    return seconds


def project(work: Path, name: str) -> Path:
    dst = work / name
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(ROOT / "projects" / "toy", dst, ignore=shutil.ignore_patterns(".spill"))
    return dst


def startup(work: Path, env: dict, runs: int) -> dict:
    toy = project(work, "startup")
    timed([PY, "-m", "spill", "build", str(toy)], env)  # the build to be found finished
    cases = {
        "import yaml": [PY, "-c", "import yaml"],
        "spill build (finished)": [PY, "-m", "spill", "build", str(toy)],
        "spill status": [PY, "-m", "spill", "status", str(toy)],
    }
    samples: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(runs):  # alternate, so a busy moment hits every case alike
        for name, cmd in cases.items():
            samples[name].append(timed(cmd, env))
    med = {k: statistics.median(v) for k, v in samples.items()}
    base = med["import yaml"]
    return {
        "runs": runs,
        "median_s": {k: round(v, 4) for k, v in med.items()},
        "min_s": {k: round(min(v), 4) for k, v in samples.items()},
        "ratio_to_import_yaml": {
            k: round(v / base, 2) for k, v in med.items() if k != "import yaml"
        },
    }


def overhead(work: Path, env: dict, runs: int) -> dict:
    """The toy build (one process, planning included) vs bare eval/tune/eval commands."""
    ref = project(work, "ref")
    timed([PY, "-m", "spill", "build", str(ref)], env)
    files = ref / ".spill" / "files"
    doc = json.loads((ref / ".spill" / "state.json").read_text())
    t, model = doc["config"]["tune"], doc["config"]["model"]["name"]
    common = ["--dtype", doc["config"]["engine"]["dtype"], "--engine", "torch"]
    tune_args = [
        "--steps", str(t["steps"]), "--lr", str(t["lr"]), "--warmup", str(t["warmup"]),
        "--rank", str(t["rank"]), "--targets", t["targets"], "--batch", str(t["batch"]),
        "--micro-batch", str(t["micro_batch"]), "--seq-len", str(t["seq_len"]),
        "--ckpt-every", str(t["ckpt_every"]), "--seed", str(doc["config"]["seed"]),
    ]  # fmt: skip
    samples: dict[str, list[float]] = {"build": [], "bare": [], "dry-run": []}
    for i in range(runs):
        toy = project(work, f"build{i}")
        samples["build"].append(timed([PY, "-m", "spill", "build", str(toy)], env))
        bare = work / f"bare{i}"
        shutil.rmtree(bare, ignore_errors=True)
        test, train = files / "test.jsonl", files / "train.jsonl"
        t0 = time.perf_counter()
        timed(
            [PY, "-m", "spill", "eval", model, str(test), "--state", str(bare / "base"), *common],
            env,
        )
        timed([PY, "-m", "spill", "tune", model, str(train), "--name", "toy",
               "--state", str(bare / "tune"), *tune_args, *common], env)  # fmt: skip
        timed([PY, "-m", "spill", "eval", model, str(test), "--adapter", str(bare / "tune" / "adapter"),
               "--state", str(bare / "eval"), *common], env)  # fmt: skip
        samples["bare"].append(time.perf_counter() - t0)
        fresh = project(work, f"dry{i}")
        samples["dry-run"].append(timed([PY, "-m", "spill", "build", str(fresh), "--dry-run"], env))
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "runs": runs,
        "median_s": {k: round(v, 3) for k, v in med.items()},
        "build_over_bare": round(med["build"] / med["bare"] - 1, 4),
        "dry_run_share_of_build": round(med["dry-run"] / med["build"], 4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["startup", "overhead", "all"])
    ap.add_argument("--work", type=Path, default=Path("/tmp/spill-bench-build"))
    ap.add_argument("--runs", type=int, default=0, help="repeats (default: 21 startup, 3 overhead)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, SPILL_HOME=str(args.work / "home"), HF_HUB_OFFLINE="1")
    out: dict = {
        "machine": platform.node(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_before": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    if args.what in ("startup", "all"):
        out["startup"] = startup(args.work, env, args.runs or 21)
        print(json.dumps(out["startup"], indent=2))
    if args.what in ("overhead", "all"):
        out["overhead"] = overhead(args.work, env, args.runs or 3)
        print(json.dumps(out["overhead"], indent=2))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
