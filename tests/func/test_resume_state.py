"""``spill resume <state>``: a run continued from its state location alone (real CLI processes).

A tune stopped part way is continued by ``spill resume <its --state>`` from another folder, on a
local state and on S3: the resume says the last committed step and cursor first, and ends where an
uninterrupted run ends, byte for byte. A build's state folder resumes its build. A location
without a run, or one whose command is not recorded, is refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spill.control.place import Place
from spill.models.sources.tiny import write_tiny
from spill.store import fs
from spill.store.location import location
from tests.conftest import run_spill
from tests.func.test_build import copy_toy

TUNE = ("--name", "job", "--steps", "6", "--ckpt-every", "2", "--batch", "4")
TUNE += ("--micro-batch", "2", "--seq-len", "64", "--dtype", "float32", "--seed", "3")


@pytest.fixture
def work(tmp_path) -> Path:
    write_tiny(tmp_path / "model", family="llama", seed=7)
    rows = [{"prompt": f"Q {i}: {i}+{i + 3}?", "completion": f" {2 * i + 3}."} for i in range(24)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def spill(*args: str, home: Path, cwd: Path | None = None, code: int = 0):
    proc = run_spill(*args, env={"SPILL_HOME": str(home), "HF_HUB_OFFLINE": "1"}, cwd=cwd)
    assert proc.returncode == code, proc.stderr
    return proc


def final(state: str) -> dict[str, bytes]:
    """The current checkpoint's files and the exported adapter's weights."""
    ckpt = Place(location(state)).pointer("ckpt")[0]
    out = {n: fs.get_bytes(fs.join(ckpt, n)) for n in fs.listdir(ckpt)}
    out["adapter"] = fs.get_bytes(fs.join(state, "adapter", "params.safetensors"))
    return out


@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.slow)])
def test_a_stopped_tune_resumes_from_its_state_alone(work, tmp_path, where, request):
    home = tmp_path / "home"
    if where == "s3":
        bucket = request.getfixturevalue("s3_bucket")
        state, control = f"s3://{bucket}/job", f"s3://{bucket}/control"
    else:
        state, control = str(tmp_path / "state"), str(tmp_path / "control")
    spill("tune", "model", "train.jsonl", *TUNE, "--state", control, home=home, cwd=work)
    # typed with relative paths in the work folder, resumed from elsewhere by location only
    spill(
        "tune",
        "model",
        "train.jsonl",
        *TUNE,
        "--state",
        state,
        "--stop-after",
        "2",
        home=home,
        cwd=work,
    )
    shown = json.loads(spill("status", state, "--json", home=home).stdout)
    assert shown["progress"] == "step 2 of 6 committed, cursor 4" and shown["status"] == "active"
    assert shown["released"] and shown["generation"] == 1
    proc = spill("resume", state, "--stop-after", "4", home=home, cwd=tmp_path)
    assert "step 2 of 6 committed, cursor 4" in proc.stderr, proc.stderr
    assert "continuing job from" in proc.stderr and "step 2 of 6" in proc.stderr
    proc = spill("resume", state, "--json", home=home, cwd=tmp_path)
    assert "step 4 of 6 committed, cursor 8" in proc.stderr
    assert json.loads(proc.stdout)["step"] == 6
    assert final(state) == final(control)
    again = spill("resume", state, home=home, cwd=tmp_path)  # complete: answered, not rerun
    assert "(complete, generation" in again.stderr and final(state) == final(control)


def test_a_build_resumes_from_its_state_folder(tmp_path):
    home = tmp_path / "home"
    project = copy_toy(tmp_path / "toy")
    fast = ("tune.steps=6", "tune.ckpt_every=2")
    spill("build", ".", "--stop-after", "tune:2", *fast, home=home, cwd=project)
    proc = spill("resume", str(project / ".spill"), home=home, cwd=tmp_path)
    assert (
        "tune stopped (2 of 6)" in proc.stderr and "== tune: continue at step 2 of 6" in proc.stderr
    )
    status = json.loads(spill("status", str(project), "--json", home=home).stdout)
    assert status["stages"]["eval"]["status"] == "done" and status["run"]["status"] == "complete"


def test_nothing_to_resume_is_one_line(work, tmp_path):
    home = tmp_path / "home"
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = spill("resume", str(empty), home=home, code=1)
    assert proc.stderr.strip().splitlines()[-1].startswith("spill: error: ")
    state = tmp_path / "state"
    spill(
        "tune",
        "model",
        "train.jsonl",
        *TUNE,
        "--state",
        str(state),
        "--stop-after",
        "2",
        home=home,
        cwd=work,
    )
    (state / "command.json").unlink()
    proc = spill("resume", str(state), home=home, code=1)
    last = proc.stderr.strip().splitlines()[-1]
    assert "does not record the command that owns its run" in last, proc.stderr
