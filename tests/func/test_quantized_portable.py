"""Quantized model folders travel (issue 22) through the real CLI: a bundle of a project whose
model is spill's 4-bit copy of a tiny llama installs offline under its own name (the copy made
again from the seed, byte for byte) and builds to the same scores; a run stopped on it moves to
another home and finishes there as the unmoved build does; ``--weights`` stages the packed
files with their sha256 and computes on them as on the cached copy. The same for the kept
SmolLM2 GGUF import (``smollm2:135m@q4_1``) is ``slow``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from spill.models.cache import read_marker
from tests.conftest import build_state_file
from tests.func.test_bundle import ROOT, copy_project, scores, spill

TINY = "tiny:llama:2:2x64"
QUANT = f"{TINY}@q4g32"


def _project(where: Path, model: str, steps: int = 30) -> Path:
    """The toy project on ``model``, shortened to ``steps`` tune steps."""
    dest = copy_project(ROOT / "projects" / "toy", where)
    text = (dest / "spill.yaml").read_text()
    text = text.replace(f"name: {TINY} ", f"name: {model} ").replace(
        "steps: 300", f"steps: {steps}"
    )
    (dest / "spill.yaml").write_text(text.replace("ckpt_every: 100", "ckpt_every: 10"))
    return dest


def _files(folder: Path) -> dict[str, str]:
    """The sha256 a cache record holds for each model file."""
    doc = json.loads((folder / "spill-source.json").read_text())
    return {name: rec["sha256"] for name, rec in doc["files"].items()}


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> dict:
    """The toy project on the 4-bit copy built once to the end."""
    base = tmp_path_factory.mktemp("quant-port")
    home = base / "home"
    made = spill("models", "quantize", TINY, "--bits", "4", "--group-size", "32", home=home)
    project = _project(base / "toy", QUANT)
    spill("build", str(project), home=home)
    folder = Path(made.stdout.strip().splitlines()[-1])
    return {"home": home, "project": project, "folder": folder, "base": base}


def test_a_bundle_of_a_quantized_project_installs_offline_and_builds(quantized, tmp_path):
    path = tmp_path / "q.spb"
    out = spill("bundle", str(quantized["project"]), str(path), "--json", home=quantized["home"])
    assert json.loads(out.stdout)["models"] == QUANT
    check = spill("bundle", "--verify", str(path), "--json", home=tmp_path / "h0", offline=True)
    assert json.loads(check.stdout)["bad"] == 0

    home, dest = tmp_path / "fresh", tmp_path / "installed"
    done = spill("bundle", "--install", str(path), str(dest), "--json", home=home, offline=True)
    result = json.loads(done.stdout)
    assert result["models_own"] == [] and result["model_files_written"] == 5  # under its name
    folder = home / "models" / quantized["folder"].relative_to(quantized["home"] / "models")
    assert _files(folder) == _files(quantized["folder"])  # made again from the seed, same bytes
    config = json.loads((folder / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 32
    spill("models", "verify", QUANT, home=home, offline=True)
    spill("build", str(dest), home=home, offline=True)
    assert scores(dest / ".spill") == scores(quantized["project"] / ".spill")


def test_a_bundled_quantized_file_that_was_changed_is_refused_by_verify(quantized, tmp_path):
    path = tmp_path / "q.spb"
    spill("bundle", str(quantized["project"]), str(path), home=quantized["home"])
    data = bytearray(path.read_bytes())
    weights = (quantized["folder"] / "model.safetensors").read_bytes()
    at = data.find(weights[-4096:])  # a packed word near the end of the weights, as stored
    assert at > 0
    data[at + 100] ^= 0xFF
    path.write_bytes(bytes(data))
    check = spill("bundle", "--verify", str(path), "--json", home=tmp_path / "h", ok=False)
    assert check.returncode != 0 and "model.safetensors" in check.stdout + check.stderr


def test_a_run_on_a_quantized_base_moves_and_finishes_on_another_home(quantized, tmp_path):
    src = _project(tmp_path / "src", QUANT)
    spill("build", str(src), "--stop-after", "tune:10", home=quantized["home"])
    dst = tmp_path / "dst"
    spill("move", str(src), str(dst), home=quantized["home"])
    other = tmp_path / "other-home"  # the copy made there again from the seed
    spill("models", "quantize", TINY, "--bits", "4", "--group-size", "32", home=other)
    done = spill("build", str(dst), home=other)
    assert "continu" in done.stderr or "resum" in done.stderr, done.stderr
    assert scores(dst / ".spill") == scores(quantized["project"] / ".spill")


def test_weights_stages_a_quantized_folder_with_its_hashes(quantized, tmp_path):
    shared = tmp_path / "shared" / "q4"
    shutil.copytree(quantized["folder"], shared, ignore=shutil.ignore_patterns("spill-source.json"))
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "a", "prompt": "hello there"}) + "\n")
    outs = {}
    for how, args in (("cached", [QUANT]), ("staged", [TINY, "--weights", str(shared)])):
        out = tmp_path / f"{how}.jsonl"
        ran = spill(
            "run", *args, str(rows), "--out", str(out), "--max-new-tokens", "6",
            "--dtype", "float32", home=quantized["home"],
        )  # fmt: skip
        assert "· weights 4-bit affine g32" in ran.stderr, ran.stderr
        outs[how] = out.read_bytes()
    assert outs["staged"] == outs["cached"]  # the same tokens, byte for byte
    (staged,) = (quantized["home"] / "models" / "staged").iterdir()
    assert _files(staged) == _files(quantized["folder"])  # every packed file, hashed as copied
    spill("models", "verify", str(staged), home=quantized["home"])


@pytest.mark.slow
def test_a_bundle_of_a_project_on_the_kept_smollm2_installs_offline_and_builds(tmp_path):
    home = tmp_path / "home"
    spill("models", "import", "smollm2:135m", "--keep-quantization", home=home)
    project = _project(tmp_path / "sm", "smollm2:135m@q4_1")
    path = tmp_path / "sm.spb"
    spill("bundle", str(project), str(path), home=home)
    fresh, dest = tmp_path / "fresh", tmp_path / "installed"
    done = spill("bundle", "--install", str(path), str(dest), "--json", home=fresh, offline=True)
    assert json.loads(done.stdout)["models_own"] == []  # imported again from the GGUF here
    (kept,) = (fresh / "models").glob("smollm2-135m*q4_1")
    assert _files(kept) == _files(next((home / "models").glob("smollm2-135m*q4_1")))
    spill("build", str(dest), "--stop-after", "eval:base", home=fresh, offline=True)
    spill("build", str(project), "--stop-after", "eval:base", home=home)
    assert _base_score(dest / ".spill") == _base_score(project / ".spill") is not None


def _base_score(state: Path):
    doc = json.loads(build_state_file(state).read_text())
    return doc["stages"]["eval:base"]["result"].get("accuracy")


def test_a_model_quantize_project_bundles_and_remakes_the_copy_offline(tmp_path):
    home = tmp_path / "home"
    project = copy_project(ROOT / "projects" / "toy", tmp_path / "toy")
    yaml = project / "spill.yaml"
    text = yaml.read_text()
    yaml.write_text(
        text.replace("  name: tiny:llama:2:2x64", "  quantize: 4\n  name: tiny:llama:2:2x64", 1)
    )
    spill("build", str(project), home=home)
    bundle = tmp_path / "toy.spb"
    spill("bundle", str(project), str(bundle), home=home)
    fresh, dest = tmp_path / "fresh-home", tmp_path / "installed"
    spill("bundle", "--install", str(bundle), str(dest), home=fresh, offline=True)
    done = spill("build", str(dest), home=fresh, offline=True)
    assert "making tiny:llama:2:2x64@q4g64" in done.stderr
    assert scores(dest / ".spill") == scores(project / ".spill")
    copies = [h / "models" / "quantized" / "tiny-llama-2-2x64-q4g64" for h in (home, fresh)]
    hashes = [{n: f["sha256"] for n, f in read_marker(c)["files"].items()} for c in copies]
    assert hashes[0] == hashes[1] and "model.safetensors" in hashes[0]
