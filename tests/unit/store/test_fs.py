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


def _node(path, kind: str) -> None:
    """A FIFO, a folder or a device node made in the test's own folder (never under /dev)."""
    import stat

    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        os.mkdir(path)
    else:  # a character device like /dev/null (1, 3): needs root (CAP_MKNOD)
        try:
            os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        except PermissionError:
            pytest.skip("making a device node needs root")


@pytest.mark.parametrize("kind", ["fifo", "folder", "chardev"])
def test_a_rename_never_replaces_what_is_not_a_regular_file(tmp_path, kind):
    import stat

    target = tmp_path / "node"
    _node(target, kind)
    before = os.lstat(target)
    with pytest.raises(StoreError, match="not a file; spill replaces only regular files"):
        fs.put_bytes(str(target), b"data")
    after = os.lstat(target)
    assert stat.S_IFMT(after.st_mode) == stat.S_IFMT(before.st_mode)
    assert after.st_ino == before.st_ino
    assert os.listdir(tmp_path) == ["node"]  # no temporary left beside it


def test_what_a_killed_local_writer_left_is_removed(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / ".move-12-x").write_bytes(b"half")
    (tmp_path / "a" / "kept").write_bytes(b"whole")
    fs.remove_named(str(tmp_path / "a"), ".move-")
    assert sorted(os.listdir(tmp_path / "a")) == ["b", "kept"]
    fs.prune_empty(str(tmp_path))
    assert sorted(os.listdir(tmp_path / "a")) == ["kept"]  # the emptied folder b went
    fs.remove_named("memory://none/a", ".move-")  # an object store: nothing to do
    fs.prune_empty("memory://none/a")


def test_a_streamed_file_lands_whole_or_not_at_all(tmp_path):
    dst = tmp_path / "d" / "f"
    with pytest.raises(RuntimeError), fs.open_whole(str(dst), ".move-1-") as g:
        g.write(b"half")
        assert os.listdir(tmp_path / "d") == [".move-1-f"]  # beside it, until it is whole
        raise RuntimeError("killed")
    assert os.listdir(tmp_path / "d") == []
    with fs.open_whole(str(dst), ".move-1-") as g:
        g.write(b"whole")
    assert dst.read_bytes() == b"whole" and os.listdir(tmp_path / "d") == ["f"]
    uri = "memory://whole/f"
    with fs.open_whole(uri, ".move-1-") as g:
        g.write(b"up")
    assert fs.get_bytes(uri) == b"up" and fs.listdir("memory://whole") == ["f"]


def test_a_place_failing_is_told_from_a_bug(tmp_path):
    assert fs.failed_there(str(tmp_path), OSError(28, "full"))
    assert not fs.failed_there(str(tmp_path), KeyError("bug"))
    assert fs.failed_there("s3://b/k", KeyError("a backend's own error"))
