"""The export stage through the real CLI: the toy build with ``export: formats: [hf, mlx]``
merges its tuned adapter after ``tune`` and writes what ``spill export`` writes, byte for byte;
it reruns only when the adapter or the export settings change, a deleted export is written
again, kills at its boundaries (after a format's rename, before its commit) and a stop between
formats end in the same bytes, and ``spill move`` and ``spill bundle`` leave the exports behind
unless asked to carry them."""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
from pathlib import Path

import pytest

from tests.conftest import build_state_file, run_spill
from tests.func.test_build import copy_toy, spill

STEPS = "tune.steps=6"  # the toy's adapter, quickly
FORMATS = ("hf", "mlx")  # the toy's byte-only tokenizer has no GGUF (see below)
SHARD = "model-00001-of-00001.safetensors"


def project_with_exports(where: Path) -> Path:
    project = copy_toy(where)
    text = (project / "spill.yaml").read_text()
    (project / "spill.yaml").write_text(text + "\nexport:\n  formats: [hf, mlx]\n")
    return project


def tree(folder: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``folder``."""
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def exports(state: Path) -> dict[str, str]:
    return tree(state / "exports" / "toy")


def stage(state: Path, name: str) -> dict:
    return json.loads(build_state_file(state).read_text())["stages"][name]


def actions(proc) -> dict[str, str]:
    """The plan's action per stage, from the build's pre-run lines."""
    out = {}
    for line in proc.stderr.splitlines():
        cells = line.split()
        if line.startswith("  ") and len(cells) >= 2 and cells[0] in (
            "eval:base", "distill", "tune", "eval", "export",
        ):  # fmt: skip
            out[cells[0]] = cells[1]
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    base = tmp_path_factory.mktemp("build-export")
    home = base / "home"
    project = project_with_exports(base / "toy")
    proc = spill("build", str(project), STEPS, home=home)
    return {"home": home, "project": project, "state": project / ".spill", "proc": proc}


def test_the_build_exports_what_spill_export_writes(built, tmp_path):
    state, home = built["state"], built["home"]
    rec = stage(state, "export")
    assert rec["status"] == "done" and (rec["progress"], rec["total"], rec["unit"]) == (
        2,
        2,
        "format",
    )
    assert rec["inputs"]["export.formats"] == list(FORMATS)
    assert rec["inputs"]["stage:tune"] == stage(state, "tune")["fingerprint"]
    assert set(rec["result"]["formats"]) == set(FORMATS)
    assert rec["producers"][0]["engine"] == "numpy"
    out = built["proc"].stdout
    assert "export     done     hf bf16, mlx bf16" in out
    assert f"exports: {state}/exports/toy/ (" in out
    made = exports(state)
    assert set(rec["outputs"]) == {f"exports/toy/{k}" for k in made}  # every file recorded
    for fmt in FORMATS:  # the stage's bytes are the CLI's on the same adapter
        out_dir = tmp_path / fmt
        spill("export", str(state / "adapters" / "toy"), str(out_dir), "--format", fmt, home=home)
        mine = json.loads((state / "exports" / "toy" / fmt / "export.json").read_text())
        theirs = json.loads((out_dir / "export.json").read_text())
        assert mine["adapter"]["folder"] == "adapters/toy"  # not where the state lies
        mine["adapter"]["folder"] = theirs["adapter"]["folder"]
        assert mine == theirs
        given = {k: v for k, v in tree(out_dir).items() if k != "export.json"}
        assert given == {
            k[len(fmt) + 1 :]: v
            for k, v in made.items()
            if k.startswith(fmt + "/") and not k.endswith("/export.json")
        }
    from spill.ground.validate import validate

    validate(mine, "export", where="export.json")


def test_transformers_reads_the_stage_s_hf_export(built):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(built["state"] / "exports" / "toy" / "hf")
    assert model.config.num_hidden_layers == 2


def test_a_gguf_of_the_toy_s_byte_only_tokenizer_is_refused_in_one_line(built, tmp_path):
    """Issue 35, item 28: the toy's tiny model has a byte-level vocabulary without merges,
    whose GGUF llama.cpp refuses ("cannot find tokenizer merges"): the export stage says so in
    one line and writes nothing; the stages before it stay done."""
    home = built["home"]
    project = tmp_path / "toy"
    shutil.copytree(built["project"], project)
    text = (project / "spill.yaml").read_text().replace("formats: [hf, mlx]", "formats: [gguf]")
    (project / "spill.yaml").write_text(text)
    proc = spill("build", str(project), STEPS, home=home, ok=False)
    errors = [x for x in proc.stderr.splitlines() if x.startswith("spill: error: ")]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert len(errors) == 1 and "tokenizer.json has no BPE merges" in errors[0], proc.stderr
    assert "cannot find tokenizer merges" in errors[0] and "--format hf" in errors[0]
    assert not (project / ".spill" / "exports" / "toy" / "gguf").exists()
    assert not list((project / ".spill" / "exports" / "toy").glob(".*"))
    assert actions(proc)["tune"] == "done", proc.stderr


def test_it_reruns_only_when_the_adapter_or_its_settings_change(built, tmp_path):
    home = built["home"]
    project = copy_toy(tmp_path / "toy")
    shutil.rmtree(project)
    shutil.copytree(built["project"], project)
    state = project / ".spill"
    first = exports(state)
    again = spill("build", str(project), STEPS, home=home)
    assert set(actions(again).values()) <= {"done", "skip"}, again.stderr
    # another eval setting: eval runs, the export stays done
    other = spill("build", str(project), STEPS, "eval.max_new_tokens=9", home=home)
    assert (actions(other)["eval"], actions(other)["export"]) == ("run", "done")
    # a deleted export is written again, the same bytes
    (state / "exports" / "toy" / "mlx" / SHARD).unlink()
    status = spill("status", str(project), home=home).stdout
    assert f"export     out of date  exports/toy/mlx/{SHARD} missing" in status
    redo = spill("build", str(project), STEPS, "eval.max_new_tokens=9", home=home)
    assert actions(redo)["export"] == "run" and f"{SHARD} missing" in redo.stderr
    assert exports(state) == first
    # another dtype: only the export runs
    f16 = spill(
        "build", str(project), STEPS, "eval.max_new_tokens=9", "export.dtype=f16", home=home
    )
    assert actions(f16) == {
        "eval:base": "done", "distill": "skip", "tune": "done", "eval": "done", "export": "run",
    }  # fmt: skip
    assert (
        json.loads((state / "exports" / "toy" / "mlx" / "export.json").read_text())["dtype"]
        == "f16"
    )
    # no formats: the stage is recorded skipped (its files stay, claimed by no record)
    off = spill(
        "build", str(project), STEPS, "eval.max_new_tokens=9", "export.formats=[]", home=home
    )
    assert actions(off)["export"] == "skip" and stage(state, "export")["status"] == "skipped"
    assert "export     skipped  no formats" in off.stdout and "exports: " not in off.stdout


@pytest.mark.parametrize(
    "drill", ["export-written@1", pytest.param("export-written@2", marks=pytest.mark.slow)]
)
def test_a_build_killed_in_the_export_stage_ends_in_the_same_bytes(built, tmp_path, drill):
    home = built["home"]
    project = project_with_exports(tmp_path / "toy")
    env = {"SPILL_HOME": str(home), "HF_HUB_OFFLINE": "1", "SPILL_DRILL": drill}
    killed = run_spill("build", str(project), STEPS, env=env)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    rerun = spill("build", str(project), STEPS, home=home)
    assert actions(rerun)["export"] == "continue", rerun.stderr
    # the format renamed but not committed is written again; a committed one is kept
    writes = [ln for ln in rerun.stderr.splitlines() if ln.startswith("export ")]
    assert len(writes) == (2 if drill.endswith("@1") else 1), rerun.stderr
    assert exports(project / ".spill") == exports(built["state"])
    assert not list((project / ".spill" / "exports" / "toy").glob(".*"))  # no temporary left


def test_a_stop_between_formats_continues_at_the_next(built, tmp_path):
    home = built["home"]
    project = project_with_exports(tmp_path / "toy")
    first = spill("build", str(project), STEPS, "--stop-after", "export:1", home=home)
    rec = stage(project / ".spill", "export")
    assert (rec["status"], rec["progress"]) == ("stopped", 1), first.stderr
    assert list(rec["result"]["formats"]) == ["hf"]
    status = spill("status", str(project), home=home).stdout
    assert "export     stopped  at format 1 of 2" in status
    rest = spill("build", str(project), STEPS, home=home)
    assert "continue at format 1 of 2" in rest.stderr
    assert exports(project / ".spill") == exports(built["state"])


@pytest.mark.slow  # (5 s; CI's time budget)
def test_a_sigterm_in_the_export_stage_stops_the_build_and_a_rerun_finishes(built, tmp_path):
    """SIGSTOP at the first format's rename, SIGTERM, SIGCONT: exit 75, then the rerun ends in the
    same bytes."""
    import os
    import subprocess
    import sys
    import time

    from tests.func.authority_kit import wait_stopped

    home = built["home"]
    project = project_with_exports(tmp_path / "toy")
    env = {**os.environ, "SPILL_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    env["SPILL_DRILL"] = "export-written@1:stop"
    with open(tmp_path / "err", "w+") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "spill", "build", str(project), STEPS],
            env=env, stdout=subprocess.DEVNULL, stderr=log,
        )  # fmt: skip
        wait_stopped(proc.pid)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        proc.send_signal(signal.SIGCONT)
        proc.wait(timeout=120)
        log.seek(0)
        err = log.read()
    assert proc.returncode == 75, err
    assert "preempted" in err
    rerun = spill("build", str(project), STEPS, home=home)
    assert actions(rerun)["export"] == "continue"
    assert exports(project / ".spill") == exports(built["state"])


def test_move_leaves_the_exports_unless_asked_and_bundle_carries_them_when_asked(built, tmp_path):
    home = built["home"]
    src = tmp_path / "src"
    shutil.copytree(built["project"], src)
    spill("move", str(src), str(tmp_path / "bare"), home=home)
    assert not (tmp_path / "bare" / ".spill" / "exports").exists()
    note = spill("status", str(tmp_path / "bare"), home=home).stdout
    assert "export: exports/toy missing; `spill build` runs it again" in note
    spill("move", str(src), str(tmp_path / "full"), "--with-exports", home=home)
    assert exports(tmp_path / "full" / ".spill") == exports(built["state"])
    again = spill("build", str(tmp_path / "full"), STEPS, home=home)
    assert set(actions(again).values()) <= {"done", "skip"}
    refused = spill(
        "bundle", str(src), str(tmp_path / "x.spill"), "--with-exports", home=home, ok=False
    )
    assert refused.returncode == 2 and "add --with-state" in refused.stderr
    spill("bundle", str(src), str(tmp_path / "b.spill"), "--with-state", home=home)
    spill(
        "bundle", str(src), str(tmp_path / "e.spill"), "--with-state", "--with-exports", home=home
    )
    for name, carried in (("b", False), ("e", True)):
        dest = tmp_path / f"installed-{name}"
        spill("bundle", "--install", str(tmp_path / f"{name}.spill"), str(dest), home=home)
        assert (dest / ".spill" / "exports").exists() == carried
        if carried:
            assert exports(dest / ".spill") == exports(built["state"])
            rebuilt = spill("build", str(dest), STEPS, home=home)
            assert set(actions(rebuilt).values()) <= {"done", "skip"}, rebuilt.stderr


def test_an_export_stage_on_an_object_store_state(built, tmp_path, request):
    """The state in moto's S3: the exports are uploaded (export.json last) with the bytes of a
    local build; a kill after the first format's upload and a deleted object are made good."""
    from tests.conftest import bucket_uri

    home = built["home"]
    project = project_with_exports(tmp_path / "toy")
    uri = f"{bucket_uri(request, 's3')}/builds/toy"
    env = {"SPILL_HOME": str(home), "HF_HUB_OFFLINE": "1", "SPILL_DRILL": "export-written@1"}
    killed = run_spill("build", str(project), "--state", uri, STEPS, env=env)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    rerun = spill("build", str(project), "--state", uri, STEPS, home=home)
    assert actions(rerun)["export"] == "continue", rerun.stderr
    from spill.store.fs import filesystem

    fs, path = filesystem(uri)
    fs.invalidate_cache()
    local = exports(built["state"])
    there = {k: hashlib.sha256(fs.cat_file(f"{path}/exports/toy/{k}")).hexdigest() for k in local}
    assert there == local
    fs.rm_file(f"{path}/exports/toy/hf/config.json")
    status = spill("status", str(project), "--state", uri, home=home).stdout
    assert "exports/toy/hf/config.json missing" in status
    again = spill("build", str(project), "--state", uri, STEPS, home=home)
    assert actions(again)["export"] == "run"
    fs.invalidate_cache()
    assert (
        hashlib.sha256(fs.cat_file(f"{path}/exports/toy/hf/config.json")).hexdigest()
        == (local["hf/config.json"])
    )


@pytest.mark.slow  # (about a minute; CI's time budget)
def test_sigkill_at_random_moments_of_the_export_stage_then_the_same_bytes(built, tmp_path):
    """A larger tiny llama (6 x 768) tuned and graded first; then only the export runs (hf, and
    a 4-bit mlx folder), SIGKILLed at a uniformly random moment between a dry run's length (start-up and planning)
    and an uninterrupted run's, in six copies, each then rerun: the bytes of the control."""
    import os
    import random
    import subprocess
    import sys
    import time

    from spill.project.build.stages import EXPORT

    home = built["home"]
    env = {**os.environ, "SPILL_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    base = project_with_exports(tmp_path / "base")
    model = ("model.name=tiny:llama:3:6x768", STEPS)
    spill("build", str(base), *model, "export.formats=[]", home=home)
    on = (*model, "export.quantize=4")

    def copy(name: str) -> Path:
        shutil.copytree(base, tmp_path / name)
        return tmp_path / name

    control = copy("control")
    t0 = time.monotonic()
    spill("build", str(control), *on, "--dry-run", home=home)
    startup = time.monotonic() - t0
    t0 = time.monotonic()
    done = spill("build", str(control), *on, home=home)
    length = time.monotonic() - t0
    assert actions(done)["export"] == "run" and actions(done)["tune"] == "done"
    rng, kills = random.Random(20261203), []
    for i in range(6):  # each from the tuned copy: one kill inside the export's window, a rerun
        victim = copy(f"victim-{i}")
        argv = [sys.executable, "-m", "spill", "build", str(victim), *on]
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        at = rng.uniform(startup, length)
        try:
            proc.wait(timeout=at)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
        proc.wait()
        committed = EXPORT.probe(str(victim / ".spill"))[0]  # formats, from the job state
        kills.append((round(at, 2), proc.returncode, committed))
        last = spill("build", str(victim), *on, home=home)
        assert "Traceback" not in last.stderr, kills
        assert exports(victim / ".spill") == exports(control / ".spill"), kills
        assert not list((victim / ".spill" / "exports" / "toy").glob(".*")), kills
    assert sum(rc == -signal.SIGKILL for _, rc, _ in kills) >= 4, kills
    print("kills (s, rc, formats):", kills, "dry run", round(startup, 2), "run", round(length, 2))
