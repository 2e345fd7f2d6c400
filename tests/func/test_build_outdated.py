"""Issue 8 items 2, 3 and 7 through the real CLI on the toy project: make's rule (a stage after
one that reruns is never shown done), outputs deleted or changed after a finished build
(restored from the stage's committed state, else rerun with everything after them), and a model
name that names nothing, refused while planning.

Destructive tests work on a copy of the session's reference build (``tests/func/test_build.py``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from spill.store.location import location
from tests.conftest import assert_not_imported, build_state_file, cli_code
from tests.func import test_build
from tests.func.test_build import (
    assert_same_adapter,
    copy_toy,
    digest,
    one_line_error,
    spill,
    state_doc,
)

home = test_build.home  # the session's fixtures: one SPILL_HOME, one reference build
reference = test_build.reference


def table(text: str) -> dict[str, list[str]]:
    """A printed table as stage -> its other cells."""
    out = {}
    for line in text.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells[0] in ("eval:base", "distill", "tune", "eval"):
            out[cells[0]] = cells[1:]
    return out


def copied(reference, tmp_path) -> tuple[Path, Path]:
    project = copy_toy(tmp_path / "toy")
    state = tmp_path / "state"
    shutil.copytree(reference["state"], state)
    return project, state


def test_rerun_tune_stopped_early_shows_no_old_eval(reference, home, tmp_path):
    """Item 2: after a finished build, tune.lr=0.004 --stop-after tune:3."""
    project, state = copied(reference, tmp_path)
    args = (str(project), "--state", str(state), "tune.lr=0.004")
    proc = spill("build", *args, "--stop-after", "tune:3", home=home)
    assert table(proc.stderr)["eval"] == ["wait", "waits for tune (runs first)"]
    assert "== eval" not in proc.stderr
    shown = table(proc.stdout)
    assert shown["tune"][:2] == ["stopped", "at step 3 of 300"] and shown["eval"] == ["not run"]
    assert "1.000" not in proc.stdout  # the old adapter's score is shown nowhere
    doc = state_doc(state)
    assert "eval" not in doc["stages"] and doc["stages"]["tune"]["status"] == "stopped"
    assert doc["plan"][3] == {
        "stage": "eval",
        "action": "wait",
        "reason": "waits for tune (runs first)",
    }
    assert "outputs" not in doc["stages"]["tune"]
    for gone in ("files/eval.jsonl", "adapters/toy"):
        assert not (state / gone).exists(), gone
    # of the old eval's job state only the completed run's segments stay, where its control
    # object (read-only for good) points; this run points at none of them
    runs = json.loads((state / "runs" / "current.json").read_text())
    old, now = (json.loads((state / "runs" / r / "control.json").read_text()) for r in runs["runs"])
    left = [p.relative_to(state).as_posix() for p in (state / "stages/eval").rglob("*")]
    folders = {f.rsplit("/", 1)[0] for f in left if f.count("/") == 4}  # stages/eval/payloads/x/f
    assert folders == set(old["pointers"]["stages/eval/rows"])
    assert all("/payloads" in f for f in left)  # no identity.json: a fresh eval pins its own
    assert not [k for k in now["pointers"] if k.startswith("stages/eval/")]
    assert (state / "files" / "eval-base.jsonl").is_file()  # eval:base is still done
    status = spill("status", str(project), "--state", str(state), home=home)
    assert "1.000" not in status.stdout and "at step 3 of 300" in status.stdout
    assert table(status.stdout)["eval"] == ["not run"]
    as_json = json.loads(spill("status", *args[:3], "--json", home=home).stdout)
    assert set(as_json["stages"]) == {"eval:base", "distill", "tune", "export"}
    dry = spill("build", *args, "--dry-run", home=home).stdout
    assert table(dry)["tune"] == ["continue", "continue at step 3 of 300"]
    assert table(dry)["eval"] == ["run", "fresh: not run yet"]


def test_deleted_and_changed_outputs_are_restored_without_recomputing(reference, home, tmp_path):
    """Item 3: the adapter (both copies) deleted, graded rows deleted or flipped in place."""
    project, state = copied(reference, tmp_path)
    args = (str(project), "--state", str(state))
    shutil.rmtree(state / "adapters" / "toy")
    shutil.rmtree(state / "stages" / "tune" / "adapter")
    (state / "files" / "eval.jsonl").unlink()
    base = state / "files" / "eval-base.jsonl"
    data = bytearray(base.read_bytes())
    data[20] ^= 1  # same size, other bytes
    base.write_bytes(bytes(data))

    status = spill("status", *args, home=home)
    assert table(status.stdout)["tune"][:2] == ["out of date", "adapters/toy missing"]
    assert table(status.stdout)["eval:base"][:2] == ["out of date", "files/eval-base.jsonl changed"]
    assert "restores it from tune step 300 checkpoint" in status.stdout
    assert "eval:base: files/eval-base.jsonl changed; `spill build` restores it" in status.stdout
    dry = spill("build", *args, "--dry-run", home=home).stdout
    assert table(dry)["tune"][:2] == [
        "restore",
        "adapters/toy missing; restored from tune step 300 checkpoint",
    ]
    assert table(dry)["eval"][:2] == [
        "restore",
        "files/eval.jsonl missing; restored from 39 committed rows",
    ]
    assert table(dry)["eval:base"][:2] == [
        "restore",
        "files/eval-base.jsonl changed; restored from 39 committed rows",
    ]

    proc = spill("build", *args, home=home)
    assert "spill tune ·" not in proc.stderr and "spill eval ·" not in proc.stderr  # no engine
    assert "== tune: adapters/toy missing; restored from tune step 300 checkpoint" in proc.stderr
    assert digest(state / "adapters") == digest(reference["state"] / "adapters")
    for name in ("eval.jsonl", "eval-base.jsonl"):
        assert (state / "files" / name).read_bytes() == (
            reference["state"] / "files" / name
        ).read_bytes()
    doc, ref = state_doc(state), state_doc(reference["state"])
    assert {s: r["outputs"] for s, r in doc["stages"].items() if "outputs" in r}.keys() == {
        "eval:base",
        "tune",
        "eval",
    }
    for s in ("eval:base", "tune", "eval"):
        assert doc["stages"][s]["result"] == ref["stages"][s]["result"]
        assert doc["stages"][s]["progress"] == ref["stages"][s]["progress"]
    # touched but equal: still done, on the fast path, without a stage
    os.utime(state / "adapters" / "toy" / "params.safetensors", ns=(1, 1))
    again = spill("build", *args, home=home)
    assert "spill build ·" not in again.stderr and table(again.stdout)["eval"][0] == "done"


def test_outputs_that_cannot_be_restored_rerun_the_stage_and_what_follows(
    reference, home, tmp_path
):
    """Item 3: the adapter and tune's whole job state gone: tune and eval rerun."""
    project, state = copied(reference, tmp_path)
    args = (str(project), "--state", str(state))
    shutil.rmtree(state / "adapters" / "toy")
    shutil.rmtree(state / "stages" / "tune")
    status = spill("status", *args, home=home).stdout
    assert table(status)["tune"][:2] == ["out of date", "adapters/toy missing"]
    assert table(status)["eval"][:2] == ["out of date", "tune reruns first"]
    assert "1.000" not in status
    dry = spill("build", *args, "--dry-run", home=home).stdout
    assert table(dry)["tune"][:2] == ["run", "fresh: adapters/toy missing"]
    assert table(dry)["eval"][:2] == ["run", "fresh: tune runs first"]
    stopped = spill("build", *args, "--stop-after", "eval:base", home=home)
    assert table(stopped.stderr)["eval"] == [
        "wait",
        "not now: after --stop-after eval:base; out of date: tune is not done",
    ]
    assert set(state_doc(state)["stages"]) == {"eval:base", "distill", "export"}
    assert not (state / "files" / "eval.jsonl").exists()
    proc = spill("build", *args, home=home)
    assert "== tune: fresh: not run yet" in proc.stderr and "== eval:" in proc.stderr
    assert "== eval:base" not in proc.stderr
    assert state_doc(state)["stages"]["eval"]["result"]["accuracy"] == 1.0
    assert_same_adapter(state / "adapters" / "toy", reference["state"] / "adapters" / "toy")


