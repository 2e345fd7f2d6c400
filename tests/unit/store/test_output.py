"""What a person names as an output (``put_output``): written into a FIFO or a character device
as it is, through a link into the link's target, never over a folder."""

from __future__ import annotations

import os

import pytest

from spill.errors import StoreError
from spill.store.output import put_output
from tests.unit.store.test_fs import _node


def test_an_output_is_written_into_a_fifo_and_a_character_device(tmp_path):
    import stat
    import threading

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    put_output(str(fifo), b"line 1\nline 2\n")
    reader.join(timeout=30)
    assert got == [b"line 1\nline 2\n"] and stat.S_ISFIFO(os.lstat(fifo).st_mode)
    null = tmp_path / "null"
    _node(null, "chardev")
    put_output(str(null), b"gone")
    assert stat.S_ISCHR(os.lstat(null).st_mode) and sorted(os.listdir(tmp_path)) == ["null", "pipe"]


def test_an_output_through_a_link_replaces_its_target_and_keeps_the_link(tmp_path):
    (tmp_path / "real.jsonl").write_bytes(b"old")
    os.symlink("real.jsonl", tmp_path / "link.jsonl")
    put_output(str(tmp_path / "link.jsonl"), b"new")
    assert os.readlink(tmp_path / "link.jsonl") == "real.jsonl"
    assert (tmp_path / "real.jsonl").read_bytes() == b"new"
    with pytest.raises(StoreError, match="is a folder, not a file"):
        put_output(str(tmp_path), b"x")
