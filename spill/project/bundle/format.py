"""The bundle file format: an uncompressed POSIX tar whose first entry is the manifest
(``spill-bundle.json``, schema ``bundle``), then ``project/<path>``, ``state/<path>`` (with
--with-state) and ``models/<folder>/<file>`` (the layout: the comment at ``MANIFEST``).

Entries are written here, not by ``tarfile``, and never extracted by it: the reader takes only the
member list and writes regular files to paths it checked itself. Why the manifest comes first, and
how the copy and hash overlap: docs/bundle.md.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import sys
import tarfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO

from spill.errors import SpillError

FORMAT = 1  # the manifest's schema_version this spill writes and reads
KIND = "spill-bundle"
# Layout (every name ``/``-separated, relative):
#   spill-bundle.json              the manifest (schema ``bundle``), always first
#   project/<path>                 the project folder's files (spill.yaml, data, conf groups)
#   state/<path>                   with --with-state: the run's files, relative to its state
#   models/<folder>/<file>         model files, ``<folder>`` relative to SPILL_HOME/models
MANIFEST = "spill-bundle.json"
ROLES = ("project", "state", "model")
PREFIX = {"project": "project/", "state": "state/", "model": "models/"}
# one piece of a copy: its writeback starts, its hash is taken; measured (report 007) on 541 MB:
# install 0.44 s with 1-4 MB pieces, 0.49 s with 16 MB, 0.64 s with 32 MB (read back from L2/L3)
CHUNK = 4 << 20
_SYNC_FILE_RANGE_WRITE = 2
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF}
BLOCK = tarfile.BLOCKSIZE
RECORD = tarfile.RECORDSIZE
MAX_MANIFEST = 64 << 20
# Limits on what a bundle may hold, checked before anything is written: a real project is a few
# files, its run a few hundred (checkpoints, row segments), its models a few dozen; 70B in bf16 is
# 141 GB. A name segment longer than 255 bytes cannot be created on common file systems, and a
# path deeper than MAX_DEPTH is no project's.
MAX_ENTRIES = 20_000
MAX_BYTES = 1 << 40  # 1 TiB
MAX_NAME = 255  # bytes of one path segment (UTF-8)
MAX_DEPTH = 32  # segments of one path
_SEGMENT = re.compile(r"^[^/\\\x00-\x1f]+$")


class BundleError(SpillError):
    """A bundle that cannot be written, or one that is damaged, unsafe or from a newer spill."""


def bad_path(rel: str) -> str:
    """Why ``rel`` may not name a file in a bundle (``""`` when it may): it must be relative,
    ``/``-separated, without ``.``/``..``/hidden segments, backslashes or control characters,
    and no longer or deeper than a file system (and the limits above) allow."""
    if not rel or rel.startswith("/"):
        return "an absolute or empty path"
    if len(rel.encode("utf-8", "surrogateescape")) > 4096:
        return "a path longer than 4096 bytes"
    segments = rel.split("/")
    if len(segments) > MAX_DEPTH:
        return f"a path {len(segments) - 1} folders deep (at most {MAX_DEPTH - 1})"
    for seg in segments:
        if seg in ("", ".", ".."):
            return "a path with an empty, '.' or '..' part"
        if not _SEGMENT.match(seg):
            return "a path with a backslash or a control character"
        if seg.startswith("."):
            return "a hidden name"
        if len(seg.encode("utf-8", "surrogateescape")) > MAX_NAME:
            return f"a path with a name longer than {MAX_NAME} bytes"
    return ""


def header(name: str, size: int) -> bytes:
    """A regular file's tar header: no owner names, ids, times or modes of the writing machine."""
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime, info.type = size, 0o644, 0, tarfile.REGTYPE
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def padding(size: int) -> bytes:
    return b"\0" * (-size % BLOCK)


def trailer(written: int) -> bytes:
    """Two zero blocks, then zeros up to a whole tar record (what ``tar`` itself writes)."""
    end = written + 2 * BLOCK
    return b"\0" * (2 * BLOCK + (-end % RECORD))


_writeback_call: Any = None  # libc's sync_file_range once looked up; False: there is none


def start_writeback(fd: int, offset: int, size: int) -> None:
    """Ask the kernel to start writing ``size`` bytes of ``fd`` at ``offset`` to disk now,
    without waiting (``sync_file_range(..., SYNC_FILE_RANGE_WRITE)``); a no-op where there is no
    such call. Durability still comes from the fsync that follows: this only makes it short."""
    global _writeback_call
    if _writeback_call is None:
        _writeback_call = False
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                call = ctypes.CDLL(None, use_errno=True).sync_file_range
                call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
                _writeback_call = call
            except (OSError, AttributeError):
                pass
    if _writeback_call and size > 0:
        _writeback_call(fd, offset, size, _SYNC_FILE_RANGE_WRITE)  # an error: fsync reports it


