"""Shared parts of the ``spill tune`` tests: the real CLI in subprocesses, and exact comparisons.

Every run is a fresh ``python -m spill tune`` process with its own ``SPILL_HOME`` and the test's
environment (so the S3 server's ``AWS_*`` variables reach it). Checkpoints are read back through
``spill.store`` so that local and ``s3://`` states are compared the same way.

A checkpoint is a payload folder ``payloads/ckpt-g<gen>-s<step>-<attempt>/``, current only while
the run's control object points at it: ``step_dir`` is the pointed folder of a step, what a
reader trusts; ``step_folders`` every folder of a step on disk, current or not; ``litter`` what
no pointer names (a dead writer's folder, or one the collection has not removed yet) and any
temporary file.

The uninterrupted control of the standard run (``control``) is made once per session and shared
by both test modules; it also records how long its steps, saves and adapter publication took,
the window over which the random kill moments are spread.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from spill.control.place import Place, payload_seq
from spill.payloads.checkpoint import (
    COMMIT,
    FILES,
    OPT,
    PARAMS,
    STATE,
    CheckpointInvalid,
    latest_checkpoint,
    load_checkpoint,
)
from spill.store import fs
from spill.store.location import location

STEPS = 6
# The standard run: a tiny llama streamed through a ring of 2, two micro-batches per step, LoRA
# dropout on (its masks are seeded by step, so an exact resume covers them too).
SETTINGS = {
    "steps": STEPS,
    "ckpt_every": 2,
    "batch": 4,
    "micro_batch": 2,
    "lr": 0.01,
    "seed": 3,
    "rank": 4,
    "dropout": 0.1,
    "seq_len": 64,
    "dtype": "float32",
    "ring": 2,
}
ACCUM = SETTINGS["batch"] // SETTINGS["micro_batch"]
PRE_RUN = "spill tune · model"  # the line printed once the model is loaded, before any step
BAR = "tune:"  # the progress bar's first frame (with SPILL_PROGRESS=1), right before step 1
CONTINUING = re.compile(r"^continuing \S+ from (\S+): step (\d+) of (\d+), cursor (\d+)$", re.M)
TIMEOUT = 180


def write_train(path: Path, n: int = 24, salt: str = "") -> Path:
    rows = [
        {"prompt": f"Question {i}{salt}: what is {i} plus {i + 3}?", "completion": f" {2 * i + 3}."}
        for i in range(n)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tune_argv(model: Path | str, train: Path | str, state: str, **over) -> list[str]:
    """``tune MODEL TRAIN --name job --state STATE`` plus SETTINGS with ``over`` applied.

    A value of None drops the option; True makes it a bare flag (``resident=True``).
    """
    argv = ["tune", str(model), str(train), "--name", "job", "--state", state]
    opts = {**SETTINGS, **over}
    if opts.get("resident"):
        opts.pop("ring", None)
    for key, value in opts.items():
        if value is None or value is False:
            continue
        argv.append("--" + key.replace("_", "-"))
        if value is not True:
            argv.append(str(value))
    return argv


def spill_env(home: Path, **extra: str) -> dict[str, str]:
    """The test's environment for a child, without drills or preemption overrides of its own."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("SPILL_DRILL", "SPILL_PROGRESS") and not k.startswith("SPILL_PREEMPT_")
    }
    env.update(SPILL_HOME=str(home), HF_HUB_OFFLINE="1", **extra)
    return env


def run_tune(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "spill", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=TIMEOUT,
    )


def run_concurrently(jobs: dict[str, tuple[list[str], dict]]) -> dict:
    """Start every ``name: (argv, env)`` at once, then collect ``name: CompletedProcess``."""
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "spill", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for name, (argv, env) in jobs.items()
    }
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=TIMEOUT)
        out[name] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    return out


