"""What the state costs on GCS and Azure Blob against S3 (issue 26). Everything is measured in
one run, on moto's S3 server, fake-gcs-server and Azurite, all started here on loopback on the
same cores, stores alternating; nothing here asserts a time. Emulators, not clouds: the ratios
say what spill's code and each client add per transition, not what a region's latency will be.

    python bench/cloud.py [--transitions 30] [--builds 2] [--json OUT]

1. control transition latency: in this process, a run acquired on each store (its store opened
   and probed, untimed), then rounds of one ``renew`` and one ``publish`` per store in
   alternating order, each timed alone (a transition reads the control object and writes it
   conditionally: one GET and one conditional PUT, or POST on GCS).
2. toy build wall time: ``python -m spill build projects/toy --state <bucket>/toy`` with
   ``tune.steps=12`` in a fresh subprocess per store and round (its own SPILL_HOME, shared by
   all, so the tiny model is made once before timing), stores alternating.

Reported: each store's median, and its ratio to S3's.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository root: tests.servers
from tests.servers import (  # noqa: E402
    azure_env,
    gcs_env,
    s3_env,
    start_azurite,
    start_fake_gcs,
    start_moto,
)

PY = sys.executable
STORES = ("s3", "gs", "az")
FAST = ("tune.steps=12", "tune.ckpt_every=5")


def servers(work: Path) -> tuple[list[subprocess.Popen], dict[str, str]]:
    """The three servers, this process's environment pointing at them, and a fresh bucket on
    each: ``(processes, {store: bucket URI})``."""
    log = open(work / "servers.log", "wb")  # noqa: SIM115 - lives as long as the servers
    procs, buckets = [], {}
    name = f"bench-{uuid.uuid4().hex[:8]}"
    proc, url = start_moto(log, PY)
    procs.append(proc)
    os.environ.update(s3_env(url))
    import s3fs

    s3fs.S3FileSystem().mkdir(name)
    buckets["s3"] = f"s3://{name}"
    proc, url = start_fake_gcs(log)
    procs.append(proc)
    os.environ.update(gcs_env(url))
    from google.cloud import storage

    storage.Client().create_bucket(name)
    buckets["gs"] = f"gs://{name}"
    proc, url = start_azurite(log)
    procs.append(proc)
    os.environ.update(azure_env(url))
    from azure.storage.blob import BlobServiceClient

    conn = os.environ["AZURE_STORAGE_CONNECTION_STRING"]
    BlobServiceClient.from_connection_string(conn).create_container(name)
    buckets["az"] = f"az://{name}"
    return procs, buckets


def transitions(buckets: dict[str, str], rounds: int) -> dict[str, dict[str, list[float]]]:
    from spill.control.ownership import acquire
    from spill.store.location import location

    runs = {s: acquire(location(f"{b}/latency"), lease=600) for s, b in buckets.items()}
    times: dict[str, dict[str, list[float]]] = {s: {"renew": [], "publish": []} for s in runs}
    for r in range(rounds):
        order = STORES if r % 2 == 0 else STORES[::-1]
        for s in order:
            t = time.perf_counter()
            runs[s].renew()
            times[s]["renew"].append(time.perf_counter() - t)
            t = time.perf_counter()
            runs[s].publish({"tune/ckpt": [f"tune/payloads/ckpt-g1-s{r}-0"]})
            times[s]["publish"].append(time.perf_counter() - t)
    for run in runs.values():
        run.release()
    return times


def builds(buckets: dict[str, str], rounds: int, work: Path) -> dict[str, list[float]]:
    env = {**os.environ, "SPILL_HOME": str(work / "home"), "HF_HUB_OFFLINE": "1"}
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")

    def build(state: str) -> float:
        project = work / f"toy-{uuid.uuid4().hex[:6]}"
        shutil.copytree(ROOT / "projects" / "toy", project, ignore=shutil.ignore_patterns(".spill"))
        argv = [PY, "-m", "spill", "build", str(project), *FAST]
        argv += ["--state", state] if state else []
        t = time.perf_counter()
        done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - t
        if done.returncode:
            raise SystemExit(f"build on {state or 'local'} failed: {done.stderr[-2000:]}")
        return wall

    build("")  # untimed: the tiny model made once in this SPILL_HOME
    walls: dict[str, list[float]] = {s: [] for s in buckets}
    for r in range(rounds):
        for s in STORES if r % 2 == 0 else STORES[::-1]:
            walls[s].append(build(f"{buckets[s]}/toy-{r}"))
    return walls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transitions", type=int, default=30, help="rounds of renew + publish")
    ap.add_argument("--builds", type=int, default=2, help="toy builds per store")
    ap.add_argument("--json", help="write every sample here")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="spill-bench-cloud-"))
    procs, buckets = servers(work)
    try:
        lat = transitions(buckets, args.transitions)
        walls = builds(buckets, args.builds, work) if args.builds else {}
    finally:
        for p in procs:
            p.terminate()
    print(f"{platform.platform()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    for kind in ("renew", "publish"):
        base = statistics.median(lat["s3"][kind])
        for s in STORES:
            m = statistics.median(lat[s][kind])
            print(f"{kind:8s} {s}: median {m * 1000:7.1f} ms  ({m / base:4.2f} x s3)")
    if walls:
        base = statistics.median(walls["s3"])
        for s in STORES:
            m = statistics.median(walls[s])
            print(f"toy build {s}: median {m:6.1f} s  ({m / base:4.2f} x s3)  {walls[s]}")
    if args.json:
        Path(args.json).write_text(json.dumps({"transitions": lat, "builds": walls}, indent=1))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
