"""What one writer per run costs (issue 10), for docs/reports/006-authority.md. Everything is
measured in one run, on a local state and on S3 (moto's server on loopback, started here),
sides alternating; nothing here asserts a time.

    python bench/authority.py [--rounds 5] [--steps 40] [--json OUT]

1. overhead: ``spill tune`` of a tiny llama (``--ckpt-every 1``, float32, batch 4, micro-batch
   2, seq-len 64) with authority, against the same code with the control transitions skipped
   (``SPILL_BENCH_UNFENCED=1``: after acquisition a transition changes the process's copy only).
   Times: the whole subprocess, and the summary's ``seconds`` (the steps and their saves). The
   transitions per step are read from the control object (``seq``); one transition (renew,
   publish, acquire) is also timed directly in this process.
2. SIGKILL takeover, same host: a tune stopped by the drill ``tune-before-forward@3:stop`` is
   SIGKILLed; timed from the kill to ``acquire(state, wait=True)`` returning in (a) a process
   already running with its store opened (s3fs imported, bucket probed), (b) one already
   running with only ``spill.control.ownership`` imported, (c) one started after the kill; (d) to a
   rerun of the same ``spill tune`` printing ``continuing ...``; and, as the baseline of (d),
   a rerun after a clean ``--stop-after`` printing that line, timed from its start. Each
   successor records when it attempted (a busy run is polled again after ``poll``).
3. SIGSTOP takeover: the tune runs with ``--lease L`` and stays stopped (pid alive, so only the
   lease frees the run); an already started successor calls ``acquire(state, wait=True)``
   (polling every ``poll`` s). Timed from the owner's last transition (``last.at``) to the
   successor's acquisition. The stopped owner is then continued: it must stop, superseded.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

PY = sys.executable
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.servers
from tests.servers import moto_bucket  # noqa: E402

SETTINGS = ["--batch", "4", "--micro-batch", "2", "--seq-len", "64", "--dtype", "float32"]
SETTINGS += ["--ckpt-every", "1"]
SUCCESSOR = """
import json, sys, time
import spill.control.ownership as runs
from spill.store.location import location
tries = []  # the monotonic time of each attempt (a busy run is polled again)
attempt = runs._try_acquire
def counted(*args):
    tries.append(time.monotonic())
    return attempt(*args)
runs._try_acquire = counted
opened = time.monotonic()
if sys.argv[3] == "warm":  # the store opened (s3fs imported, the bucket probed) beforehand
    runs.store_for(location(sys.argv[1]))
opened = time.monotonic() - opened
print("ready", flush=True)
sys.stdin.readline()
t = time.monotonic()
run = runs.acquire(location(sys.argv[1]), wait=True, poll=float(sys.argv[2]))
print(json.dumps({"start": t, "done": time.monotonic(), "wall": time.time(), "tries": tries,
                  "open": opened, "generation": run.gen}), flush=True)
"""


def moto(work: Path) -> tuple[subprocess.Popen, str]:
    """moto's S3 server on a free loopback port, a fresh bucket, and AWS_* pointing at it."""
    log = open(work / "moto.log", "wb")  # noqa: SIM115 - lives as long as the server
    proc, bucket = moto_bucket(log, PY)
    return proc, f"s3://{bucket}"


