"""Quantized bases travel: ``--weights`` stages a packed folder from S3 and every file's sha256 is
recorded; a project on ``model.quantize: 4`` bundles, installs into a fresh SPILL_HOME and builds
there with the network blocked, to the same scores and the same copy (spill's quantizer gives the
same bytes on every machine, so the installing machine's copy is checked by its hashes)."""

from __future__ import annotations

import json
from pathlib import Path

from spill.hashing import file_sha256
from spill.models.cache import is_model_file, read_marker
from tests.conftest import run_spill
from tests.func import tune_kit as kit
from tests.func.test_bundle import ROOT, copy_project, scores, spill


def _upload(folder: Path, bucket: str, prefix: str) -> str:
    import s3fs

    fs = s3fs.S3FileSystem()
    for path in sorted(folder.iterdir()):
        if path.is_file():
            fs.put_file(str(path), f"{bucket}/{prefix}/{path.name}")
    return f"s3://{bucket}/{prefix}"


def test_weights_stage_a_quantized_folder_from_s3(tiny_models, s3_bucket, tmp_path):
    folder = kit.quantized_tiny(tiny_models, tmp_path / "q4g32")
    uri = _upload(folder, s3_bucket, "models/q4g32")
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt": "one two three"}\n')
    outs = []
    for name, extra in (("local", []), ("staged", ["--weights", uri])):
        out = tmp_path / f"{name}.jsonl"
        model = str(folder) if name == "local" else "tinyq"
        proc = run_spill(
            "run", model, str(src), "--out", str(out), "--max-new-tokens", "4",
            "--dtype", "float32", *extra, env={"SPILL_HOME": str(tmp_path / "home")},
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert "weights 4-bit affine g32" in proc.stderr
        outs.append([json.loads(line)["output"] for line in out.read_text().splitlines()])
    assert outs[0] == outs[1]
    [staged] = (tmp_path / "home" / "models" / "staged").glob("tinyq-*")
    recorded = {n: f["sha256"] for n, f in read_marker(staged)["files"].items()}
    source = {p.name: file_sha256(p) for p in folder.iterdir() if is_model_file(p.name)}
    assert recorded == source  # every staged file, packed weights included, hashed as copied


def test_a_quantized_project_bundles_and_builds_offline(tmp_path):
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
