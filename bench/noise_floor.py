"""The noise floor of a build (issue 12): how far honest builds of one project spread when they
differ only in what should not matter, and the tolerance a relay is judged by.

    python bench/noise_floor.py [--project tickets|toy ...] [--work DIR] [--json OUT]
                                [--jobs N] [--threads T]

For each project, six complete builds, each a fresh copy of ``projects/<name>`` with its own
state, one after the other on this machine:

* ``torch``, ``mlx``: the project as it is, on each engine (each engine's measured numerics);
* ``torch-mbN``, ``mlx-mbN``: the same with another micro-batch shape for the same batch
  (``tune.micro_batch``: the project's batch when it accumulates, else half of it);
* ``torch>mlx``, ``mlx>torch``: built with ``--stop-after tune:K`` on one engine, moved with
  ``spill move`` to a second place, finished there on the other engine with a second
  ``SPILL_HOME`` (a second "machine": its own model cache). K is the relay's stop step.

``--jobs N`` runs N builds at once and ``--threads T`` gives each T compute threads (torch's
intra-op pool, OpenMP, OpenBLAS): on a busy machine single-threaded builds side by side waste
no time spinning. The thread count is one more thing that should not matter; the JSON records
it. A build whose state already finished is not run again (``spill build`` prints its table), so an
interrupted measurement continues where it stopped. Per stage and score (accuracy of
``eval:base`` and ``eval``), the JSON records every build's value, the spread (max - min) and the
tolerance the relay uses: the spread plus one held-out row (1 / rows). Justification: a relay
and its reference are each one honest build, so where both fall inside the range the honest
builds spanned they differ by at most the spread; the one row covers a build that lands one row
outside that range, the smallest step a score can take. ``spill example relay`` ships this JSON. ``--collect`` runs nothing and records the builds that
finished (the tolerance then comes from those, and the JSON lists the others).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

PY = sys.executable
REPO = Path(__file__).resolve().parents[1]
STOP = {"tickets": 20, "toy": 100}  # the relay's --stop-after tune:K for each project
SCORES = ("accuracy",)


THREADS: dict[str, str] = {}  # the compute-thread settings every build gets (--threads)


def spill(*args: str, home: Path, cwd: Path) -> dict[str, Any]:
    env = dict(os.environ, SPILL_HOME=str(home), PYTHONUNBUFFERED="1", **THREADS)
    t = time.perf_counter()
    out = subprocess.run(
        [PY, "-m", "spill", *args], cwd=cwd, env=env, capture_output=True, text=True
    )
    if out.returncode != 0:
        sys.exit(f"spill {' '.join(args)} exited {out.returncode}:\n{out.stderr[-3000:]}")
    print(f"  spill {' '.join(args)}: {time.perf_counter() - t:.1f} s", flush=True)
    return json.loads(out.stdout) if "--json" in args else {}


def micro_batches(project: Path) -> tuple[int, int]:
    """The project's (batch, micro-batch) as composed, read from a dry run's JSON."""
    import yaml

    tune = yaml.safe_load((project / "spill.yaml").read_text())["tune"]
    return int(tune["batch"]), int(tune.get("micro_batch") or tune["batch"])


def builds(name: str) -> list[dict[str, Any]]:
    src = REPO / "projects" / name
    batch, micro = micro_batches(src)
    other = batch if micro != batch else batch // 2
    return [
        {"name": "torch", "engine": "torch"},
        {"name": "mlx", "engine": "mlx"},
        {"name": f"torch-mb{other}", "engine": "torch", "overrides": [f"tune.micro_batch={other}"]},
        {"name": f"mlx-mb{other}", "engine": "mlx", "overrides": [f"tune.micro_batch={other}"]},
        {"name": "torch>mlx", "engine": "torch", "then": "mlx"},
        {"name": "mlx>torch", "engine": "mlx", "then": "torch"},
    ]


def one(name: str, spec: dict[str, Any], work: Path) -> dict[str, Any]:
    """One complete build; its final ``spill build --json`` plus how it was made."""
    slug = spec["name"].replace(">", "-to-")
    root, home = work / name / slug, work / "home-a"
    if not root.exists():
        shutil.copytree(REPO / "projects" / name, root, ignore=shutil.ignore_patterns(".spill"))
    over = spec.get("overrides", [])
    t = time.perf_counter()
    if then := spec.get("then"):
        dest = work / name / f"{slug}-b"
        if not dest.exists():
            stop = f"tune:{STOP[name]}"
            spill(
                "build",
                str(root),
                "--engine",
                spec["engine"],
                "--stop-after",
                stop,
                "--wait",
                *over,
                home=home,
                cwd=work,
            )
            spill("move", str(root), str(dest), "--json", "--wait", home=home, cwd=work)
        root, home, engine = dest, work / "home-b", then
    else:
        engine = spec["engine"]
    doc = spill(
        "build", str(root), "--engine", engine, "--json", "--wait", *over, home=home, cwd=work
    )
    return record(spec, doc, time.perf_counter() - t)


def record(spec: dict[str, Any], doc: dict[str, Any], seconds: float | None) -> dict[str, Any]:
    """A finished build's scores and producers, from its ``--json`` (build or status)."""
    stages = doc["stages"]
    return {
        **spec,
        "seconds": None if seconds is None else round(seconds, 1),
        "threads": THREADS.get("OMP_NUM_THREADS", "default"),
        "scores": {
            s: {k: stages[s]["result"].get(k) for k in SCORES} for s in ("eval:base", "eval")
        },
        "rows": stages["eval"]["result"]["rows"],
        "gold_logprob_per_token": {
            s: stages[s]["result"].get("gold_logprob_per_token") for s in ("eval:base", "eval")
        },
        "tune_loss": stages["tune"]["result"].get("loss"),
        "producers": {
            s: [(p["engine"], p["numerics"]) for p in stages[s]["producers"]] for s in stages
        },
    }