class Bench:
    def __init__(self, work: Path, steps: int):
        from spill.models.sources.tiny import write_tiny

        self.work, self.steps, self.n = work, steps, 0
        self.model = write_tiny(work / "tiny", family="llama", seed=7)
        self.train = work / "train.jsonl"
        rows = (
            {"prompt": f"What is {i} plus {i + 3}?", "completion": f" {2 * i + 3}."}
            for i in range(24)
        )
        self.train.write_text("".join(json.dumps(r) + "\n" for r in rows))
        self.env = dict(os.environ, SPILL_HOME=str(work / "home"), HF_HUB_OFFLINE="1")
        for k in ("SPILL_DRILL", "SPILL_PROGRESS", "SPILL_LEASE", "SPILL_BENCH_UNFENCED"):
            self.env.pop(k, None)

    def state(self, root: str) -> str:
        self.n += 1
        return f"{root}/run-{self.n}"

    def argv(self, state: str, steps: int, *extra: str) -> list[str]:
        argv = [PY, "-m", "spill", "tune", str(self.model), str(self.train), "--name", "job"]
        return argv + ["--state", state, "--steps", str(steps), *SETTINGS, *extra]

    def tune(self, state: str, unfenced: bool) -> dict:
        env = dict(self.env, SPILL_BENCH_UNFENCED="1") if unfenced else self.env
        t0 = time.perf_counter()
        p = subprocess.run(self.argv(state, self.steps, "--json"), env=env, capture_output=True)
        wall = time.perf_counter() - t0
        if p.returncode:
            sys.exit(f"spill tune failed ({p.returncode}):\n{p.stderr.decode()}")
        from spill.control.keys import current
        from spill.store.location import location

        doc = current(location(state))
        seconds = json.loads(p.stdout)["seconds"]
        return {"wall": wall, "seconds": seconds, "seq": doc["seq"], "load": os.getloadavg()[0]}

    def owner(self, state: str, *extra: str, drill: bool = True) -> subprocess.Popen:
        env = dict(self.env, SPILL_DRILL="tune-before-forward@3:stop") if drill else self.env
        return subprocess.Popen(
            self.argv(state, 6, *extra), env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE
        )

    def successor(self, state: str, poll: float = 0.5, warm: bool = False) -> subprocess.Popen:
        p = subprocess.Popen(
            [PY, "-c", SUCCESSOR, state, str(poll), "warm" if warm else "cold"],
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert p.stdout.readline().strip() == "ready"
        return p


def stopped(p: subprocess.Popen) -> None:
    """Wait until ``p`` is stopped by its drill (state T in /proc)."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        with open(f"/proc/{p.pid}/stat") as f:
            text = f.read()
        if text[text.rfind(")") + 2] == "T":
            return
        if p.poll() is not None:
            sys.exit(f"the owner exited ({p.returncode}) before its drill stopped it")
        time.sleep(0.005)
    sys.exit("the owner's drill never stopped it")


def continuing(p: subprocess.Popen) -> float:
    """The monotonic time at which ``p`` printed its ``continuing ...`` line."""
    for line in iter(p.stderr.readline, b""):
        if line.startswith(b"continuing "):
            return time.monotonic()
    sys.exit(f"no 'continuing' line (exit {p.wait()})")


def finish(p: subprocess.Popen) -> tuple[int, str]:
    """Wait for ``p``; its exit code and the rest of its stderr."""
    _, err = p.communicate(timeout=180)
    return p.returncode, err.decode(errors="replace")


def transitions(root: str, n: int) -> dict:
    """One transition timed directly: renew and publish ``n`` times, acquire after a release."""
    from spill.control.ownership import acquire
    from spill.store.location import location

    state = location(f"{root}/direct-{uuid.uuid4().hex[:6]}")
    t0 = time.perf_counter()
    run = acquire(state)
    first = time.perf_counter() - t0
    kinds = ("renew", "publish", "acquire (released run)", "read of control.json")
    times: dict[str, list[float]] = {k: [] for k in kinds}
    key = f"{run.id}/control.json"
    for i in range(n):
        t0 = time.perf_counter()
        run.store.read(key)  # the read every transition starts with, alone
        times["read of control.json"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        run.renew()
        times["renew"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        run.publish({"ckpt": [f"payloads/ckpt-g{run.gen}-s{i}-0"]})
        times["publish"].append(time.perf_counter() - t0)
        if i % 10 == 9:
            run.release()
            t0 = time.perf_counter()
            run = acquire(state)
            times["acquire (released run)"].append(time.perf_counter() - t0)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(min(n, 20)):
        run.renew()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(8)
    run.release()
    med = {k: round(statistics.median(v), 6) for k, v in times.items()}
    return {
        "n": n,
        "median_s": med | {"acquire (first run, incl. probe/create)": round(first, 6)},
        "profile_renew_tottime": [ln for ln in out.getvalue().splitlines() if ln.strip()][-9:],
    }


def overhead(b: Bench, root: str, rounds: int) -> dict:
    sides: dict[str, list[dict]] = {"fenced": [], "unfenced": []}
    for r in range(rounds):  # alternate, starting side swapped each round
        for side in ("fenced", "unfenced") if r % 2 == 0 else ("unfenced", "fenced"):
            sides[side].append(b.tune(b.state(root), side == "unfenced"))
    med = {
        s: {k: statistics.median(x[k] for x in v) for k in ("wall", "seconds")}
        for s, v in sides.items()
    }
    seq = sides["fenced"][0]["seq"]
    return {
        "raw": sides,
        "median": med,
        "ratio_seconds": round(med["fenced"]["seconds"] / med["unfenced"]["seconds"], 4),
        "ratio_wall": round(med["fenced"]["wall"] / med["unfenced"]["wall"], 4),
        # seq counts written transitions: 1 create, then one per publish/renew/complete
        "transitions_after_acquire": seq - 1,
        "transitions_per_step": round((seq - 1) / b.steps, 3),
    }


def sigkill(b: Bench, root: str, rounds: int) -> dict:
    kinds = ("started, store open", "started", "fresh", "rerun", "rerun after stop")
    out: dict[str, list[float]] = {k: [] for k in (*kinds, "opening the store")}
    tries: dict[str, list[list[float]]] = {k: [] for k in kinds[:3]}
    for _ in range(rounds):
        for how in kinds[:4]:
            state = b.state(root)
            owner = b.owner(state)
            stopped(owner)
            succ = b.successor(state, warm=how == kinds[0]) if how.startswith("started") else None
            t_kill = time.monotonic()
            owner.kill()
            if succ is not None:
                succ.stdin.write("go\n")
                succ.stdin.flush()
            elif how == "fresh":
                succ = b.successor(state)
                succ.stdin.write("go\n")
                succ.stdin.flush()
            else:
                rerun = b.owner(state, drill=False)
                out[how].append(continuing(rerun) - t_kill)
                assert finish(rerun)[0] == 0, "the rerun after the kill failed"
            if succ is not None:
                got = json.loads(succ.stdout.readline())
                out[how].append(got["done"] - t_kill)
                tries[how].append([round(t - t_kill, 4) for t in got["tries"]])
                if how == kinds[0]:
                    out["opening the store"].append(got["open"])
                succ.wait()
            owner.wait()
        state = b.state(root)  # the baseline: a clean stop, then the same rerun from its start
        assert finish(b.owner(state, "--stop-after", "2", drill=False))[0] == 0
        t0 = time.monotonic()
        rerun = b.owner(state, drill=False)
        out["rerun after stop"].append(continuing(rerun) - t0)
        finish(rerun)
    return {
        "raw": out,
        "tries_since_kill": tries,
        "median": {k: round(statistics.median(v), 4) for k, v in out.items()},
    }


def sigstop(b: Bench, root: str, rounds: int, cases: list[tuple[float, float]]) -> dict:
    from spill.control.keys import current
    from spill.store.location import location

    rows = []
    for _ in range(rounds):
        for lease, poll in cases:
            state = b.state(root)
            owner = b.owner(state, "--lease", str(lease))
            succ = b.successor(state, poll)
            stopped(owner)
            t_stop = time.time()
            succ.stdin.write("go\n")
            succ.stdin.flush()
            doc = current(
                location(state)
            )  # the stopped owner's last transition (it cannot move now)
            got = json.loads(succ.stdout.readline())
            succ.wait()
            owner.send_signal(signal.SIGCONT)  # the old owner must find itself fenced
            rc, err = finish(owner)
            rows.append(
                {
                    "lease": lease,
                    "poll": poll,
                    "from_last_transition": round(got["wall"] - doc["last"]["at"], 4),
                    "after_expiry": round(got["wall"] - doc["lease"]["expires"], 4),
                    "from_stop": round(got["wall"] - t_stop, 4),
                    "tries": len(got["tries"]),
                    "last_transition": doc["last"]["what"],
                    "old_owner_exit": rc,
                    "old_owner_said": err.strip().splitlines()[-1][:300] if err.strip() else "",
                }
            )
    med = {}
    for lease, poll in cases:
        mine = [r for r in rows if r["lease"] == lease and r["poll"] == poll]
        med[f"lease {lease:g} s, poll {poll:g} s"] = {
            k: round(statistics.median(r[k] for r in mine), 4)
            for k in ("from_last_transition", "after_expiry", "from_stop")
        }
    return {"raw": rows, "median": med}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=None, help="a local folder (default: a fresh temporary one)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the overhead bench")
    ap.add_argument("--takeover-rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--direct", type=int, default=100, help="direct transitions of each kind")
    ap.add_argument("--stops", default="2:0.5,5:0.5,2:0.05", help="LEASE:POLL cases of bench 3")
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="spill-bench-authority-"))
    work.mkdir(parents=True, exist_ok=True)
    server, bucket = moto(work)
    try:
        b = Bench(work, args.steps)
        from spill.store.fs import mount_type

        stores = {"local": str(work / "states"), "s3": bucket}
        out: dict = {
            "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.system()}",
            "python": platform.python_version(),
            "local_fs": mount_type(str(work)),
            "s3": "moto server on loopback",
            "steps": args.steps,
            "settings": SETTINGS,
            "load_before": os.getloadavg(),  # other sessions share these cores
        }
        cases = [(float(c.split(":")[0]), float(c.split(":")[1])) for c in args.stops.split(",")]
        for name, root in stores.items():
            print(f"{name}: direct transitions", file=sys.stderr)
            res = {
                "direct": transitions(
                    root, args.direct if name == "local" else max(10, args.direct // 2)
                )
            }
            print(f"{name}: tune overhead", file=sys.stderr)
            res["overhead"] = overhead(b, root, args.rounds)
            print(f"{name}: SIGKILL takeover", file=sys.stderr)
            res["sigkill"] = sigkill(b, root, args.takeover_rounds)
            print(f"{name}: SIGSTOP takeover", file=sys.stderr)
            res["sigstop"] = sigstop(b, root, args.takeover_rounds, cases)
            # what the direct timing predicts: each step pays its transitions, nothing else
            step = res["overhead"]["median"]["unfenced"]["seconds"] / args.steps
            per_step = (
                res["overhead"]["transitions_per_step"] * res["direct"]["median_s"]["publish"]
            )
            res["predicted_ratio_seconds"] = round(1 + per_step / step, 4)
            out[name] = res
    finally:
        server.terminate()
        server.wait(timeout=10)
    out["load_after"] = os.getloadavg()
    summary = {
        n: {
            "tune seconds fenced/unfenced": out[n]["overhead"]["ratio_seconds"],
            "tune wall fenced/unfenced": out[n]["overhead"]["ratio_wall"],
            "transitions per step": out[n]["overhead"]["transitions_per_step"],
            "predicted from one publish": out[n]["predicted_ratio_seconds"],
            "one publish": out[n]["direct"]["median_s"]["publish"],
            "sigkill": out[n]["sigkill"]["median"],
            "sigstop": out[n]["sigstop"]["median"],
        }
        for n in stores
    }
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
