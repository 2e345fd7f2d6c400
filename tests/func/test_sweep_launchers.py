"""``spill build DIR -m ...`` through Hydra's Ray and submitit launchers, for real: a local Ray
cluster (``ray.init()`` from the launcher's own config, started and shut down by each sweep) and
submitit's local executor (one process per job). Skipped where the extras are not installed
(``pip install -e ".[ray,slurm]"``).

The kill drill sends a real SIGKILL to the Ray worker that runs one job, found through the pid
its run's control object records as owner, once that job has committed a tune checkpoint. The
drill turns Ray's task retries off (``max_retries=0``) so the launcher gives up on the job (as
when a node is lost for good): the other job finishes, the sweep reports the killed one ``lost``
and exits 75, and the same command again skips the finished job (its files untouched) and
continues the killed one from its checkpoint, with every step's loss recorded once.

Two more run under ``-m slow`` (about 25-30 s each here): with Ray's default retries the sweep
itself continues a killed task and exits 0; and a SIGTERM to a submitit job reaches spill's
handler (not submitit's, which only logs SIGTERM), so the job comes back ``preempted`` (exit 75)
and the same command continues it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import build_state_file, run_spill
from tests.func.test_sweep import FAST, ROOT, check_runs

LRS = "tune.lr=0.005,0.01"
# a new local cluster per sweep even where `ray start` left one (ray.init() would join it)
RAY = ["hydra/launcher=ray", "hydra.launcher.ray.init.address=local"]


@pytest.fixture
def toy(tmp_path) -> Path:
    dst = tmp_path / "toy"
    shutil.copytree(ROOT / "projects" / "toy", dst, ignore=shutil.ignore_patterns(".spill"))
    return dst


def need(*modules: str) -> None:
    extra = "[ray]" if "ray" in modules else "[slurm]"
    for m in modules:
        pytest.importorskip(m, reason=f"{m} is not installed: pip install -e '.{extra}'")


def sweep(toy: Path, *args: str) -> tuple[int, dict, str]:
    proc = run_spill("build", str(toy), "-m", *args, "--json", timeout=200)
    return proc.returncode, json.loads(proc.stdout or "{}"), proc.stderr


def test_ray_launcher_runs_each_job_as_a_ray_task(toy):
    need("ray", "hydra_plugins.hydra_ray_launcher")
    rc, result, err = sweep(toy, *FAST, LRS, *RAY)
    assert rc == 0, err
    runs = check_runs(result, toy)
    # Ray names the remote function and the worker's pid on every line it relays from a task
    for r in runs:
        assert r["pid"] != result["pid"] and f"(_run_job pid={r['pid']})" in err, err[-2000:]


def test_submitit_local_launcher_runs_each_job_as_a_submitit_job(toy):
    need("submitit", "hydra_plugins.hydra_submitit_launcher")
    rc, result, err = sweep(toy, *FAST, LRS, "hydra/launcher=submitit_local")
    assert rc == 0, err
    runs = check_runs(result, toy)
    # each job ran in its own process, writing to its own submitit job's log
    logs = [p.read_text() for p in (toy / ".spill" / "hydra" / ".submitit").glob("*/*_log.err")]
    for r in runs:
        assert r["pid"] != result["pid"]
        assert sum(f"state {r['state']}\n" in log for log in logs) == 1, logs


STEPS = ["tune.steps=200", "tune.ckpt_every=20"]
NO_RETRY = "+hydra.launcher.ray.remote.max_retries=0"


def files_digest(where: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(where.rglob("*")):
        if p.is_file() and p.name != "control.lock":
            h.update(f"{p.relative_to(where)}\0".encode() + p.read_bytes())
    return h.hexdigest()


def kill_when_mid_tune(proc: subprocess.Popen, state: Path, sig: int = signal.SIGKILL) -> int:
    """Signal the process that owns ``state``'s run once a tune checkpoint is committed."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        for path in state.glob("runs/*/control.json"):
            try:
                doc = json.loads(path.read_text())
            except ValueError:  # never half-written (atomic rename); a race with a new run
                continue
            live = doc["status"] == "active" and not doc["owner"]["released"]
            if live and doc["pointers"].get("stages/tune/ckpt"):
                os.kill(doc["owner"]["pid"], sig)
                return doc["owner"]["pid"]
        time.sleep(0.05)
    raise AssertionError(f"{state} never reached a tune checkpoint: {proc.poll()}")


