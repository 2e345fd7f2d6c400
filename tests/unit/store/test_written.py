"""store.written: once ``drop_written`` is called, a durable write leaves none of its file's
pages in the page cache (counted with mincore(2) on the written file); by default it leaves
them there."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore(2), posix_fadvise")
@pytest.mark.parametrize("how, cached", [("keep", True), ("drop", False)])
def test_a_synced_file_leaves_the_cache_only_when_asked(tmp_path, how, cached):
    code = (
        "import ctypes, mmap, os, sys\n"
        "from spill.store import fs, written\n"
        "if sys.argv[2] == 'drop':\n"
        "    written.drop_written()\n"
        "fs.put_bytes(sys.argv[1], os.urandom(16 << 20))\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.mmap.restype = ctypes.c_void_p\n"
        "libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,"
        " ctypes.c_int, ctypes.c_long]\n"
        "libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]\n"
        "size, page = os.path.getsize(sys.argv[1]), mmap.PAGESIZE\n"
        "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
        "at = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)\n"
        "vec = ctypes.create_string_buffer((size + page - 1) // page)\n"
        "assert libc.mincore(at, size, vec) == 0, ctypes.get_errno()\n"
        "print(sum(b & 1 for b in vec.raw), len(vec.raw))\n"
    )
    path = tmp_path / "f.bin"
    out = subprocess.run(
        [sys.executable, "-c", code, str(path), how], capture_output=True, text=True, check=True
    )
    resident, pages = map(int, out.stdout.split())
    if cached:
        assert resident > pages // 2, (resident, pages)
    else:
        assert resident == 0, (resident, pages)
