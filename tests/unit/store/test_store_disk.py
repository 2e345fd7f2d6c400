"""A location seen from this disk: one local file, a local copy of a folder, a published file."""

from __future__ import annotations

import uuid

from spill.store.disk import local_copy, put_file, same_file
from spill.store.fs import get_bytes, put_bytes


def test_same_file_is_one_local_file_never_an_object_stores(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    (tmp_path / "link").symlink_to(tmp_path / "f")
    assert same_file(tmp_path / "f", str(tmp_path / "link"))
    assert same_file(f"file://{tmp_path}/f", tmp_path / "f")
    assert same_file(tmp_path / "new", tmp_path / "new")  # not there yet: by its path
    assert not same_file(tmp_path / "f", tmp_path / "g")
    assert not same_file("memory://b/f", "memory://b/f")


def test_a_local_folder_is_itself_a_remote_ones_files_are_copied(tmp_path):
    (tmp_path / "a").mkdir()
    assert local_copy(str(tmp_path / "a"), ("x",)) == tmp_path / "a"
    uri = f"memory://disk-{uuid.uuid4().hex[:8]}/a"
    put_bytes(f"{uri}/x", b"1")
    put_bytes(f"{uri}/y", b"2")
    got = local_copy(uri, ("x",), tmp_path / "copy")
    assert got == tmp_path / "copy" and sorted(p.name for p in got.iterdir()) == ["x"]
    assert (got / "x").read_bytes() == b"1"
    assert (local_copy(uri, ("y",)) / "y").read_bytes() == b"2"  # a new temporary folder


def test_a_file_is_published_unless_it_is_there_already(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"mine")
    put_file(f, str(f))  # the same file: nothing written
    assert f.read_bytes() == b"mine" and sorted(p.name for p in tmp_path.iterdir()) == ["f"]
    put_file(f, str(tmp_path / "g"))
    uri = f"memory://disk-{uuid.uuid4().hex[:8]}/files/f"
    put_file(f, uri)
    assert (tmp_path / "g").read_bytes() == b"mine" and get_bytes(uri) == b"mine"