def test_a_state_written_before_outputs_were_recorded(reference, home, tmp_path):
    """Records without ``outputs`` (an older spill) are checked by the files' existence."""
    project, state = copied(reference, tmp_path)
    args = (str(project), "--state", str(state))
    doc = state_doc(state)
    for rec in doc["stages"].values():
        rec.pop("outputs", None)
    build_state_file(state).write_text(json.dumps(doc))  # as an older spill recorded it
    proc = spill("build", *args, home=home)
    assert "spill build ·" not in proc.stderr and table(proc.stdout)["eval"][0] == "done"
    (state / "files" / "eval.jsonl").unlink()
    dry = spill("build", *args, "--dry-run", home=home).stdout
    assert table(dry)["eval"][:2] == [
        "restore",
        "files/eval.jsonl missing; restored from 39 committed rows",
    ]
    spill("build", *args, home=home)
    assert "outputs" in state_doc(state)["stages"]["eval"]
    assert (state / "files" / "eval.jsonl").read_bytes() == (
        reference["state"] / "files" / "eval.jsonl"
    ).read_bytes()


def test_unknown_model_names_fail_while_planning(home, tmp_path):
    """Item 7: one line, exit 1, before anything runs or is written."""
    project = copy_toy(tmp_path / "toy")
    state = tmp_path / "state"
    cases = [
        (("model.name=qwen9:7b",), "model.name: unknown model alias 'qwen9:7b'"),
        (("model.name=./no-such-folder",), "model.name: ./no-such-folder: no such folder"),
        (("model.name=tiny:gpt:1",), "model.name: 'tiny:gpt:1' is not a tiny model name"),
        (("teacher=custom", "teacher.name=smollm9:1m"), "teacher.name: unknown model alias"),
    ]
    for overrides, message in cases:
        for extra in (("--dry-run",), ()):
            proc = spill(
                "build",
                str(project),
                "--state",
                str(state),
                *overrides,
                *extra,
                home=home,
                ok=False,
            )
            one_line_error(proc, message)
            assert not state.exists()
    # a hub id cannot be checked offline: it is accepted as spelled
    dry = spill(
        "build",
        str(project),
        "--state",
        str(state),
        "model.name=Org/Some-Model",
        "--dry-run",
        home=home,
    )
    assert table(dry.stdout)["eval:base"][:1] == ["run"]


