"""``spill build`` on the toy project through the real CLI: the CI build, stops and continues,
edits, Ctrl-C, S3 and memory:// states, and bad input.

The reference is one uninterrupted build (session-scoped); the other builds must end with the
same scores and a ``torch.equal`` adapter on the same engine.
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

from tests.conftest import (
    ENGINES,
    assert_not_imported,
    bucket_uri,
    build_state_file,
    cli_code,
    run_spill,
)

ROOT = Path(__file__).resolve().parents[2]
TOY = ROOT / "projects" / "toy"


def copy_toy(dst: Path) -> Path:
    shutil.copytree(TOY, dst, ignore=shutil.ignore_patterns(".spill", "__pycache__"))
    return dst


def spill(*args: str, home: Path, ok: bool = True) -> subprocess.CompletedProcess:
    proc = run_spill(*args, env={"SPILL_HOME": str(home), "HF_HUB_OFFLINE": "1"})
    if ok:
        assert proc.returncode == 0, proc.stderr
    return proc


def state_doc(where: Path) -> dict:
    return json.loads(build_state_file(where).read_text())


def scores(doc: dict) -> dict:
    return {s: doc["stages"][s]["result"].get("accuracy") for s in ("eval:base", "eval")}


def tensors(adapter: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(adapter / "params.safetensors"))


def assert_same_adapter(a: Path, b: Path) -> None:
    import torch

    ta, tb = tensors(a), tensors(b)
    assert ta.keys() == tb.keys()
    assert all(torch.equal(ta[k], tb[k]) for k in ta)


def digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(folder)).encode() + p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="session")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("build-home")


@pytest.fixture(scope="session")
def reference(tmp_path_factory, home) -> dict:
    """One uninterrupted toy build: the CI build, and what every other build must equal."""
    where = tmp_path_factory.mktemp("reference")
    project = copy_toy(where / "toy")
    t0 = time.perf_counter()
    proc = spill("build", str(project), "--json", home=home)
    seconds = time.perf_counter() - t0
    return {
        "project": project,
        "state": project / ".spill",
        "json": json.loads(proc.stdout),
        "seconds": seconds,
    }


def test_toy_build_solves_the_task(reference):
    doc = state_doc(reference["state"])
    got = scores(doc)
    assert got["eval"] == 1.0, got  # the tuned adapter solves the held-out rows
    assert got["eval:base"] <= 0.1, got  # the random base model does not
    assert reference["seconds"] < 90, reference["seconds"]
    assert reference["json"]["stages"]["tune"]["result"]["step"] == 300
    assert doc["stages"]["distill"]["status"] == "skipped"
    for stage in ("eval:base", "tune", "eval"):
        producers = doc["stages"][stage]["producers"]
        assert [p["engine"] for p in producers] == ["torch"] and producers[0]["os"]
    adapter = reference["state"] / "adapters" / "toy"
    for name in (
        "params.safetensors",
        "peft/adapter_model.safetensors",
        "mlx/adapters.safetensors",
    ):
        assert (adapter / name).is_file(), name
    for name in ("eval-base.jsonl", "eval.jsonl"):
        assert (reference["state"] / "files" / name).is_file()
    # a person reads each graded row by its input; a classification has per-label results
    rows = [json.loads(x) for x in (reference["state"] / "files" / "eval.jsonl").open()]
    inputs = {r["id"]: r["input"] for r in rows}
    csv = (reference["project"] / "toy.csv").read_text().splitlines()[1:]
    assert all(inputs[i] == csv[i - 1].rsplit(",", 1)[0] for i in inputs)  # ids: 1-based rows
    result = reference["json"]["stages"]["eval"]["result"]
    assert set(result["labels"]) == {"big", "hot", "low", "red"} == set(result["confusion"])
    assert all(
        v == {"precision": 1.0, "recall": 1.0, "support": v["support"]}
        for v in result["labels"].values()
    )
    assert sum(v["support"] for v in result["labels"].values()) == result["rows"]
    from spill.ground.validate import validate

    validate(doc, "build-state")


def test_finished_build_and_status_answer_without_engines(reference, home):
    for verb in ("build", "status"):
        heavy = (*ENGINES, "numpy", "hydra", "jsonschema", "yaml")
        code = cli_code(verb, str(reference["project"]))
        proc = assert_not_imported(code, heavy, env={"SPILL_HOME": str(home)})
        assert proc.stdout.splitlines()[-1] == "rc 0"
        assert "eval       done     accuracy 1.000" in proc.stdout
        assert "== " not in proc.stderr  # no stage ran


def test_stops_and_continues_equal_one_build(reference, home, tmp_path):
    """Stop after every stage and inside tune, Ctrl-C in tune, each step a fresh process."""
    project = copy_toy(tmp_path / "toy")
    state = tmp_path / "state"
    steps = ["eval:base", "distill", "train:20", "tune:120", "tune", "eval:7"]
    for stop in steps:
        spill("build", str(project), "--state", str(state), "--stop-after", stop, home=home)
    doc = state_doc(state)
    assert doc["stages"]["tune"]["status"] == "done" and doc["stages"]["eval"]["progress"] == 7
    assert doc["stages"]["eval"]["status"] == "stopped"
    dry = spill("build", str(project), "--state", str(state), "--dry-run", home=home)
    assert "continue at row 7 of" in dry.stdout and "done: 300 of 300 steps" in dry.stdout
    spill("resume", str(project), "--state", str(state), home=home)
    assert scores(state_doc(state)) == scores(state_doc(reference["state"]))
    assert_same_adapter(state / "adapters" / "toy", reference["state"] / "adapters" / "toy")


def test_ctrl_c_in_tune_preempts_and_resume_finishes(reference, home, tmp_path):
    project = copy_toy(tmp_path / "toy")
    state = tmp_path / "state"
    spill("build", str(project), "--state", str(state), "--stop-after", "tune:10", home=home)
    env = dict(os.environ, SPILL_HOME=str(home), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "spill", "build", str(project), "--state", str(state)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    for line in proc.stderr:
        if line.startswith("continuing toy from"):
            proc.send_signal(signal.SIGINT)
            break
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 75, err
    assert "build preempted by SIGINT; committed: tune at step" in err
    rec = state_doc(state)["stages"]["tune"]
    assert rec["status"] == "stopped" and 10 <= rec["progress"] < 300
    status = spill("status", str(project), "--state", str(state), home=home)
    assert f"stopped  at step {rec['progress']} of 300" in status.stdout
    spill("resume", str(project), "--state", str(state), home=home)
    assert scores(state_doc(state)) == scores(state_doc(reference["state"]))
    assert_same_adapter(state / "adapters" / "toy", reference["state"] / "adapters" / "toy")


def test_edits_rerun_only_what_they_affect(reference, home, tmp_path):
    project = copy_toy(tmp_path / "toy")
    state = tmp_path / "state"
    shutil.copytree(reference["state"], state)
    before = state_doc(state)
    # a comment and a value that decides nothing: nothing runs
    (project / "spill.yaml").write_text((project / "spill.yaml").read_text() + "# note\n")
    proc = spill("build", str(project), "--state", str(state), "tune.ckpt_every=7", home=home)
    assert "== " not in proc.stderr
    after = state_doc(state)
    assert all(
        after["stages"][s]["updated"] == before["stages"][s]["updated"] for s in after["stages"]
    )
    # a training row edited: tune and eval run fresh, eval:base (the test rows) stays done
    test_rows = {
        json.loads(x)["id"] for x in (state / "files" / "eval.jsonl").read_text().splitlines()
    }
    lines = (project / "toy.csv").read_text().splitlines()
    row = next(i for i in range(1, len(lines)) if i not in test_rows)
    text, label = lines[row].rsplit(",", 1)
    lines[row] = text.replace(text.split()[0], "sand", 1) + "," + label
    (project / "toy.csv").write_text("\n".join(lines) + "\n")
    dry = spill("build", str(project), "--state", str(state), "--dry-run", home=home)
    assert "fresh: the data changed (its training rows differ)" in dry.stdout
    proc = spill("build", str(project), "--state", str(state), home=home)
    assert "== eval:base" not in proc.stderr and "== tune: fresh" in proc.stderr
    final = state_doc(state)
    assert final["stages"]["eval:base"]["updated"] == before["stages"]["eval:base"]["updated"]
    assert final["stages"]["tune"]["fingerprint"] != before["stages"]["tune"]["fingerprint"]
    assert final["stages"]["eval"]["result"]["accuracy"] == 1.0


def one_line_error(proc, message, code=1):
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_bad_input_is_one_line_and_loses_nothing(reference, home, tmp_path):
    project = copy_toy(tmp_path / "toy")
    state = tmp_path / "state"
    shutil.copytree(reference["state"], state)
    kept = digest(state)

    def fails(*args, message, code=1):
        one_line_error(spill("build", *args, home=home, ok=False), message, code)

    usage = {"message": "no stage 'polish'", "code": 2}  # a usage error, like argparse's own
    fails(str(project), "--state", str(state), "--stop-after", "polish", **usage)
    fails(
        str(project),
        "--state",
        str(state),
        "--stop-after",
        "tune:301",
        message="past the end",
        code=2,
    )
    fails(str(project), "--state", str(state), "data.output=labl", message="no column 'labl'")
    # an override the project does not take is the command line's error, like an unknown option
    fails(
        str(project),
        "--state",
        str(state),
        "tune.lrr=1",
        message="tune.lrr is not a setting",
        code=2,
    )
    fails(str(project), "--state", str(state), "tune.lr=fast", message="tune.lr", code=2)
    other = copy_toy(tmp_path / "other")
    text = (other / "spill.yaml").read_text().replace("name: toy", "name: other")
    (other / "spill.yaml").write_text(text.replace("id: 70790000000a", "id: 0123456789ab"))
    fails(str(other), "--state", str(state), message="holds the build of project 'toy'")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "mine.txt").write_text("x")
    fails(str(project), "--state", str(tmp_path / "junk"), message="holds no spill build")
    (project / "spill.yaml").write_text(
        (project / "spill.yaml").read_text() + "eval:\n  batch: 0\n"
    )
    fails(
        str(project), "--state", str(state), message="eval.batch: 0 is less than the minimum of 1"
    )
    assert digest(state) == kept
    for n, (content, message) in enumerate(
        [("text,label\n", "no data rows"), ("text,label\na b,x\nc d,x\ne f,x\n", "single label")]
    ):
        bad = copy_toy(tmp_path / f"bad{n}")
        (bad / "toy.csv").write_text(content)
        fails(str(bad), message=message)
        assert not (bad / ".spill" / "runs").exists()  # refused before the run was touched
    one_line_error(spill("status", str(tmp_path / "nowhere"), home=home, ok=False), "no build at")


def test_data_edited_during_a_build(home, tmp_path, monkeypatch):
    """In-process, a memory:// state: the data file changes while tune runs."""
    from spill.errors import DataError
    from spill.jobs.authority import Writer
    from spill.project.build.build import BuildOptions, build
    from spill.project.build.record import read
    from spill.store import drill
    from spill.store.location import location

    monkeypatch.setenv("SPILL_HOME", str(home))
    project = copy_toy(tmp_path / "toy")
    state = location("memory://spill-test/edited")
    opts = BuildOptions(writer=Writer(state), overrides=("tune.steps=6",), stop_after="tune")
    build(
        project,
        BuildOptions(writer=Writer(state), overrides=opts.overrides, stop_after="eval:base"),
    )

    def edit(boundary):
        if boundary == drill.TUNE_BEFORE_FORWARD:
            with open(project / "toy.csv", "a") as f:
                f.write("moon apple road sand,red\n")

    with drill.hooked(edit), pytest.raises(DataError, match="changed while the build ran"):
        build(project, opts)
    doc = read(state)
    assert doc["stages"]["tune"]["status"] == "done"  # made from the data read at the start
    assert doc["stages"]["eval:base"]["status"] == "done"
    plan = build(
        project, BuildOptions(writer=Writer(state), overrides=opts.overrides, dry_run=True)
    )["plan"]
    assert [d["action"] for d in plan[2:4]] == ["run", "run"]
    assert "the data changed" in plan[2]["reason"]


