"""Shared parts of the ``spill move`` tests: toy projects, real CLI processes, exact outcomes.

A project here is a copy of ``projects/toy`` whose ``spill.yaml`` asks for a short tune
(``project``): its own file, so ``spill build`` at the source and at the destination run the same
configuration without overrides on every command line. A *stopped* project is the build stopped
with ``--stop-after tune:STOP`` (a committed checkpoint, the run released); each test starts from
a ``cp -r`` of one made per session, as a user copying a project folder would (its control
object still names the original as ``home``, which nothing in a move reads; a move writes the
new place's own ``home``).

``outcome`` is what a finished build is, read through ``spill.store`` so that local and ``s3://``
projects are read the same way: per stage its status, result, progress, fingerprint, inputs,
output hashes and engines; the newest tune checkpoint (params, optimizer state, ``state.json``
with the losses and the cursor, ``COMMIT``) and every adapter file, byte for byte. What differs
between two equal builds by nature (times, mtimes, the plan that was printed, the run id) is left
out. ``assert_same`` compares two outcomes part by part, so a failure names what differs.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from spill.control.keys import current
from spill.control.place import payload_seq
from spill.payloads.checkpoint import COMMIT, FILES
from spill.store import fs
from spill.store.location import location
from tests.conftest import bucket_uri, run_spill
from tests.func.tune_kit import spill_env as env_for  # the child's environment, no drills

TOY = Path(__file__).resolve().parents[2] / "projects" / "toy"
STATE_DIR = ".spill"
STEPS, EVERY, STOP = 8, 2, 4  # the drills' tune: 8 steps, a checkpoint every 2, stopped at 4
MOVE_STEPS = ("quiesce", "take", "copy", "verify", "incoming", "fence", "activate")
TIMEOUT = 180


def project(dst: Path, steps: int = STEPS, every: int = EVERY) -> Path:
    """A copy of the toy project whose tune runs ``steps`` steps, a checkpoint every ``every``."""
    shutil.copytree(TOY, dst, ignore=shutil.ignore_patterns(".spill", "__pycache__"))
    yaml = dst / "spill.yaml"
    text = yaml.read_text()
    new = text.replace("  steps: 300\n", f"  steps: {steps}\n").replace(
        "  ckpt_every: 100\n", f"  ckpt_every: {every}\n"
    )
    assert new.count(f"steps: {steps}\n") == 1 and f"ckpt_every: {every}\n" in new, text
    yaml.write_text(new)
    return dst


def spill(*args: str, env: dict[str, str], cwd: Path, drill: str | None = None):
    """``python -m spill ARGS`` in ``cwd`` (where an unknown URI would land as a relative path)."""
    return run_spill(
        *args, base={**env, "SPILL_DRILL": drill} if drill else env, cwd=cwd, timeout=TIMEOUT
    )


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, (proc.args, proc.returncode, proc.stderr[-4000:])
    return proc


def last_line(text: str) -> str:
    lines = [x for x in text.splitlines() if x.strip()]
    assert lines, "nothing printed"
    return lines[-1]


def ran_a_stage(proc: subprocess.CompletedProcess) -> bool:
    """Whether a ``spill build`` started any stage (it prints ``== <stage>: ...`` first)."""
    return any(line.startswith("== ") for line in proc.stderr.splitlines())


def state_of(root: str) -> str:
    return fs.join(root, STATE_DIR)


def doc(root: str) -> dict[str, Any] | None:
    """The current run's control document of the project at ``root`` (None: no run there)."""
    return current(location(state_of(root)))


def tree(root: str) -> dict[str, bytes]:
    """Every file under ``root`` by relative path, bytes included (``runs/control.lock``, an
    empty lock file any transition may create, left out)."""
    return {
        rel: fs.get_bytes(fs.join(root, rel))
        for rel in fs.files_under(root)
        if rel and not rel.endswith("runs/control.lock")
    }


# --- what a finished build is ---------------------------------------------------------------------

STAGE_KEYS = ("status", "result", "progress", "total", "unit", "fingerprint", "inputs")


def outcome(root: str) -> dict[str, Any]:
    """The finished build of the project at ``root``, as compared with its control."""
    state = state_of(root)
    control = current(location(state))
    assert control is not None, f"{state} holds no run"
    ptrs = control["pointers"]
    build = json.loads(fs.get_bytes(fs.join(state, ptrs["state"][0], "state.json")))
    stages = {}
    for name, rec in build["stages"].items():
        stages[name] = {k: rec.get(k) for k in STAGE_KEYS}
        outputs = rec.get("outputs") or {}
        stages[name]["outputs"] = {p: (o["sha256"], o["size"]) for p, o in outputs.items()}
        stages[name]["engines"] = [p["engine"] for p in rec.get("producers") or []]
    ckpts = sorted(ptrs["stages/tune/ckpt"], key=payload_seq)
    newest = fs.join(state, ckpts[-1])
    ckpt = {n: fs.get_bytes(fs.join(newest, n)) for n in (*FILES, COMMIT)}
    adapter = {}
    for top in ("stages/tune/adapter", "adapters"):
        base = fs.join(state, top)
        adapter |= {f"{top}/{r}": fs.get_bytes(fs.join(base, r)) for r in fs.files_under(base) if r}
    keep = ("compose_key", "config", "data", "project", "overrides")
    return {
        "build": {k: build.get(k) for k in keep},
        "stages": stages,
        "ckpt_step": payload_seq(newest),
        "ckpt": ckpt,
        "adapter": adapter,
        "status": control["status"],
    }


