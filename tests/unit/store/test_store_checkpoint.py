"""Tune checkpoints: exact roundtrip on every backend, COMMIT semantics, keep-two."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from spill.store import fs
from spill.store.checkpoint import (
    CheckpointInvalid,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    step_dir,
)
from spill.store.schemas import SchemaInvalid


def steps_on_disk(root: str) -> list[str]:
    return fs.listdir(fs.join(root, "ckpt"))


def assert_exact(loaded, expected) -> None:
    params, opt, state = expected
    assert list(loaded.params) == sorted(params) and list(loaded.opt) == sorted(opt)
    for got, want in ((loaded.params, params), (loaded.opt, opt)):
        for name, a in want.items():
            assert got[name].dtype == np.float32 and np.array_equal(got[name], a), name
    assert {k: v for k, v in loaded.state.items() if k != "schema_version"} == state


def test_roundtrip_is_exact(root, data):
    assert latest_checkpoint(root) is None
    uri = save_checkpoint(root, 7, *data(7))
    assert uri == step_dir(root, 7)
    assert sorted(fs.listdir(uri)) == [
        "COMMIT",
        "opt.safetensors",
        "params.safetensors",
        "state.json",
    ]
    ckpt = latest_checkpoint(root)
    assert ckpt is not None and ckpt.step == 7 and ckpt.uri == uri
    assert_exact(load_checkpoint(ckpt), data(7))
    assert_exact(load_checkpoint(ckpt), data(7))  # a second load reads the store again
    assert_exact(load_checkpoint(uri), data(7))


def test_bytes_are_deterministic(tmp_path, data):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    params, opt, state = data(2)
    save_checkpoint(a, 2, params, opt, state)
    save_checkpoint(b, 2, dict(reversed(params.items())), dict(reversed(opt.items())), state)
    for name in ("params.safetensors", "opt.safetensors", "state.json", "COMMIT"):
        assert fs.get_bytes(fs.join(step_dir(a, 2), name)) == fs.get_bytes(
            fs.join(step_dir(b, 2), name)
        )
    commit = json.loads(fs.get_bytes(fs.join(step_dir(a, 2), "COMMIT")))
    assert commit["schema_version"] == 1 and set(commit["files"]) == {
        "params.safetensors",
        "opt.safetensors",
        "state.json",
    }


def test_keeps_the_two_newest(root, data):
    for step in (1, 2, 3, 4):
        save_checkpoint(root, step, *data(step))
    assert steps_on_disk(root) == ["step-3", "step-4"]
    assert latest_checkpoint(root).step == 4


def test_uncommitted_dir_is_ignored_then_removed_by_next_save(root, data, caplog):
    save_checkpoint(root, 1, *data(1))
    save_checkpoint(root, 2, *data(2))
    fs.remove(fs.join(step_dir(root, 2), "COMMIT"))  # as if the writer died before COMMIT
    with caplog.at_level(logging.WARNING, logger="spill.store.checkpoint"):
        ckpt = latest_checkpoint(root)
    assert ckpt.step == 1
    [line] = [r.getMessage() for r in caplog.records]
    assert "step-2" in line and "no COMMIT" in line and "next save removes it" in line
    save_checkpoint(root, 3, *data(3))
    assert steps_on_disk(root) == ["step-1", "step-3"]


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_file_is_ignored_with_a_message_then_removed(tmp_path, data, caplog, damage):
    root = str(tmp_path / "state")
    for step in (1, 2):
        save_checkpoint(root, step, *data(step))
    victim = fs.join(step_dir(root, 2), "opt.safetensors")
    blob = bytearray(fs.get_bytes(victim))
    if damage == "truncate":
        del blob[-4:]
    else:
        blob[-1] ^= 0xFF
    fs.put_bytes(victim, bytes(blob))
    with caplog.at_level(logging.WARNING, logger="spill.store.checkpoint"):
        assert latest_checkpoint(root).step == 1
    [line] = [r.getMessage() for r in caplog.records]
    assert "step-2" in line and "opt.safetensors" in line
    assert ("bytes, COMMIT says" if damage == "truncate" else "sha256") in line
    with pytest.raises(CheckpointInvalid):
        load_checkpoint(step_dir(root, 2))
    save_checkpoint(root, 3, *data(3))
    assert steps_on_disk(root) == ["step-1", "step-3"]


def test_damaged_state_or_commit_is_not_trusted(tmp_path, data):
    root = str(tmp_path / "state")
    save_checkpoint(root, 1, *data(1))
    save_checkpoint(root, 2, *data(2))
    fs.put_bytes(fs.join(step_dir(root, 2), "COMMIT"), b'{"schema_version": 1}')
    assert latest_checkpoint(root).step == 1


def test_resaving_the_same_step_is_a_no_op(tmp_path, data):
    root = str(tmp_path / "state")
    save_checkpoint(root, 1, *data(1))
    save_checkpoint(root, 2, *data(2))
    before = fs.get_bytes(fs.join(step_dir(root, 2), "COMMIT"))
    save_checkpoint(root, 2, *data(2))
    assert fs.get_bytes(fs.join(step_dir(root, 2), "COMMIT")) == before
    assert steps_on_disk(root) == ["step-1", "step-2"]


def test_newer_committed_checkpoint_is_never_deleted(tmp_path, data):
    root = str(tmp_path / "state")
    for step in (5, 6):
        save_checkpoint(root, step, *data(step))
    save_checkpoint(root, 2, *data(2))
    assert steps_on_disk(root) == ["step-2", "step-5", "step-6"]


def test_bad_inputs_are_refused_before_writing(tmp_path, data):
    root = str(tmp_path / "state")
    params, opt, state = data(1)
    with pytest.raises(ValueError, match="float32"):
        save_checkpoint(root, 1, {**params, "x": np.zeros(2, np.float64)}, opt, state)
    with pytest.raises(ValueError, match="m::<param>"):
        save_checkpoint(root, 1, params, {**opt, "w::x": np.zeros(2, np.float32)}, state)
    with pytest.raises(ValueError, match="step 1"):
        save_checkpoint(root, 2, params, opt, state)
    with pytest.raises(SchemaInvalid, match="cursor"):
        save_checkpoint(root, 1, params, opt, {**state, "cursor": -1})
    assert not fs.exists(root)
