"""States recorded with the weight fingerprint's older definition (64 KiB at each end of each
shard, before 2026-12-06), made honestly: a real run stopped early, then its recorded
fingerprint rewritten to the old value of the same folder (``integrity._legacy_fingerprint``)
with the checkpoint's COMMIT made consistent again. Such a state continues, with one note, to
the bits of an uninterrupted run and records the new value; the old value of other weights is
refused in one line."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from spill.models.cache import cached_fingerprint
from spill.models.integrity import _legacy_fingerprint
from tests.conftest import run_spill
from tests.func import tune_kit as kit
from tests.func.test_model_integrity import FAST, one_error

NOTE = "was recorded with spill's older weight fingerprint; the weights match it"


def _dump(doc: dict) -> bytes:  # spill.payloads.checkpoint's byte form
    return json.dumps(doc, sort_keys=True, indent=1, allow_nan=False).encode() + b"\n"


def set_fingerprint(step_dir: Path, value: str) -> None:
    """The checkpoint's state.json records ``value``; its COMMIT names the new bytes."""
    state = json.loads((step_dir / "state.json").read_bytes())
    state["model"]["fingerprint"] = value
    raw = _dump(state)
    (step_dir / "state.json").write_bytes(raw)
    commit = json.loads((step_dir / "COMMIT").read_bytes())
    commit["files"]["state.json"] = {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    (step_dir / "COMMIT").write_bytes(_dump(commit))


def tiny(folder: Path, seed: int) -> Path:
    made = run_spill("models", "tiny", str(folder), "--seed", str(seed))
    assert made.returncode == 0, made.stderr
    return folder


def test_a_tune_recorded_with_the_legacy_fingerprint_continues_to_the_same_bits(tmp_path):
    model, other = tiny(tmp_path / "model", 3), tiny(tmp_path / "other", 4)
    train = kit.write_train(tmp_path / "train.jsonl")
    control, state = str(tmp_path / "control"), str(tmp_path / "state")
    full = run_spill(*kit.tune_argv(model, train, control), timeout=kit.TIMEOUT)
    assert full.returncode == 0, full.stderr
    first = run_spill(*kit.tune_argv(model, train, state, stop_after=2), timeout=kit.TIMEOUT)
    assert first.returncode == 0, first.stderr
    step2 = Path(kit.step_dir(state, 2))
    assert kit.state_json(state, 2)["model"]["fingerprint"] == cached_fingerprint(model)

    set_fingerprint(step2, _legacy_fingerprint(other))  # another model's old value: refused
    payloads = Path(state) / "payloads"
    before = {p: p.read_bytes() for p in payloads.rglob("*") if p.is_file()}
    proc = run_spill(*kit.tune_argv(model, train, state), timeout=kit.TIMEOUT)
    assert proc.returncode == 1, proc.stderr
    assert "changed since this run started (fingerprint" in one_error(proc)
    assert NOTE not in proc.stderr
    assert {p: p.read_bytes() for p in payloads.rglob("*") if p.is_file()} == before

    set_fingerprint(step2, _legacy_fingerprint(model))
    assert kit.committed_steps(state) == [2]  # the rewritten checkpoint verifies
    proc = run_spill(*kit.tune_argv(model, train, state), timeout=kit.TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count(NOTE) == 1 and "its next checkpoint records the new one" in proc.stderr
    assert kit.resumed_from(proc.stderr) == 2
    kit.assert_same_checkpoint(state, control)  # every tensor, state.json (new value), COMMIT

    # an adapter published before the change records the old value: it exports onto these
    # weights (the export records the new one), never onto another model's
    meta = Path(state) / "adapter" / "adapter.json"
    doc = json.loads(meta.read_bytes())
    export = ["export", state, "--model", str(model)]
    meta.write_text(json.dumps(doc | {"fingerprint": _legacy_fingerprint(other)}))
    proc = run_spill(*export, str(tmp_path / "refused"), timeout=kit.TIMEOUT)
    assert proc.returncode == 1 and "was trained on weights" in one_error(proc)
    assert not (tmp_path / "refused").exists()
    meta.write_text(json.dumps(doc | {"fingerprint": _legacy_fingerprint(model)}))
    out = tmp_path / "exported"
    proc = run_spill(*export, str(out), timeout=kit.TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count(NOTE) == 1 and "the export records the new one" in proc.stderr
    recorded = json.loads((out / "export.json").read_bytes())
    assert recorded["base"]["fingerprint"] == cached_fingerprint(model), recorded


def test_a_row_state_recorded_with_the_legacy_fingerprint_continues_to_the_same_rows(tmp_path):
    model, other = tiny(tmp_path / "model", 3), tiny(tmp_path / "other", 4)
    prompts = tmp_path / "in.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"q {i}"}) + "\n" for i in range(30)))
    ref, out, state = tmp_path / "ref.jsonl", tmp_path / "out.jsonl", tmp_path / "state"
    argv = ["run", str(model), str(prompts), *FAST]
    assert run_spill(*argv, "--out", str(ref)).returncode == 0
    killed = run_spill(
        *argv, "--out", str(out), "--state", str(state), env={"SPILL_DRILL": "seg-before-commit@2"}
    )
    assert killed.returncode == -9, killed.stderr  # 25 rows committed, 5 left
    pinned = state / "rows" / "identity.json"
    doc = json.loads(pinned.read_bytes())
    assert doc["model"]["fingerprint"] == cached_fingerprint(model)

    doc["model"]["fingerprint"] = _legacy_fingerprint(other)
    pinned.write_bytes(_dump(doc))
    proc = run_spill(*argv, "--out", str(out), "--state", str(state))
    assert proc.returncode == 1, proc.stderr
    assert "holds rows of another job: model.fingerprint is" in one_error(proc)
    assert not out.exists()

    doc["model"]["fingerprint"] = _legacy_fingerprint(model)
    pinned.write_bytes(_dump(doc))
    proc = run_spill(*argv, "--out", str(out), "--state", str(state))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count(NOTE) == 1 and "its next commit records the new one" in proc.stderr
    assert "25 of 30 rows committed; running the 5 left" in proc.stderr
    assert out.read_bytes() == ref.read_bytes()
    assert json.loads(pinned.read_bytes())["model"]["fingerprint"] == cached_fingerprint(model)
    again = run_spill(*argv, "--out", str(tmp_path / "again.jsonl"), "--state", str(state))
    assert again.returncode == 0 and NOTE not in again.stderr  # the new value is pinned now


def _legacy_everywhere(project: Path, folder: Path) -> int:
    """Every job state of the build records the model's legacy fingerprint: the newest
    checkpoint of its tune stage, the identity of its row stages. How many were rewritten."""
    stages = project / ".spill" / "stages"
    legacy = _legacy_fingerprint(folder)
    ckpts = sorted(
        stages.glob("tune/payloads/ckpt-g*-s*-*"),
        key=lambda p: int(p.name.split("-s")[1].split("-")[0]),
    )
    set_fingerprint(ckpts[-1], legacy)
    pins = list(stages.glob("*/rows/identity.json"))
    for pinned in pins:
        doc = json.loads(pinned.read_bytes())
        doc["model"]["fingerprint"] = legacy
        pinned.write_bytes(_dump(doc))
    return 1 + len(pins)


def test_a_build_recorded_with_the_legacy_fingerprint_continues_and_then_plans_nothing(tmp_path):
    from tests.func.test_build import assert_same_adapter, copy_toy, spill

    home, short = tmp_path / "home", "tune.steps=4"
    reference = copy_toy(tmp_path / "reference")
    spill("build", str(reference), short, home=home)
    project = copy_toy(tmp_path / "toy")
    spill("build", str(project), short, "--stop-after", "tune:2", home=home)
    (folder,) = (p.parent for p in (home / "models" / "tiny").glob("*/config.json"))
    assert _legacy_everywhere(project, folder) == 2  # tune at step 2, eval:base's rows

    proc = spill("build", str(project), short, home=home)
    assert proc.stderr.count(NOTE) == 1  # the tune continues; eval:base is done, not re-read
    assert "continuing toy from" in proc.stderr
    assert_same_adapter(project / ".spill/adapters/toy", reference / ".spill/adapters/toy")

    assert _legacy_everywhere(project, folder) == 3  # finished: tune, eval:base, eval
    dry = spill("build", str(project), short, "--dry-run", home=home)
    assert "fresh" not in dry.stdout and "continue" not in dry.stdout, dry.stdout
    again = spill("build", str(project), short, home=home)
    assert "== " not in again.stderr and NOTE not in again.stderr  # no stage ran