def collect(name: str, spec: dict[str, Any], work: Path) -> dict[str, Any]:
    """A build's record if it finished, else where it got to (``--collect``: runs nothing)."""
    slug = spec["name"].replace(">", "-to-")
    root = work / name / (f"{slug}-b" if spec.get("then") else slug)
    out = subprocess.run(
        [PY, "-m", "spill", "status", str(root), "--json"], capture_output=True, text=True
    )
    doc = json.loads(out.stdout) if out.returncode == 0 else {"stages": {}}
    stages = doc["stages"]
    if stages and all(r["status"] in ("done", "skipped") for r in stages.values()):
        return record(spec, doc, None)
    where = {s: f"{r['status']} {r['progress']}/{r['total']}" for s, r in stages.items()}
    return {**spec, "unfinished": where or "not started"}


def floor(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per stage and score: every value, the spread, and the tolerance (spread + one row), from
    the builds that finished; the ones that did not are listed."""
    unfinished = {r["name"]: r["unfinished"] for r in runs if "unfinished" in r}
    runs = [r for r in runs if "unfinished" not in r]
    if not runs:
        return {"builds": 0, "unfinished": unfinished, "stages": {}}
    rows = {r["rows"] for r in runs}
    assert len(rows) == 1, f"builds graded different row counts: {rows}"
    n = rows.pop()
    out: dict[str, Any] = {}
    for stage in ("eval:base", "eval"):
        for score in SCORES:
            values = [r["scores"][stage][score] for r in runs]
            spread = max(values) - min(values)
            out.setdefault(stage, {})[score] = {
                "values": dict(zip((r["name"] for r in runs), values, strict=True)),
                "min": min(values),
                "max": max(values),
                "spread": round(spread, 6),
                "tolerance": round(spread + 1 / n, 6),
            }
    return {"rows": n, "builds": len(runs), "unfinished": unfinished, "stages": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--project", action="append", choices=sorted(STOP))
    ap.add_argument("--work", type=Path, default=Path("/tmp/spill-noise-floor"))
    ap.add_argument("--json", type=Path, default=REPO / "docs/reports/009-noise-floor.json")
    ap.add_argument("--jobs", type=int, default=1, help="builds at once")
    ap.add_argument("--threads", type=int, help="compute threads per build (default: the engine's)")
    ap.add_argument(
        "--collect", action="store_true", help="run nothing: record the builds that finished"
    )
    a = ap.parse_args()
    if a.threads:
        names = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
        THREADS.update(dict.fromkeys(names, str(a.threads)))
    a.work.mkdir(parents=True, exist_ok=True)
    doc = json.loads(a.json.read_text()) if a.json.exists() else {"projects": {}}
    doc["machine"] = {
        "node": platform.node(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    for name in a.project or ["toy", "tickets"]:
        print(f"== {name}", flush=True)
        step = collect if a.collect else one
        with ThreadPoolExecutor(a.jobs) as pool:
            runs = list(pool.map(lambda spec, n=name, f=step: f(n, spec, a.work), builds(name)))
        for r in runs:
            if "unfinished" in r:
                print(f"  {r['name']:<12} unfinished: {r['unfinished']}")
                continue
            print(
                f"  {r['name']:<12} base {r['scores']['eval:base']} tuned {r['scores']['eval']} ({r['seconds']} s)"
            )
        doc["projects"][name] = {"stop_step": STOP[name], "runs": runs, **floor(runs)}
        a.json.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