@pytest.mark.parametrize("store", ["s3", pytest.param("gs", marks=pytest.mark.slow), "az"])
def test_object_store_state(reference, home, tmp_path, request, store):
    """A toy build with its state in a bucket (moto S3, fake-gcs-server, Azurite): stopped
    mid-tune, continued, its adapter and run list there."""
    project = copy_toy(tmp_path / "toy")
    uri = f"{bucket_uri(request, store)}/builds/toy"
    fast = ("tune.steps=12", "tune.ckpt_every=5")
    spill("build", str(project), "--state", uri, "--stop-after", "tune:7", *fast, home=home)
    proc = spill("build", str(project), "--state", uri, *fast, home=home)
    assert "continue at step 7 of 12" in proc.stderr
    status = spill("status", str(project), "--state", uri, "--json", home=home)
    doc = json.loads(status.stdout)
    assert (
        doc["stages"]["tune"]["result"]["step"] == 12 and doc["stages"]["eval"]["status"] == "done"
    )
    from spill.store.fs import filesystem

    fs, path = filesystem(uri)
    fs.invalidate_cache()
    assert fs.exists(f"{path}/adapters/toy/peft/adapter_model.safetensors")
    assert fs.exists(f"{path}/runs/current.json")
    assert doc["run"]["status"] == "complete" and doc["run"]["generation"] == 2


