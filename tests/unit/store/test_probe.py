"""Probes of a location before anything is written there (``spill.store.probe``), and how a
location's name is read (``spill.store.fs``: schemes, ``file://``)."""

from __future__ import annotations

import os

import pytest

from spill.errors import StoreError
from spill.store import fs, probe


def test_only_the_stores_spill_keeps_runs_on_are_made_and_nothing_connects():
    for uri in ("ftp://host.invalid/x", "http://host.invalid/x", "sftp://h/x", "nosuch://b/x"):
        with pytest.raises(StoreError) as e:
            fs.exists(uri)  # ftp:// would try to resolve the host: refused before
        scheme = uri.split("://")[0]
        assert str(e.value) == (
            f"{uri}: unsupported location ({scheme}:// is not a store spill keeps runs on); use "
            "a local path, s3://, gs://, az:// or memory://"
        )
    assert not fs.exists("memory://spill-probe-test/nothing")


def test_a_file_uri_is_the_absolute_path_it_names(tmp_path, monkeypatch):
    assert fs._local(f"file://{tmp_path}/x") == f"{tmp_path}/x"
    assert fs._local(f"file://localhost{tmp_path}/x") == f"{tmp_path}/x"
    assert fs.absolute(f"file://{tmp_path}/x/") == f"{tmp_path}/x"
    assert fs.absolute("s3://b/p/") == "s3://b/p"
    monkeypatch.chdir(tmp_path)
    assert fs.absolute("rel/x") == f"{tmp_path}/rel/x"
    with pytest.raises(StoreError) as e:
        fs._local("file://otherhost/x")
    assert str(e.value) == (
        "file://otherhost/x: a file:// URI names an absolute local path (file:///path); give the "
        "path itself"
    )


def test_a_file_or_a_folder_below_one_is_no_destination(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    probe.not_a_file(str(tmp_path / "new" / "deeper"))  # missing is fine
    with pytest.raises(StoreError, match=f"^{f} is a file; move to a new or empty folder$"):
        probe.not_a_file(str(f))
    with pytest.raises(StoreError, match=f"lies under {f}, which is a file"):
        probe.not_a_file(str(f / "sub"))


def test_names_too_long_are_refused_without_writing(tmp_path):
    with pytest.raises(StoreError) as e:
        probe.check_names(str(tmp_path / ("a" * 256)))
    assert "is 256 bytes long, and this file system takes at most 255" in str(e.value)
    with pytest.raises(StoreError) as e:
        probe.check_names(str(tmp_path / "ok"), ["x/" + "b" * 300])
    assert "is 300 bytes long" in str(e.value)
    deep = str(tmp_path) + "/c" * 2100
    with pytest.raises(StoreError, match="the path is .* bytes long, and this file system takes"):
        probe.check_names(deep)
    with pytest.raises(StoreError, match="is 1025 bytes long, and an object store key takes"):
        probe.check_names("s3://bucket/p", ["k" * 1023])  # "p/" + 1023 bytes
    probe.check_names("s3://bucket/p", ["k" * 1022])
    assert os.listdir(tmp_path) == []


def test_the_longest_path_is_probed_by_a_write_and_the_probe_leaves_nothing(tmp_path):
    root = tmp_path / "dst"
    probe.probe_names(str(root), ["a/b/c.bin", "spill.yaml"])
    assert os.listdir(tmp_path) == []  # the folders it made are gone with it
    (tmp_path / "keep").mkdir()
    probe.probe_names(str(tmp_path / "keep"), ["x/y.bin"])
    assert os.listdir(tmp_path / "keep") == []
    left = 4095 - 20 - len(str(root))
    segs = ["d" * 200] * (left // 201)
    with pytest.raises(StoreError) as e:
        probe.probe_names(str(root), ["/".join(segs) + "/" + "e" * (left % 201 + 30)])
    assert "bytes long there, longer than this file system takes" in str(e.value)
    assert os.listdir(tmp_path) == ["keep"]
    os.chmod(tmp_path / "keep", 0o500)
    try:
        if os.geteuid() != 0:  # root writes anywhere
            with pytest.raises(StoreError, match="cannot be written"):
                probe.probe_names(str(tmp_path / "keep" / "d"), ["f"])
    finally:
        os.chmod(tmp_path / "keep", 0o700)


def test_free_space_is_told_locally_only(tmp_path):
    free, block = probe.space(str(tmp_path / "not" / "yet"))
    assert free > 0 and block > 0
    assert probe.space("s3://bucket/p") is None


def test_a_copys_temporary_names_are_probed_on_a_disk_only(tmp_path):
    passing = [".move-1-" + "t" * 250]  # longer than this file system takes; its file is not
    probe.probe_names("memory://bucket/p", ["f"], passing)  # an object store makes none
    with pytest.raises(StoreError, match="bytes long, and this file system takes at most 255"):
        probe.probe_names(str(tmp_path / "d"), ["f"], passing)
    assert os.listdir(tmp_path) == []
