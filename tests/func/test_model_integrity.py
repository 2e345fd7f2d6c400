"""Model files that change after they entered the cache, through the real CLI (issue 8 items 4, 9).

A same-size byte flip in a cached model's safetensors fails ``spill run`` in one line naming the
file, ``spill models verify`` names it too, a stopped tune continued after a flip (or after its
model folder was written again with other weights) names the file instead of "use the same
settings", and ``spill models list`` prints its table with a broken folder and a damaged record.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from spill.ground.paths import models_dir
from tests.conftest import run_spill
from tests.func import tune_kit as kit

FAST = ["--max-new-tokens", "2", "--dtype", "float32"]


def flip(path: Path, at: float = 0.5) -> None:
    """Invert one byte in place: same size, new content."""
    with open(path, "r+b") as f:
        f.seek(int(path.stat().st_size * at))
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


def one_error(proc) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("spill: error:")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


@pytest.fixture
def prompts(tmp_path) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": 1, "prompt": "hello"}\n{"id": 2, "prompt": "hi"}\n')
    return path


def test_a_byte_flip_in_a_cached_model_fails_run_and_verify_naming_the_file(tmp_path, prompts):
    out = tmp_path / "out.jsonl"
    first = run_spill("run", "tiny:llama:11", str(prompts), "--out", str(out), *FAST)
    assert first.returncode == 0, first.stderr
    (folder,) = (models_dir() / "tiny").iterdir()
    marker = json.loads((folder / "spill-source.json").read_text())
    assert set(marker["files"]) >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert "model.safetensors" in marker["verified"]  # the first run left its stat key

    ok = run_spill("models", "verify", "tiny:llama:11")
    assert ok.returncode == 0, ok.stderr
    assert " ok " in ok.stdout and "model" in ok.stdout.splitlines()[0]

    shard = folder / "model.safetensors"
    size = shard.stat().st_size
    flip(shard)
    assert shard.stat().st_size == size
    out.unlink()
    proc = run_spill("run", "tiny:llama:11", str(prompts), "--out", str(out), *FAST)
    assert proc.returncode == 1, proc.stderr
    error = one_error(proc)
    assert f"{shard} changed since the model entered the cache (sha256 " in error
    assert "spill models verify tiny:llama:11" in error
    assert not out.exists()

    for argv in (["models", "verify", "tiny:llama:11"], ["models", "verify"]):
        proc = run_spill(*argv)
        assert proc.returncode == 1, proc.stderr
        assert "1 changed" in proc.stdout
        named = [ln for ln in proc.stderr.splitlines() if ln.startswith(str(shard))]
        assert len(named) == 1 and "changed since the model entered the cache" in named[0]
        assert proc.stderr.splitlines()[-1] == one_error(proc)

    proc = run_spill("models", "verify", "--json")
    assert proc.returncode == 1
    (row,) = json.loads(proc.stdout)
    assert row["status"] == "1 changed" and row["files"] == len(marker["files"])
    assert row["problems"] == [named[0]]


def test_verify_says_when_a_folder_has_no_recorded_hashes(tmp_path, tiny_models):
    own = shutil.copytree(tiny_models["qwen2"], tmp_path / "own")
    (own / "spill-source.json").unlink()
    proc = run_spill("models", "verify", str(own), "--json")
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(proc.stdout)
    assert row["status"] == "no hashes recorded" and row["files"] == 0
    assert not (own / "spill-source.json").exists()  # nothing invented


def test_models_list_table_with_a_broken_folder_and_a_damaged_record(tmp_path, prompts):
    made = run_spill("run", "tiny:qwen2:5", str(prompts), "--out", str(tmp_path / "o"), *FAST)
    assert made.returncode == 0, made.stderr
    broken = models_dir() / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    (damaged,) = (models_dir() / "tiny").iterdir()
    (damaged / "spill-source.json").write_text('{"files": {"model.safetensors": 3}}')
    before = (damaged / "spill-source.json").read_bytes()

    proc = run_spill("models", "list")
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    header, rule, *rows = proc.stdout.splitlines()
    assert header.split() == ["name", "size", "source", "hashes", "fingerprint", "problem"]
    by_name = {row.split()[0]: row for row in rows}
    assert "no *.safetensors files" in by_name["broken"]
    (tiny_row,) = [r for n, r in by_name.items() if n != "broken"]
    assert "spill-source.json: not a spill model record" in tiny_row
    assert (damaged / "spill-source.json").read_bytes() == before  # never rewritten

    proc = run_spill("run", "tiny:qwen2:5", str(prompts), "--out", str(tmp_path / "o2"), *FAST)
    assert proc.returncode == 1
    assert "not a spill model record" in one_error(proc)  # its hashes are never trusted

    proc = run_spill("models", "list", "--json")
    assert proc.returncode == 0 and len(json.loads(proc.stdout)) == 2


def _tune(model: Path, train: Path, state: Path, **over):
    return run_spill(*kit.tune_argv(model, train, str(state), **over), timeout=kit.TIMEOUT)


def test_a_stopped_tune_continued_after_its_model_changed_names_the_file(tmp_path):
    train = kit.write_train(tmp_path / "train.jsonl")
    model = tmp_path / "model"
    made = run_spill("models", "tiny", str(model), "--seed", "3")
    assert made.returncode == 0, made.stderr
    state = tmp_path / "state"
    first = _tune(model, train, state, stop_after=1)
    assert first.returncode == 0, first.stderr
    ckpt = kit.state_json(str(state), 1)
    assert set(ckpt["model"]["files"]) == {"config.json", "model.safetensors"}

    shard = model / "model.safetensors"
    saved = shard.read_bytes()
    flip(shard, at=0.6)
    proc = _tune(model, train, state)
    assert proc.returncode == 1, proc.stderr
    error = one_error(proc)
    assert f"{shard} changed since the model entered the cache" in error
    assert "same settings" not in error

    # written again with other weights: the folder's record is new, the checkpoint's is not
    shard.write_bytes(saved)
    again = run_spill("models", "tiny", str(model), "--seed", "4")
    assert again.returncode == 0, again.stderr
    proc = _tune(model, train, state)
    assert proc.returncode == 1, proc.stderr
    error = one_error(proc)
    assert "the model's file model.safetensors changed since this run started (sha256 " in error
    assert "restore it, or start fresh with another --state" in error
    assert "same settings" not in error
    assert kit.step_dirs(str(state)) == ["ckpt-g1-s1-0"]


def test_a_row_state_continued_after_its_model_changed_names_the_file(tmp_path, prompts):
    model = tmp_path / "model"
    assert run_spill("models", "tiny", str(model), "--seed", "3").returncode == 0
    state, out = tmp_path / "state", tmp_path / "out.jsonl"
    argv = ["run", str(model), str(prompts), "--out", str(out), "--state", str(state), *FAST]
    first = run_spill(*argv)
    assert first.returncode == 0, first.stderr
    identity = json.loads((state / "rows" / "identity.json").read_text())
    assert set(identity["model"]["files"]) == {"config.json", "model.safetensors"}

    assert run_spill("models", "tiny", str(model), "--seed", "4").returncode == 0
    proc = run_spill(*argv)
    assert proc.returncode == 1, proc.stderr
    error = one_error(proc)
    assert "the model's file model.safetensors changed since this run started (sha256 " in error


def test_a_build_whose_model_changed_stops_naming_the_file(tmp_path):
    """A stopped build continued after a flip fails in one line; the stage reads stopped."""
    from tests.func.test_build import copy_toy

    project = copy_toy(tmp_path / "toy")
    home = {"SPILL_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    first = run_spill("build", str(project), "--stop-after", "tune:2", env=home)
    assert first.returncode == 0, first.stderr
    (shard,) = (tmp_path / "home" / "models" / "tiny").glob("*/model.safetensors")
    flip(shard)
    proc = run_spill("build", str(project), env=home)
    assert proc.returncode == 1, proc.stderr
    assert f"{shard} changed since the model entered the cache" in one_error(proc)
    status = run_spill("status", str(project), "--json", env=home)
    tune = json.loads(status.stdout)["stages"]["tune"]
    assert tune["status"] == "stopped" and tune["progress"] == 2, tune