def test_dry_run_imports_no_engine(home, tmp_path):
    project = copy_toy(tmp_path / "toy")
    for extra in ([], ["model.name=qwen9:7b"]):
        code = cli_code("build", str(project), "--dry-run", *extra)
        proc = assert_not_imported(code, env={"SPILL_HOME": str(home), "HF_HUB_OFFLINE": "1"})
        assert proc.stdout.strip().endswith("rc 1" if extra else "rc 0"), proc.stdout


def test_teacher_answers_are_restored_from_committed_rows(home, tmp_path):
    """distill's output is training rows built from the teacher's answers, not the raw records."""
    project = copy_toy(tmp_path / "toy")
    state = tmp_path / "state"
    teach = ("teacher=custom", "teacher.name=tiny:qwen2:5:2x32", "teacher.max_new_tokens=3")
    args = (str(project), "--state", str(state), *teach, "tune.steps=2", "tune.ckpt_every=1")
    spill("build", *args, "--stop-after", "distill", home=home)
    answers = state / "files" / "teacher.jsonl"
    kept = answers.read_bytes()
    answers.unlink()
    dry = spill("build", *args, "--dry-run", home=home).stdout
    assert table(dry)["distill"][0] == "restore" and table(dry)["tune"][0] == "run"
    proc = spill("build", *args, "--stop-after", "distill", home=home)
    assert "spill distill ·" not in proc.stderr and "== distill: files/teacher.jsonl missing" in (
        proc.stderr
    )
    assert answers.read_bytes() == kept


def test_a_restore_that_fails_is_one_line_and_the_next_build_recomputes(reference, home, tmp_path):
    project, state = copied(reference, tmp_path)
    args = (str(project), "--state", str(state))
    shutil.rmtree(state / "adapters" / "toy")
    shutil.rmtree(state / "stages" / "tune" / "adapter")
    from spill.control.place import Place

    pointed = Place(location(state), "stages/tune").pointer("ckpt")[0]
    assert pointed.endswith("-s300-0")
    final = Path(pointed) / "params.safetensors"
    data = bytearray(final.read_bytes())
    data[-1] ^= 1  # the final checkpoint no longer verifies against its COMMIT
    final.write_bytes(bytes(data))
    proc = spill("build", *args, home=home, ok=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("spill: error: tune: its outputs cannot be restored (") and (
        last.endswith("run spill build again to compute them afresh")
    )
    assert set(state_doc(state)["stages"]) == {"eval:base", "distill"}  # eval and export read tune
    dry = spill("build", *args, "--dry-run", home=home).stdout
    assert table(dry)["tune"] == ["run", "fresh: not run yet"]
    assert table(dry)["eval"] == ["run", "fresh: not run yet"]
