"""Byte access to a state URI: atomic local writes, and the same calls on every backend."""

from __future__ import annotations

import importlib.util
import os

import pytest

from spill.errors import StoreError
from spill.store import fs


def test_atomic_local_write_leaves_no_temp_litter(tmp_path):
    target = tmp_path / "a" / "b" / "file.bin"
    fs.put_bytes(str(target), b"one")
    fs.put_bytes(str(target), b"two")  # replace
    assert target.read_bytes() == b"two"
    assert os.listdir(target.parent) == ["file.bin"]
    assert fs.get_bytes(f"file://{target}") == b"two"


def test_failed_local_write_keeps_old_content_and_removes_temp(tmp_path):
    from spill.store import drill

    target = tmp_path / "f.json"
    fs.put_bytes(str(target), b"old")

    def boom(boundary):
        raise RuntimeError(boundary)

    with drill.hooked(boom), pytest.raises(RuntimeError, match="put-before-rename"):
        fs.put_bytes(str(target), b"new")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["f.json"]


def test_calls_on_every_backend(root):
    assert fs.listdir(root) == [] and not fs.exists(root)
    fs.put_bytes(fs.join(root, "d", "x.txt"), b"x")
    fs.put_bytes(fs.join(root, "d", "y.txt"), b"yy")
    fs.put_bytes(fs.join(root, "top.txt"), b"t")
    assert fs.listdir(root) == ["d", "top.txt"]
    assert fs.listdir(fs.join(root, "d")) == ["x.txt", "y.txt"]
    assert fs.get_bytes(fs.join(root, "d", "y.txt")) == b"yy"
    assert fs.exists(fs.join(root, "d")) and fs.exists(fs.join(root, "d", "x.txt"))
    with pytest.raises(FileNotFoundError):
        fs.get_bytes(fs.join(root, "nope"))
    fs.remove(fs.join(root, "d", "x.txt"))
    fs.remove(fs.join(root, "nope"))  # missing is fine
    assert fs.listdir(fs.join(root, "d")) == ["y.txt"]
    fs.remove(fs.join(root, "d"))
    assert not fs.exists(fs.join(root, "d", "y.txt"))
    assert "d" not in fs.listdir(root)


@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None, reason="gcsfs is installed")
def test_missing_cloud_backend_says_what_to_install():
    with pytest.raises(fs.BackendMissing) as e:
        fs.get_bytes("gs://bucket/state/x")
    msg = str(e.value)
    assert "\n" not in msg and 'pip install "streamweights[cloud]"' in msg and "gs://" in msg


def test_unknown_scheme_is_one_line():
    with pytest.raises(StoreError, match="unsupported location"):
        fs.exists("nosuch://bucket/x")


def test_helpers():
    assert fs.join("s3://b/p/", "payloads", "ckpt-g1-s1-0") == "s3://b/p/payloads/ckpt-g1-s1-0"
    assert fs.is_local("/tmp/x") and fs.is_local("file:///tmp/x") and not fs.is_local("memory://x")
    assert fs.is_temp(".COMMIT.tmp-0123abcd") and not fs.is_temp("COMMIT")