def start(toy: Path, args: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "spill", "build", str(toy), "-m", *args, "--json"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


DONE, HIT = (f"{','.join(STEPS)},tune.lr={x}" for x in ("0.005", "0.01"))


@pytest.mark.slow  # (27 s; CI's 30-minute budget)
def test_a_killed_ray_task_is_reported_and_the_same_sweep_continues_it(toy):
    need("ray", "hydra_plugins.hydra_ray_launcher")
    args = [*STEPS, LRS, *RAY, NO_RETRY]
    done, lost = DONE, HIT
    states = toy / ".spill" / "sweep"
    proc = start(toy, args)
    pid = kill_when_mid_tune(proc, states / lost)
    out, err = proc.communicate(timeout=200)
    assert proc.returncode == 75, err[-3000:]
    result = json.loads(out)
    assert "WorkerCrashedError" in result["launcher_error"]
    got = {r["run"]: r for r in result["runs"]}
    assert got[done]["status"] == "done" and got[done]["steps"] == 200
    assert got[lost]["status"] == "lost" and got[lost]["pid"] == pid
    assert 0 < got[lost]["steps"] < 200, got[lost]  # the checkpoint it committed before
    finished = files_digest(states / done)

    rc, again, err = sweep(toy, *args)
    assert rc == 0, err[-3000:]
    plans = {r["run"]: {p["stage"]: p for p in r["plan"]} for r in again["runs"]}
    assert {p["action"] for p in plans[done].values()} == {"done", "skip"}
    assert files_digest(states / done) == finished
    tune = plans[lost]["tune"]
    assert tune["action"] == "continue" and f"step {got[lost]['steps']} of 200" in tune["reason"]
    assert {r["run"]: r["status"] for r in again["runs"]} == {done: "done", lost: "done"}
    doc = json.loads(build_state_file(states / lost).read_text())
    assert doc["stages"]["tune"]["progress"] == 200
    (ckpt,) = (states / lost / "stages" / "tune" / "payloads").glob("ckpt-*-s200-*")
    tuned = json.loads((ckpt / "state.json").read_text())
    assert tuned["step"] == 200 and len(tuned["losses"]) == 200  # no step lost or repeated


@pytest.mark.slow
def test_ray_retries_a_killed_task_and_the_retry_continues_it(toy):
    """Ray's default (``max_retries`` 3): the sweep itself finishes the killed job."""
    need("ray", "hydra_plugins.hydra_ray_launcher")
    proc = start(toy, [*STEPS, LRS, *RAY])
    pid = kill_when_mid_tune(proc, toy / ".spill" / "sweep" / HIT)
    out, err = proc.communicate(timeout=200)
    assert proc.returncode == 0, err[-3000:]
    runs = {r["run"]: r for r in json.loads(out)["runs"]}
    assert {r["status"] for r in runs.values()} == {"done"} and runs[HIT]["pid"] != pid
    assert runs[HIT]["plan"][2]["action"] == "continue", runs[HIT]["plan"]


@pytest.mark.slow
def test_sigterm_to_a_submitit_job_comes_back_preempted_and_continues(toy):
    """spill's SIGTERM handler, not submitit's (which only logs SIGTERM), runs in the job."""
    need("submitit", "hydra_plugins.hydra_submitit_launcher")
    args = [*STEPS, LRS, "hydra/launcher=submitit_local"]
    proc = start(toy, args)
    kill_when_mid_tune(proc, toy / ".spill" / "sweep" / HIT, signal.SIGTERM)
    out, err = proc.communicate(timeout=200)
    assert proc.returncode == 75, err[-3000:]
    runs = {r["run"]: r for r in json.loads(out)["runs"]}
    assert runs[DONE]["status"] == "done" and runs[HIT]["status"] == "preempted"
    assert "preempted by SIGTERM" in runs[HIT]["error"] and 0 < runs[HIT]["steps"] < 200
    rc, again, err = sweep(toy, *args)
    assert rc == 0, err[-3000:]
    tune = {r["run"]: r["plan"][2] for r in again["runs"]}
    assert tune[DONE]["action"] == "done"
    assert tune[HIT]["reason"] == f"continue at step {runs[HIT]['steps']} of 200"