def test_teacher_answers_become_the_training_rows(home, tmp_path):
    project = copy_toy(tmp_path / "toy")
    state = tmp_path / "state"
    teach = ("teacher=custom", "teacher.name=tiny:qwen2:5:2x32", "teacher.max_new_tokens=3")
    fast = ("tune.steps=4", "tune.ckpt_every=2")
    args = (str(project), "--state", str(state), *teach, *fast)
    spill("build", *args, "--stop-after", "distill:5", home=home)
    rec = state_doc(state)["stages"]["distill"]
    assert (rec["status"], rec["progress"]) == ("stopped", 5)
    proc = spill("build", *args, "--stop-after", "tune", home=home)
    assert "continue at row 5 of" in proc.stderr
    doc = state_doc(state)
    assert (
        doc["stages"]["distill"]["status"] == "done" and doc["stages"]["tune"]["status"] == "done"
    )
    answers = [json.loads(x) for x in (state / "files" / "teacher.jsonl").read_text().splitlines()]
    assert len(answers) == doc["data"]["train"] and all("completion" in a for a in answers)
    assert (
        doc["stages"]["tune"]["inputs"]["stage:distill"] == doc["stages"]["distill"]["fingerprint"]
    )
    dry = spill("build", *args[:3], *fast, "teacher=none", "--dry-run", home=home)
    assert "skipped: no teacher" in dry.stdout and "tune       run     fresh: " in dry.stdout


@pytest.mark.parametrize("verb", ["init", "build", "status", "resume"])
def test_help_imports_no_engine(verb):
    proc = assert_not_imported(cli_code(verb, "--help"), (*ENGINES, "hydra", "numpy"))
    assert f"usage: spill {verb}" in proc.stdout