def _kernel_copy(src: int, dst: int, size: int, src_offset: int | None) -> int | None:
    """One ``copy_file_range`` of up to ``size`` bytes into ``dst`` at its position (None: the
    kernel cannot copy between these two files, so the caller copies through a buffer)."""
    try:
        return os.copy_file_range(src, dst, size, src_offset)
    except (OSError, AttributeError, ValueError) as e:
        if isinstance(e, OSError) and e.errno not in _NO_KERNEL_COPY:
            raise
        return None


def copy_plain(src: BinaryIO, dst: BinaryIO, size: int) -> int:
    """Copy ``size`` bytes from ``src`` to ``dst`` (both at their positions), starting their
    writeback as it goes; returns the bytes copied (fewer: ``src`` ended early)."""
    done = 0
    out = dst.fileno()
    at = os.lseek(out, 0, os.SEEK_CUR)
    while done < size:
        n = _kernel_copy(src.fileno(), out, min(CHUNK, size - done), None)
        if n is None:
            if done:
                raise OSError(f"the kernel stopped copying after {done} bytes")
            break
        if n == 0:
            return done
        start_writeback(out, at + done, n)
        done += n
    if done == size:
        return done
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    while done < size:
        n = src.readinto(view[: min(CHUNK, size - done)])
        if not n:
            break
        dst.write(view[:n])
        start_writeback(out, at + done, n)
        done += n
    return done


class Hasher:
    """sha256 on a worker thread, fed chunk by chunk from two alternating buffers, or read back
    from the file just written (``copy_into``)."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="spill-sha256")
        self.bufs = (bytearray(CHUNK), bytearray(CHUNK))
        self.back = bytearray(CHUNK)  # the worker's own: it runs one job at a time

    def _hash_back(self, h: Any, fd: int, offset: int, size: int) -> None:
        view = memoryview(self.back)
        while size > 0:
            n = os.preadv(fd, [view[: min(size, len(view))]], offset)
            if n <= 0:
                raise OSError(f"a file being installed is {offset} bytes, shorter than written")
            h.update(view[:n])
            offset, size = offset + n, size - n

    def copy_into(self, src: BinaryIO, offset: int, dst: BinaryIO, size: int) -> tuple[int, str]:
        """Copy ``size`` bytes of ``src`` from ``offset`` into the new, empty file ``dst``
        (opened for reading and writing) and hash the bytes as ``dst`` holds them; returns
        (bytes copied, sha256 hex); fewer bytes: ``src`` ended early."""
        h = hashlib.sha256()
        out = dst.fileno()
        jobs = []
        done = 0
        try:
            while done < size:
                n = _kernel_copy(src.fileno(), out, min(CHUNK, size - done), offset + done)
                if n is None and not done:
                    src.seek(offset)
                    return self.copy(src, dst, size)
                if n is None:
                    raise OSError(f"the kernel stopped copying after {done} bytes")
                if n == 0:
                    break
                start_writeback(out, done, n)
                jobs.append(self.pool.submit(self._hash_back, h, out, done, n))
                done += n
        finally:
            for job in jobs:
                job.result()  # in order: one worker; the first failure is raised
        return done, h.hexdigest()

    def close(self) -> None:
        self.pool.shutdown()

    def copy(self, src: BinaryIO, dst: BinaryIO | None, size: int) -> tuple[int, str]:
        """Read ``size`` bytes of ``src`` (writing them to ``dst`` unless None) and hash them;
        returns (bytes read, sha256 hex); fewer bytes: ``src`` ended early."""
        h = hashlib.sha256()
        pending = None
        done, i = 0, 0
        at = os.lseek(dst.fileno(), 0, os.SEEK_CUR) if dst is not None else 0
        try:
            while done < size:
                view = memoryview(self.bufs[i])[: min(CHUNK, size - done)]
                n = src.readinto(view)
                if not n:
                    break
                if pending is not None:
                    pending.result()  # the other buffer is hashed: it may be read into next
                pending = self.pool.submit(h.update, view[:n])
                if dst is not None:
                    dst.write(view[:n])
                    start_writeback(dst.fileno(), at + done, n)
                done += n
                i ^= 1
        finally:
            if pending is not None:
                pending.result()
        return done, h.hexdigest()