def tune_state(out: dict[str, Any]) -> dict[str, Any]:
    """The newest tune checkpoint's ``state.json`` (losses, cursor, producers) of an outcome."""
    return json.loads(out["ckpt"]["state.json"])


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Two outcomes are equal: every stage, the checkpoint and the adapter, byte for byte."""
    assert got["status"] == want["status"] == "complete"
    assert got["build"] == want["build"]
    assert sorted(got["stages"]) == sorted(want["stages"])
    for name in want["stages"]:
        assert got["stages"][name] == want["stages"][name], f"stage {name} differs"
    assert got["ckpt_step"] == want["ckpt_step"]
    mine, theirs = tune_state(got), tune_state(want)
    assert len(mine["losses"]) == mine["step"], "a step was lost or repeated"
    assert mine["losses"] == theirs["losses"] and mine["cursor"] == theirs["cursor"]
    for name in want["ckpt"]:
        assert got["ckpt"][name] == want["ckpt"][name], f"checkpoint file {name} differs"
    assert sorted(got["adapter"]) == sorted(want["adapter"])
    for rel in want["adapter"]:
        assert got["adapter"][rel] == want["adapter"][rel], f"adapter file {rel} differs"


# --- projects made once per session ---------------------------------------------------------------

_made: dict[tuple, Any] = {}


def control(tmp_path_factory, steps: int = STEPS, every: int = EVERY) -> dict[str, Any]:
    """The outcome of an uninterrupted build of the project with this tune, made once."""
    key = ("control", steps, every)
    if key not in _made:
        base = tmp_path_factory.mktemp(f"move-control-{steps}")
        root = project(base / "toy", steps, every)
        ok(spill("build", str(root), env=env_for(base / "home"), cwd=base))
        _made[key] = outcome(str(root))
    return _made[key]


def stopped(tmp_path_factory) -> Path:
    """The drills' project built with ``--stop-after tune:STOP``, made once (copy it)."""
    if "stopped" not in _made:
        base = tmp_path_factory.mktemp("move-stopped")
        root = project(base / "toy")
        env = env_for(base / "home")
        ok(spill("build", str(root), "--stop-after", f"tune:{STOP}", env=env, cwd=base))
        d = current(location(root / STATE_DIR))
        assert d is not None and d["status"] == "active" and d["owner"]["released"]
        _made["stopped"] = root
    return _made["stopped"]


def copy_of_stopped(tmp_path_factory, dst: Path) -> Path:
    shutil.copytree(stopped(tmp_path_factory), dst)
    return dst


def places(where: str, tmp_path: Path, tmp_path_factory, request) -> tuple[str, str, dict]:
    """(source project, destination, environment): a copy of the stopped project, local or
    moved to an object store first (``where``: local, or to-/from- s3, gs, az), and where it
    goes."""
    bucket = bucket_uri(request, where.split("-")[1]) if where != "local" else None
    env = env_for(tmp_path / "home")  # after the bucket: its variables reach the children
    local = str(copy_of_stopped(tmp_path_factory, tmp_path / "src"))
    if where == "local":
        return local, str(tmp_path / "dst"), env
    if where.startswith("to-"):
        return local, f"{bucket}/dst", env
    there = f"{bucket}/src"
    ok(spill("move", local, there, env=env, cwd=tmp_path))
    return there, str(tmp_path / "dst"), env


# --- refusals ------------------------------------------------------------------------------------


def dest_files(to: str) -> dict[str, bytes]:
    """What is at a destination, where it can be looked at (a local folder, a bucket's prefix)."""
    remote = to.startswith(("s3://", "gs://", "az://"))
    if to.startswith(("/proc", "/sys")) or not (remote or Path(to).is_absolute()):
        return {}
    try:
        return tree(to)
    except FileNotFoundError:  # a bucket that is not there
        return {}


def refused(src: str, to: str, env: dict, cwd: Path, code: int = 1) -> str:
    """``spill move SRC TO`` fails in one line, changing nothing at either place; the line."""
    before, there = tree(state_of(src)), dest_files(to)
    proc = spill("move", src, to, env=env, cwd=cwd)
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("spill: error: "), proc.stderr
    assert tree(state_of(src)) == before, "the source changed"
    assert dest_files(to) == there, "something was written at the destination"
    return lines[0]


# --- a race's witness -----------------------------------------------------------------------------


MOVING = ("quiescing", "transferred")


class Poller(threading.Thread):
    """Reads the destination's control object, then the source's, as fast as it can: once the
    destination is past its claim (made before the quiesce, acquirable by nobody) the source
    must be quiescing or transferred, and while the destination is active the source must be
    transferred (read in that order, the source's state is never older than the
    destination's)."""

    def __init__(self, src: str, dst: str):
        super().__init__(daemon=True)
        self.src, self.dst = src, dst
        self.halt = threading.Event()
        self.seen: list[tuple[str | None, str]] = []
        self.bad: list[tuple[str, str]] = []

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                there = doc(self.dst)
            except Exception:  # noqa: BLE001 - a half-made destination: read again
                there = None
            here = doc(self.src)
            pair = (there and there["status"], here["status"])
            if not self.seen or self.seen[-1] != pair:
                self.seen.append(pair)
            claimed = there is not None and there["transfer"]["step"] == "claim"
            if there is not None and not claimed and here["status"] not in MOVING:
                self.bad.append(pair)
            if claimed and there["status"] != "incoming":  # a claim is never acquirable
                self.bad.append(pair)
            if (
                there is not None
                and there["status"] == "active"
                and here["status"] != ("transferred")
            ):
                self.bad.append(pair)
            time.sleep(0.002)
