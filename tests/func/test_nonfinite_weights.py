"""A float model whose large matrices hold NaN or inf (issue 35 item 17): found in the pass that
hashes each file (``spill.models.scan``) and refused in one line naming the file and the tensor,
through the real CLI: ``spill run``, ``spill tune`` and ``spill models verify`` on a folder
without records (hashed for its fingerprint), a job start re-hashing a file an older spill
recorded without looking, and ``spill models import`` of a GGUF whose norm weights are NaN.
Every poisoned file is made here: a tiny model rewritten with one element changed."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from spill.ground.paths import models_dir
from spill.store.safetensors_io import (
    bf16_bits_to_float32,
    float32_to_bf16_bits,
    read_header,
    write_file,
)
from tests.conftest import run_spill
from tests.func import tune_kit as kit
from tests.func.test_model_integrity import FAST, one_error
from tests.unit.models.gguf import gguf_bytes as gb

SHARD = "model.safetensors"


def poison(folder: Path, dtype: str, tensor: str, value: float) -> None:
    """Rewrite the folder's shard in ``dtype`` (F32 or BF16) with one element of ``tensor`` set
    to ``value``; its record (the marker) is dropped: a user's own folder."""
    path = folder / SHARD
    raw = path.read_bytes()
    start = 8 + struct.unpack("<Q", raw[:8])[0]
    tensors = {}
    for name, info in read_header(path).items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        assert info["dtype"] == "BF16"  # what spill's tiny models hold
        bits = np.frombuffer(raw[start + a : start + b], "<u2").reshape(info["shape"])
        w = bf16_bits_to_float32(bits)
        if name == tensor:
            w.reshape(-1)[w.size // 2 + 1] = value
        tensors[name] = ("BF16", float32_to_bf16_bits(w)) if dtype == "BF16" else ("F32", w)
    write_file(path, tensors)
    (folder / "spill-source.json").unlink(missing_ok=True)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


@pytest.mark.parametrize(
    "dtype, tensor, value",
    [
        ("F32", "model.embed_tokens.weight", float("nan")),
        ("BF16", "model.layers.2.mlp.down_proj.weight", float("inf")),
        ("F32", "model.layers.1.self_attn.q_proj.weight", float("-inf")),
    ],
)
def test_run_tune_and_verify_refuse_a_poisoned_matrix_naming_it(
    tmp_path, tiny_models, dtype, tensor, value
):
    folder = shutil.copytree(tiny_models["llama"], tmp_path / "model")
    poison(folder, dtype, tensor, value)
    before = snapshot(folder)
    want = f"{folder / SHARD}: {tensor} holds NaN or inf"
    prompts, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    prompts.write_text('{"id": 1, "prompt": "hello"}\n')

    proc = run_spill("run", str(folder), str(prompts), "--out", str(out), *FAST)
    assert proc.returncode == 1, proc.stderr
    assert want in one_error(proc)
    assert not out.exists()

    train, state = kit.write_train(tmp_path / "train.jsonl"), tmp_path / "state"
    proc = run_spill(*kit.tune_argv(folder, train, str(state), steps=2), timeout=kit.TIMEOUT)
    assert proc.returncode == 1, proc.stderr
    assert want in one_error(proc)
    assert not list(state.glob("payloads/*"))

    proc = run_spill("models", "verify", str(folder))
    assert proc.returncode == 1, proc.stderr
    assert one_error(proc) and [ln for ln in proc.stderr.splitlines() if ln.startswith(want)]
    assert snapshot(folder) == before  # nothing recorded, nothing cached, nothing rewritten


def test_a_file_an_older_spill_recorded_is_refused_when_a_job_start_hashes_it(
    tmp_path, tiny_models
):
    """Its sha256 matches its record (an older spill recorded it without looking): a job start
    re-hashes it (no verified stat key) and refuses it; verify names it as not finite."""
    folder = shutil.copytree(tiny_models["llama"], tmp_path / "model")
    poison(folder, "BF16", "model.layers.0.mlp.up_proj.weight", float("nan"))
    files = {
        p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in folder.iterdir()
    }
    marker = {"schema_version": 1, "source": "tiny", "files": files, "verified": {}}
    (folder / "spill-source.json").write_text(json.dumps(marker))
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"id": 1, "prompt": "hello"}\n')
    want = f"{folder / SHARD}: model.layers.0.mlp.up_proj.weight holds NaN or inf"

    proc = run_spill("run", str(folder), str(prompts), "--out", str(tmp_path / "o"), *FAST)
    assert proc.returncode == 1, proc.stderr
    assert want in one_error(proc)
    proc = run_spill("models", "verify", str(folder), "--json")
    assert proc.returncode == 1, proc.stderr
    (row,) = json.loads(proc.stdout)
    assert row["status"] == "1 not finite" and row["problems"][0].startswith(want)
    assert json.loads((folder / "spill-source.json").read_text()) == marker  # never trusted


def test_a_gguf_whose_norm_weights_are_nan_is_refused_at_import(tmp_path):
    rng = np.random.default_rng(0)
    table, data = [], b""
    for name, shape in gb.small_tensors():
        w = rng.normal(0, 1, size=shape).astype("<f4")
        if name == "blk.0.ffn_norm.weight":
            w[3] = np.nan
        table.append((name, shape, gb.GGML_F32, len(data)))
        data += w.tobytes() + b"\0" * (-w.nbytes % 32)
    path = gb.write_gguf(tmp_path / "poisoned.gguf", gb.small_metadata(), table, data)

    proc = run_spill("models", "import", str(path))
    assert proc.returncode == 1, proc.stderr
    error = one_error(proc)
    assert "model.safetensors: model.layers.0.post_attention_layernorm.weight holds NaN or" in error
    assert not models_dir().exists() or not [
        p for p in models_dir().rglob("*") if p.is_file()
    ]  # no folder, no partial import left
