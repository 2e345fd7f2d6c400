"""What a sweep's launcher costs (issue 12), for docs/reports/010-sweeps.md. Everything is
measured in one run, sides alternating; nothing here asserts a time.

    python bench/sweep.py [--rounds 3] [--sweep tune.lr=0.002,0.005] [--json OUT] [-- OVERRIDES]

(overrides after ``--``, such as ``tune.steps=8``, apply to every build: a quick smoke run)

The sweep: projects/toy with two combinations (``tune.lr=0.002,0.005`` by default, the toy's
300 tune steps each). Every side starts from its own fresh copy of the project (no ``.spill/``)
and a shared ``SPILL_HOME`` whose tiny model an untimed build made first. Each round times, in an
order that rotates from round to round:

* alone: ``spill build COPY_A tune.lr=A`` then ``spill build COPY_B tune.lr=B``, one after the
  other, each its own project copy and state; its wall is the sum of the two;
* basic: ``spill build COPY -m tune.lr=A,B`` (Hydra's basic launcher: the jobs one after the
  other, in the CLI's process);
* joblib: the same with ``hydra/launcher=joblib hydra.launcher.n_jobs=2`` (loky processes);
* ray: ``hydra/launcher=ray`` (``ray.init()`` from the launcher's config starts a local cluster,
  each job a Ray task; the CLI shuts the cluster down before it prints);
* submitit: ``hydra/launcher=submitit_local`` (one ``submitit`` process per job, polled).

The ratio of a side is its wall over the round's alone wall; a parallel launcher can come in
under 1 on the two cores. A sweep's wall is split by its jobs' own ``started`` and ``seconds``
(from ``--json``): before the first job starts (CLI start-up, Hydra, the launcher's start: Ray's
cluster, loky's or submitit's processes), from the first job's start to the last one's end, and
after the last job (results back, shutdown). A sweep that does not exit 0 with every job ``done`` stops the bench.
Each round also times, in a fresh ``python``, ``import ray``, ``ray.init()`` (a local cluster,
as the launcher starts it) and ``ray.shutdown()``: the part of the Ray side that is Ray's own.
Absent launchers (no ``[ray]`` or ``[slurm]`` extra) are left out and named in the output.
"""

from __future__ import annotations

import argparse
import importlib.util
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
LAUNCHERS = {
    "basic": [],
    "joblib": ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"],
    "ray": ["hydra/launcher=ray"],
    "submitit": ["hydra/launcher=submitit_local"],
}
NEEDS = {
    "joblib": "hydra_plugins.hydra_joblib_launcher",
    "ray": "hydra_plugins.hydra_ray_launcher",
    "submitit": "hydra_plugins.hydra_submitit_launcher",
}
RAY_PROBE = """
import json, time
t = time.perf_counter()
import ray
imported = time.perf_counter()
ray.init()
started = time.perf_counter()
ray.shutdown()
done = time.perf_counter()
print(json.dumps({"import ray": imported - t, "ray.init()": started - imported,
                  "ray.shutdown()": done - started}))
"""


def fresh(work: Path, name: str) -> Path:
    dst = work / name
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(REPO / "projects" / "toy", dst, ignore=shutil.ignore_patterns(".spill"))
    return dst


def timed(cmd: list[str], env: dict) -> tuple[float, str]:
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd="/")
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return wall, proc.stdout


def alone(work: Path, values: list[str], key: str, extra: list[str], env: dict) -> dict:
    walls = []
    for i, v in enumerate(values):
        copy = fresh(work, f"alone-{i}")
        cmd = [PY, "-m", "spill", "build", str(copy), *extra, f"{key}={v}", "--json"]
        wall, out = timed(cmd, env)
        stages = json.loads(out)["stages"]
        assert all(s["status"] in ("done", "skipped") for s in stages.values()), stages
        walls.append(wall)
    return {"wall": sum(walls), "builds": walls}


