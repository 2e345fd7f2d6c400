"""A location seen from this disk: one local file, a local copy of a folder, a folder written
through this disk, a published file."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from spill.store.disk import local_copy, local_folder, put_file, same_file
from spill.store.fs import exists, get_bytes, put_bytes


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


def _export(folder: Path, names: tuple[str, ...]) -> None:
    folder.mkdir()
    for name in names:
        (folder / name).write_bytes(name.encode())


def test_a_local_folder_is_written_in_place_on_a_disk(tmp_path):
    with local_folder(str(tmp_path / "out"), tmp_path / "scratch", last="z") as folder:
        assert folder == tmp_path / "out"
        _export(folder, ("a", "z"))
    assert not (tmp_path / "scratch").exists() and (tmp_path / "out" / "a").read_bytes() == b"a"


def test_a_remote_folder_is_written_through_scratch_its_last_file_put_last(tmp_path, monkeypatch):
    import spill.store.disk as disk

    put, order = disk.put_bytes, []
    monkeypatch.setattr(disk, "put_bytes", lambda uri, data: (order.append(uri), put(uri, data)))
    uri = f"memory://disk-{uuid.uuid4().hex[:8]}/out"
    with local_folder(uri, tmp_path / "scratch", last="a.json") as folder:
        assert folder == tmp_path / "scratch"
        _export(folder, ("a.json", "b", "c"))
    assert order == [f"{uri}/b", f"{uri}/c", f"{uri}/a.json"]
    assert get_bytes(f"{uri}/b") == b"b" and not (tmp_path / "scratch").exists()


def test_a_block_that_raises_puts_nothing(tmp_path):
    uri = f"memory://disk-{uuid.uuid4().hex[:8]}/out"
    with pytest.raises(RuntimeError), local_folder(uri, tmp_path / "s", last="a") as folder:
        _export(folder, ("a",))
        raise RuntimeError("killed")
    assert not exists(f"{uri}/a")
