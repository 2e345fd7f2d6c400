"""Weights that would compute wrong numbers, through the real CLI (issue 35 items 17, 18, 21).

Each hostile folder is the tiny llama's 4-bit group-32 copy (``spill models quantize``'s
layout) with one tensor rewritten here: a packed weight short by a row or a column, scales short
by a column, biases missing, a float weight beside its own scales and biases, NaN or inf scales,
biases or norm weights. ``spill run`` and ``spill tune`` refuse each in one line naming the file
and the tensor (exit 1), write no output, commit no checkpoint and publish no adapter; the model
folder is left as it was. A tune whose loss stops being finite stops at that step in one line,
its newest good checkpoint current and nothing published, on both engines.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import run_spill
from tests.func import tune_kit as kit

ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
MODULE = "model.layers.2.mlp.down_proj"  # (64, 160) float: weight (64, 20), groups (64, 5)
NORM = "model.layers.1.input_layernorm.weight"
MLX = pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="MLX is not installed")


def _short_row(t):
    t[f"{MODULE}.weight"] = t[f"{MODULE}.weight"][:-1].clone()
    return f"{MODULE}.weight"


def _short_column(t):
    t[f"{MODULE}.weight"] = t[f"{MODULE}.weight"][:, :-1].clone()
    return f"{MODULE}.weight"


def _scales_short(t):
    t[f"{MODULE}.scales"] = t[f"{MODULE}.scales"][:, :-1].clone()
    return f"{MODULE}.scales"


def _no_biases(t):
    del t[f"{MODULE}.biases"]
    return f"{MODULE}.biases"


def _float_weight(t):  # the module's float form beside its packed scales and biases
    t[f"{MODULE}.weight"] = torch.randn(64, 160, generator=torch.Generator().manual_seed(0))
    return f"{MODULE}.weight"


def _float_words(t):  # float32 of the packed weight's own shape: same bytes per row
    t[f"{MODULE}.weight"] = t[f"{MODULE}.weight"].view(torch.float32).clone()
    return f"{MODULE}.weight"


def _nan_scales(t):
    t[f"{MODULE}.scales"][5, 1] = float("nan")
    return f"{MODULE}.scales"


def _inf_biases(t):
    t[f"{MODULE}.biases"][0, 0] = float("-inf")
    return f"{MODULE}.biases"


def _nan_norm(t):
    t[NORM][3] = float("nan")
    return NORM


SHAPES = {"short-row": _short_row, "short-column": _short_column, "scales-short": _scales_short}
SHAPES |= {"no-biases": _no_biases}
FORMS = {"float-weight": _float_weight, "float-words": _float_words}
VALUES = {"nan-scales": _nan_scales, "inf-biases": _inf_biases, "nan-norm": _nan_norm}
HOSTILE = SHAPES | FORMS | VALUES
WORDS = {"nan-scales": "NaN or inf", "inf-biases": "NaN or inf", "nan-norm": "NaN or inf"}
WORDS |= {"float-weight": "F32 beside its own scales and biases"}
WORDS |= {"float-words": "F32 beside its own scales and biases", "no-biases": "is missing"}


@pytest.fixture(scope="module")
def packed(tiny_models, tmp_path_factory) -> Path:
    return kit.quantized_tiny(tiny_models, tmp_path_factory.mktemp("hostile") / "q4g32")


def _hostile(packed: Path, dest: Path, kind: str) -> tuple[Path, str]:
    """A copy of ``packed`` with one tensor rewritten by ``HOSTILE[kind]``; (folder, its name)."""
    shutil.copytree(packed, dest)
    tensors = load_file(dest / "model.safetensors")
    name = HOSTILE[kind](tensors)
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return dest, name


def _digest(folder: Path) -> dict[str, str]:
    """sha256 of the model's files (not the marker a run keeps its fingerprint in)."""
    files = [p for p in sorted(folder.iterdir()) if p.name != "spill-source.json"]
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _refused(done: subprocess.CompletedProcess) -> str:
    """The one error line of a refused run: exit 1, no traceback, the error last on stderr."""
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("spill: error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], done.stderr
    return errors[0]


def _run(model: Path, tmp_path: Path, engine: str, *extra: str) -> tuple[str, Path]:
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": 1, "prompt": "one two"}) + "\n")
    out = tmp_path / "out.jsonl"
    done = run_spill(
        "run", str(model), str(rows), "--out", str(out), "--engine", engine, "--dtype", "float32",
        "--max-new-tokens", "3", *extra, env=ENV, timeout=120,
    )  # fmt: skip
    return _refused(done), out


@pytest.mark.parametrize("kind", HOSTILE)
def test_run_refuses_a_hostile_packed_folder_in_one_line(packed, tmp_path, kind):
    model, name = _hostile(packed, tmp_path / "model", kind)
    before = _digest(model)
    line, out = _run(model, tmp_path, "torch", "--ring", "2")
    assert f"{model / 'model.safetensors'}: {name} " in line, line
    assert WORDS.get(kind, "config.json make") in line, line
    assert not out.exists() and _digest(model) == before


@MLX
@pytest.mark.parametrize("kind", ["short-column", "scales-short", "float-words", "inf-biases"])
def test_the_mlx_engine_refuses_them_alike(packed, tmp_path, kind):
    model, name = _hostile(packed, tmp_path / "model", kind)
    line, out = _run(model, tmp_path, "mlx", "--ring", "2")
    assert f"{model / 'model.safetensors'}: {name} " in line and not out.exists(), line


def test_a_resident_run_refuses_nan_scales_before_its_pre_run_line(packed, tmp_path):
    model, name = _hostile(packed, tmp_path / "model", "nan-scales")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": 1, "prompt": "one"}) + "\n")
    done = run_spill(
        "run", str(model), str(rows), "--out", str(tmp_path / "o.jsonl"), "--resident",
        env=ENV, timeout=120,
    )  # fmt: skip
    assert _refused(done) == done.stderr.strip()  # the only line: refused as it loaded
    assert name in done.stderr


@pytest.mark.parametrize("kind", ["short-row", "no-biases", "float-weight", "nan-scales"])
def test_tune_refuses_a_hostile_packed_folder_before_any_step(packed, tmp_path, kind):
    model, name = _hostile(packed, tmp_path / "model", kind)
    before = _digest(model)
    train = kit.write_train(tmp_path / "train.jsonl")
    state = tmp_path / "state"
    done = kit.run_tune(kit.tune_argv(model, train, str(state)), kit.spill_env(tmp_path / "home"))
    assert name in _refused(done)
    assert kit.latest_step(str(state)) is None and not (state / "adapter").exists()
    assert _digest(model) == before


@pytest.mark.parametrize("engine", ["torch", pytest.param("mlx", marks=MLX)])
def test_a_loss_that_is_not_finite_stops_the_tune_at_its_step(tiny_models, tmp_path, engine):
    # an absurd learning rate: step 1 moves the adapter's B to ~1e37, step 2's forward overflows
    train = kit.write_train(tmp_path / "train.jsonl")
    state = str(tmp_path / "state")
    argv = kit.tune_argv(
        tiny_models["llama"], train, state, steps=4, ckpt_every=1, lr=1e37, engine=engine
    )
    done = kit.run_tune(argv, kit.spill_env(tmp_path / "home"))
    line = _refused(done)
    assert line.startswith("spill: error: step ") and "of 4: the loss is nan" in line, line
    failed = int(line.split()[3])
    assert failed >= 2, line  # a later step: a good checkpoint came before it
    assert kit.latest_step(state) == failed - 1  # the newest good one stays current
    assert kit.committed_steps(state)[-1] == failed - 1
    assert not (tmp_path / "state" / "adapter").exists()  # nothing published
