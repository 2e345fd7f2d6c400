"""``model.quantize`` in spill.yaml through the real CLI: the toy build tunes and grades its
tiny llama's 4-bit copy (made on first use), the choice is part of the student stages' inputs,
another quantization replans and reruns tune, and ``spill predict`` asks the copy the build
tuned on. A float build's stage inputs do not name it (its records stay what they were)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import build_state_file
from tests.func.test_build import copy_toy, spill

STUDENT = ("eval:base", "tune", "eval")
COPY = "tiny:llama:2:2x64@q4g64"


def newest_checkpoint(where) -> tuple[int, dict]:
    """(step, state.json) of the tune stage's newest committed checkpoint."""
    from spill.payloads.checkpoint import newest_commit
    from spill.project.build.stages import TUNE
    from spill.store.location import location

    return newest_commit(TUNE.place(location(where)))


def stage_state(where, stage: str) -> dict:
    return json.loads(build_state_file(where).read_text())["stages"][stage]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    base = tmp_path_factory.mktemp("build-quantized")
    home = base / "home"
    project = copy_toy(base / "toy")
    text = (project / "spill.yaml").read_text()
    edited = text.replace(
        "model:\n  name: tiny:llama:2:2x64  # generated from seed 2 on first use: 2 layers, hidden 64\n",
        "model:\n  name: tiny:llama:2:2x64  # generated from seed 2 on first use: 2 layers, hidden 64\n"
        "  quantize: 4  # its 4-bit g64 copy, made on first use\n",
    )
    assert edited != text
    (project / "spill.yaml").write_text(edited)
    proc = spill("build", str(project), "--json", home=home)
    return {"home": home, "project": project, "state": project / ".spill", "proc": proc}


def test_a_build_tunes_and_grades_the_quantized_copy(built):
    err, state = built["proc"].stderr, built["state"]
    making = [line for line in err.splitlines() if line.startswith("making ")]
    assert len(making) == 1 and making[0].startswith(f"making {COPY}, the 4-bit g64 copy"), err
    for verb in ("eval", "tune"):
        assert f"spill {verb} · model {COPY} (" in err
    assert err.count("· weights 4-bit affine g64") == 3  # eval:base, tune, eval
    for stage in STUDENT:
        inputs = stage_state(state, stage)["inputs"]
        assert (inputs["model.quantize"], inputs["model.group_size"]) == (4, 64), stage
    result = json.loads(built["proc"].stdout)["stages"]
    assert result["eval"]["result"]["accuracy"] == 1.0  # the 4-bit base still learns the toy task
    assert result["tune"]["result"]["step"] == 300
    step, ckpt = newest_checkpoint(state)
    ckpt = ckpt["model"]
    assert (
        step == 300 and ckpt["id"] == COPY and ckpt["quantization"]["format"] == "4-bit affine g64"
    )


def test_the_finished_build_answers_and_predict_uses_the_copy(built, tmp_path):
    again = spill("build", str(built["project"]), home=built["home"])
    assert "== " not in again.stderr and "making " not in again.stderr
    proc = spill(
        "predict", str(built["project"]), "--text", "red sand hot", "--json", home=built["home"]
    )
    assert f"spill predict · model {COPY} (" in proc.stderr
    assert json.loads(proc.stdout)["label"] in {"big", "hot", "low", "red"}


def test_another_quantization_replans_and_reruns_tune(built, tmp_path):
    import shutil

    project, home = built["project"], built["home"]
    state = tmp_path / "state"
    shutil.copytree(built["state"], state)
    over = ("model.quantize=8",)
    dry = spill("build", str(project), "--state", str(state), "--dry-run", *over, home=home)
    for stage in STUDENT:
        assert any(
            line.startswith(stage) and "fresh: model.quantize 4 -> 8" in line
            for line in dry.stdout.splitlines()
        ), dry.stdout
    group = spill(
        "build", str(project), "--state", str(state), "--dry-run", "model.group_size=32", home=home
    )
    assert group.stdout.count("fresh: model.group_size 64 -> 32") == 3, group.stdout
    run = spill(
        "build", str(project), "--state", str(state), "--stop-after", "tune:2", *over, home=home
    )
    assert "== tune: fresh" in run.stderr and "making tiny:llama:2:2x64@q8g64" in run.stderr
    tune = stage_state(state, "tune")
    assert tune["inputs"]["model.quantize"] == 8 and tune["progress"] == 2
    step, ckpt = newest_checkpoint(state)
    ckpt = ckpt["model"]
    assert step == 2 and ckpt["quantization"]["format"] == "8-bit affine g64"


def test_a_float_builds_inputs_do_not_name_the_quantization(tmp_path):
    """The toy build without model.quantize: every stage's inputs are what they were before
    quantized bases, so a state built then is still done."""
    from spill.project.build.build import prepare
    from spill.project.build.specs import specs
    from spill.project.config import compose

    project = copy_toy(tmp_path / "toy")
    p = compose(project)
    assert (p.model.quantize, p.model.group_size) == (None, 64)
    for spec in specs(p, prepare(p)):
        assert not [k for k in spec.inputs if k.startswith(("model.quantize", "model.group"))]
    q = compose(project, ["model.quantize=8", "model.group_size=128"])
    tune = next(s for s in specs(q, prepare(q)) if s.name == "tune")
    assert (tune.inputs["model.quantize"], tune.inputs["model.group_size"]) == (8, 128)


def test_a_quantized_teacher_answers_from_its_copy(tmp_path):
    project = copy_toy(tmp_path / "toy")
    teach = ("teacher=custom", "teacher.name=tiny:qwen2:5:2x32", "teacher.max_new_tokens=3")
    quantized = (*teach, "teacher.quantize=8", "teacher.group_size=32")
    args = (str(project), "--state", str(tmp_path / "state"), *quantized)
    proc = spill("build", *args, "--stop-after", "distill:3", home=tmp_path / "home")
    assert "making tiny:qwen2:5:2x32@q8g32, the 8-bit g32 copy" in proc.stderr
    assert "spill distill · model tiny:qwen2:5:2x32@q8g32 (" in proc.stderr
    assert "· weights 8-bit affine g32" in proc.stderr
    distill = stage_state(tmp_path / "state", "distill")
    assert (distill["inputs"]["teacher.quantize"], distill["inputs"]["teacher.group_size"]) == (
        8,
        32,
    )
    assert distill["progress"] == 3
    assert "model.quantize" not in stage_state(tmp_path / "state", "eval:base")["inputs"]
    float_teacher = spill("build", *args[:3], *teach, "--dry-run", home=tmp_path / "home")
    assert (
        "fresh: teacher.group_size 32 -> null; teacher.quantize 8 -> null" in float_teacher.stdout
    )
