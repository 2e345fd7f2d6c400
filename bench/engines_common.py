"""What the engine benchmarks share (bench/engines.py and its parts): fresh ``python -m spill``
processes with their own SPILL_HOME, the inputs they read, and a description of the machine."""

from __future__ import annotations

import csv
import json
import os
import platform
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
CLI = Path(__file__).with_name("engines.py")  # its ``_worker`` mode runs engines_agree's worker
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
        [PY, str(CLI), "_worker", json.dumps(spec)], env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"worker {spec['op']} on {spec['engine']} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def both(fn, jobs: dict[str, tuple]) -> dict:
    """``{name: fn(*args)}`` for every ``name: args``, two processes at a time (two cores)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(fn, *args) for name, args in jobs.items()}
        return {name: f.result() for name, f in futures.items()}


# --- inputs ---------------------------------------------------------------------------------------


def tickets(n: int | None = None) -> list[dict]:
    with open(ROOT / "projects" / "tickets" / "tickets.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return rows[:n] if n else rows


def tiny(work: Path, name: str, family: str, **kw) -> Path:
    from spill.models.sources.tiny import write_tiny

    folder = work / "models" / name
    if not (folder / "config.json").is_file():
        write_tiny(folder, family=family, **kw)
    return folder


def smollm2(work: Path) -> Path:
    from spill.models.gguf.importer import find_smollm2_gguf, import_gguf

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