def swept(work: Path, name: str, sweep: str, extra: list[str], env: dict) -> dict:
    copy = fresh(work, f"sweep-{name}")
    cmd = [PY, "-m", "spill", "build", str(copy), "-m", *extra, sweep, *LAUNCHERS[name], "--json"]
    t0 = time.time()
    wall, out = timed(cmd, env)
    t1 = time.time()
    runs = json.loads(out)["runs"]
    assert [r["status"] for r in runs] == ["done"] * len(runs), runs
    first = min(r["started"] for r in runs)
    last = max(r["started"] + r["seconds"] for r in runs)
    return {
        "wall": wall,
        "before first job": first - t0,
        "first job start to last job end": last - first,
        "after last job": t1 - last,
        "job seconds": [r["seconds"] for r in runs],
        "pids": sorted({r["pid"] for r in runs}),
    }


def ray_probe(env: dict) -> dict:
    _, out = timed([PY, "-c", RAY_PROBE], env)
    return {k: round(v, 3) for k, v in json.loads(out.strip().splitlines()[-1]).items()}


def summarize(rounds: list[dict], sides: list[str]) -> dict:
    def med(f) -> float:
        return round(statistics.median(f(r) for r in rounds), 3)

    out: dict = {
        "median wall s": {s: med(lambda r, s=s: r[s]["wall"]) for s in ["alone", *sides]},
        "median ratio wall / alone": {
            s: med(lambda r, s=s: r[s]["wall"] / r["alone"]["wall"]) for s in sides
        },
        "ratio range": {
            s: [
                round(min(r[s]["wall"] / r["alone"]["wall"] for r in rounds), 3),
                round(max(r[s]["wall"] / r["alone"]["wall"] for r in rounds), 3),
            ]
            for s in sides
        },
    }
    parts = ("before first job", "first job start to last job end", "after last job")
    out["median parts s"] = {s: {p: med(lambda r, s=s, p=p: r[s][p]) for p in parts} for s in sides}
    if "ray" in sides:
        keys = rounds[0]["ray probe"]
        out["median ray probe s"] = {k: med(lambda r, k=k: r["ray probe"][k]) for k in keys}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=None, help="a local folder (default: a fresh temporary one)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sweep", default="tune.lr=0.002,0.005", help="one key, two or more values")
    ap.add_argument("--json", help="also write the numbers here")
    ap.add_argument("extra", nargs="*", help="overrides for every build (after --)")
    args = ap.parse_args()
    key, _, values = args.sweep.partition("=")
    work = Path(args.work or tempfile.mkdtemp(prefix="spill-bench-sweep-"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, SPILL_HOME=str(work / "home"), HF_HUB_OFFLINE="1")
    for k in ("SPILL_DRILL", "SPILL_PROGRESS", "SPILL_LEASE"):
        env.pop(k, None)
    sides = [s for s in LAUNCHERS if s not in NEEDS or importlib.util.find_spec(NEEDS[s])]
    out: dict = {
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.system()}",
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "load_before": os.getloadavg()[0],
        "argv": sys.argv[1:],
        "sweep": args.sweep,
        "sides": ["alone", *sides],
        "left_out": sorted(set(LAUNCHERS) - set(sides)),
        "commit": subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
    }
    t_all = time.perf_counter()
    warm = fresh(work, "warm-up")  # the tiny model is generated here, once, untimed
    warm_up = [PY, "-m", "spill", "build", str(warm), *args.extra]
    out["warm-up build s"] = round(timed(warm_up, env)[0], 3)
    rounds = []
    order = ["alone", *sides]
    for r in range(args.rounds):
        turn = order[r % len(order) :] + order[: r % len(order)]
        res: dict = {"order": turn, "load": os.getloadavg()[0]}
        for side in turn:
            if side == "alone":
                res[side] = alone(work, values.split(","), key, args.extra, env)
            else:
                res[side] = swept(work, side, args.sweep, args.extra, env)
            print(f"round {r} {side}: {res[side]['wall']:.2f} s", file=sys.stderr)
        if "ray" in sides:
            res["ray probe"] = ray_probe(env)
        rounds.append(res)
    out["summary"] = summarize(rounds, sides)
    out["raw"] = rounds
    out["load_after"] = os.getloadavg()[0]
    out["bench_seconds"] = round(time.perf_counter() - t_all, 1)
    print(json.dumps(out["summary"], indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