@dataclass
class Worker:
    """A tune process to signal; its stderr is read unbuffered as it arrives, so the parent can
    act right after a given text (the pre-run line, the progress bar's first frame)."""

    argv: list[str]
    env: dict[str, str]
    command: list[str] = field(default_factory=lambda: [sys.executable, "-m", "spill"])
    proc: subprocess.Popen = field(init=False)
    _err: bytes = b""
    _seen: int = 0  # where the next wait_for starts looking

    def __post_init__(self) -> None:
        self.proc = subprocess.Popen(
            [*self.command, *self.argv],
            stdin=subprocess.PIPE,  # never written: a launcher that polls stdin waits on it
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            bufsize=0,  # raw pipes: read() returns what has arrived
            env=self.env,
        )

    def wait_for(self, text: str) -> bool:
        """Read stderr until ``text`` has arrived; False when stderr ends first."""
        want = text.encode()
        while (at := self._err.find(want, self._seen)) < 0:
            chunk = self.proc.stderr.read(65536)
            if not chunk:
                return False
            self._err += chunk
        self._seen = at + len(want)
        return True

    def finish(self) -> subprocess.CompletedProcess:
        """Wait for the exit (killing the process after TIMEOUT) and return what it printed."""
        watchdog = threading.Timer(TIMEOUT, self.proc.kill)
        watchdog.start()
        try:
            while chunk := self.proc.stderr.read(65536):
                self._err += chunk
            stdout = self.proc.stdout.read()  # a few lines at most: the pipe never fills
            self.proc.wait()
        finally:
            watchdog.cancel()
            self.proc.stdin.close()
            self.proc.stderr.close()
            self.proc.stdout.close()
        return subprocess.CompletedProcess(
            self.proc.args, self.proc.returncode, stdout.decode(), self._err.decode()
        )


# --- reading and comparing checkpoints ------------------------------------------------------


def step_dir(state: str, step: int) -> str:
    """The folder of ``step`` that the run points at (the checkpoint a reader trusts)."""
    found = [u for u in Place(location(state)).pointer("ckpt") if payload_seq(u) == step]
    assert found, f"{state}: no checkpoint of step {step} is current ({step_dirs(state)} on disk)"
    return found[0]


def step_folders(state: str, step: int) -> list[str]:
    """Every checkpoint folder of ``step`` on disk, pointed at or not (any generation)."""
    base = fs.join(state, "payloads")
    return [fs.join(base, n) for n in step_dirs(state) if payload_seq(n) == step]


def commit_landed(state: str, step: int) -> bool:
    """Whether a COMMIT of ``step`` is on a local disk (cheap enough to poll)."""
    return bool(glob.glob(os.path.join(state, "payloads", f"ckpt-g*-s{step}-*", COMMIT)))


def files(state: str, step: int) -> dict[str, bytes]:
    """The four files of the current checkpoint of ``step``, as bytes."""
    return {n: fs.get_bytes(fs.join(step_dir(state, step), n)) for n in (*FILES, COMMIT)}


def tensors(blob: bytes) -> dict[str, np.ndarray]:
    from safetensors.numpy import load

    return load(blob)


def state_json(state: str, step: int) -> dict:
    return json.loads(fs.get_bytes(fs.join(step_dir(state, step), STATE)))


def assert_same_checkpoint(state: str, control: str, step: int = STEPS, accum: int = ACCUM) -> None:
    """``ckpt/step-<step>`` of ``state`` equals the control's: every tensor, every byte."""
    got, want = files(state, step), files(control, step)
    commit = json.loads(got[COMMIT])
    for name in FILES:  # COMMIT is honest about what is next to it
        assert commit["files"][name]["sha256"] == hashlib.sha256(got[name]).hexdigest(), name
        assert commit["files"][name]["size"] == len(got[name]), name
    for name in (PARAMS, OPT):
        a, b = tensors(got[name]), tensors(want[name])
        assert sorted(a) == sorted(b), name
        for key in b:
            assert a[key].dtype == b[key].dtype == np.float32, key
            assert np.array_equal(a[key], b[key]), f"{name}: {key} differs from the control"
    mine, theirs = json.loads(got[STATE]), json.loads(want[STATE])
    assert len(mine["losses"]) == step, "a step was lost or repeated"
    assert mine["losses"] == theirs["losses"]
    assert mine["cursor"] == theirs["cursor"] == step * accum
    assert mine == theirs
    assert got == want  # the COMMIT bytes, hence the sha256 of every file, are the control's


def adapter_files(state: str) -> dict[str, bytes]:
    """Every file of ``<state>/adapter/`` by relative path (an export killed early may leave
    empty folders: they hold no file)."""
    root = fs.join(state, "adapter")
    return {rel: fs.get_bytes(fs.join(root, rel)) for rel in fs.files_under(root) if rel}


def committed_steps(state: str) -> list[int]:
    """Steps whose checkpoints the run points at and that verify, oldest first."""
    return sorted(payload_seq(u) for u in Place(location(state)).pointer("ckpt") if _verifies(u))


def step_dirs(state: str) -> list[str]:
    """Names of every checkpoint payload folder on disk (``ckpt-g1-s4-0``), current or not."""
    return [n for n in fs.listdir(fs.join(state, "payloads")) if n.startswith("ckpt-")]


def _verifies(uri: str) -> bool:
    try:
        load_checkpoint(uri)
    except CheckpointInvalid:
        return False
    return True


def litter(state: str) -> list[str]:
    """What a dead writer left: payload folders no pointer names (``payloads/<name> (not
    current)``), pointed ones that fail verification, and temporary files."""
    doc = Place(location(state)).doc() or {}
    pointed = {u.rsplit("/", 1)[-1] for rels in doc.get("pointers", {}).values() for u in rels}
    out = []
    for name in fs.listdir(fs.join(state, "payloads")):
        if name not in pointed:
            out.append(f"payloads/{name} (not current)")
        elif name.startswith("ckpt-") and not _verifies(fs.join(state, "payloads", name)):
            out.append(f"payloads/{name} (damaged)")
    if fs.is_local(state):
        for folder, _, names in os.walk(state):
            out += [os.path.relpath(os.path.join(folder, n), state) for n in names if fs.is_temp(n)]
    return out


def latest_step(state: str) -> int | None:
    ckpt = latest_checkpoint(Place(location(state)))
    return None if ckpt is None else ckpt.step


def resumed_from(stderr: str, steps: int = STEPS, accum: int = ACCUM) -> int | None:
    """The step a run said it continued from (None: it started fresh); checks the cursor."""
    found = CONTINUING.findall(stderr)
    if not found:
        return None
    assert len(found) == 1, found
    _, step, total, cursor = (found[0][0], *map(int, found[0][1:]))
    assert total == steps and cursor == step * accum, found
    return step


# --- the control -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Control:
    model: Path
    train: Path
    state: str
    home: Path
    stderr: str
    losses: list[float]
    # its timeline, in seconds: from the pre-run line to "adapter written"; from the progress
    # bar's first frame to the first COMMIT (step 1 pays for warming up); a step and its save;
    # from the last COMMIT to "adapter written" (the adapter's publication)
    window: float
    first: float
    step: float
    publish: float


_controls: dict[str, Control] = {}


def quantized_tiny(tiny_models: dict[str, Path], dest: Path) -> Path:
    """The tiny llama's 4-bit group-32 copy (what ``spill models quantize`` writes), as a folder."""
    from spill.models.sources.quantize import quantize_folder

    quantize_folder(tiny_models["llama"], dest, 4, 32, progress=lambda line: None)
    return dest


def control(tmp_path_factory, tiny_models: dict[str, Path], variant: str = "standard") -> Control:
    """The uninterrupted standard run, made once per session, with its timeline; ``variant``
    "quantized" runs it on the 4-bit copy of the same tiny llama."""
    if variant not in _controls:
        base = tmp_path_factory.mktemp(f"tune-control-{variant}")
        model = tiny_models["llama"]
        if variant == "quantized":
            model = quantized_tiny(tiny_models, base / "tiny-q4g32")
        train = write_train(base / "train.jsonl")
        state = str(base / "state")
        w = Worker(tune_argv(model, train, state), spill_env(base / "home", SPILL_PROGRESS="1"))
        assert w.wait_for(PRE_RUN)
        t0 = time.monotonic()
        commits: dict[int, float] = {}  # step -> when its COMMIT appeared

        def watch() -> None:
            every = SETTINGS["ckpt_every"]
            while w.proc.poll() is None and len(commits) < STEPS // every:
                for n in range(every, STEPS + 1, every):
                    if n not in commits and commit_landed(state, n):
                        commits[n] = time.monotonic() - t0
                time.sleep(0.001)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        assert w.wait_for(BAR)
        bar = time.monotonic() - t0
        assert w.wait_for("adapter written")
        window = time.monotonic() - t0
        done = w.finish()
        watcher.join()
        assert done.returncode == 0, done.stderr
        every = SETTINGS["ckpt_every"]
        assert len(commits) == STEPS // every, commits
        _controls[variant] = Control(
            model,
            train,
            state,
            base / "home",
            done.stderr,
            state_json(state, STEPS)["losses"],
            window=window,
            first=commits[every] - bar,
            step=(commits[STEPS] - commits[every]) / (STEPS - every),
            publish=window - commits[STEPS],
        )
    return _controls[variant]
