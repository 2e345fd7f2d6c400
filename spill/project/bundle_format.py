"""The bundle file format: an uncompressed POSIX tar whose first entry is the manifest.

Layout (every name ``/``-separated, relative)::

    spill-bundle.json              the manifest (schema ``bundle``), always first
    project/<path>                 the project folder's files (spill.yaml, data, conf groups)
    state/<path>                   with --with-state: the run's files, relative to its state
    models/<folder>/<file>         model files, ``<folder>`` relative to SPILL_HOME/models

The manifest comes first so that a truncated bundle still says which files it should hold (the
cut one is named), and so that ``--verify`` and ``--install`` check it before reading any data.
That costs the writer a hashing pass before it writes; model files whose stat key matches the
one their cache record last verified are not hashed again (``spill.models.integrity``'s rule).

Entries are written here, not by ``tarfile`` (headers from ``TarInfo.tobuf``, data copied by the
kernel where it can), and never extracted by ``tarfile``: the reader takes only the member list
from it and writes regular files to paths it computed and checked itself. ``copy_hashed``
hashes on a second thread while the first reads and writes (hashlib lets go of the GIL), so
install costs about max(sha256, copy) rather than their sum.
"""

from __future__ import annotations

import hashlib
import os
import re
import tarfile
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO

from spill.errors import SpillError

FORMAT = 1  # the manifest's schema_version this spill writes and reads
KIND = "spill-bundle"
MANIFEST = "spill-bundle.json"
ROLES = ("project", "state", "model")
PREFIX = {"project": "project/", "state": "state/", "model": "models/"}
CHUNK = 4 << 20
BLOCK = tarfile.BLOCKSIZE
RECORD = tarfile.RECORDSIZE
MAX_MANIFEST = 64 << 20
_SEGMENT = re.compile(r"^[^/\\\x00-\x1f]+$")


class BundleError(SpillError):
    """A bundle that cannot be written, or one that is damaged, unsafe or from a newer spill."""


def bad_path(rel: str) -> str:
    """Why ``rel`` may not name a file in a bundle (``""`` when it may): it must be relative,
    ``/``-separated, without ``.``/``..``/hidden segments, backslashes or control characters."""
    if not rel or rel.startswith("/") or len(rel) > 4096:
        return "an absolute or empty path"
    for seg in rel.split("/"):
        if seg in ("", ".", ".."):
            return "a path with an empty, '.' or '..' part"
        if not _SEGMENT.match(seg):
            return "a path with a backslash or a control character"
        if seg.startswith("."):
            return "a hidden name"
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


def copy_plain(src: BinaryIO, dst: BinaryIO, size: int) -> int:
    """Copy ``size`` bytes from ``src`` to ``dst`` (both at their positions); returns the bytes
    copied (fewer: ``src`` ended early). The kernel copies where it can (``copy_file_range``)."""
    done = 0
    if hasattr(os, "copy_file_range"):
        try:
            while done < size:
                n = os.copy_file_range(src.fileno(), dst.fileno(), size - done)
                if n == 0:
                    return done
                done += n
            return done
        except (OSError, AttributeError, ValueError):
            if done:
                raise
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    while done < size:
        n = src.readinto(view[: min(CHUNK, size - done)])
        if not n:
            break
        dst.write(view[:n])
        done += n
    return done


class Hasher:
    """sha256 on a worker thread, fed chunk by chunk from two alternating buffers."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="spill-sha256")
        self.bufs = (bytearray(CHUNK), bytearray(CHUNK))

    def close(self) -> None:
        self.pool.shutdown()

    def copy(self, src: BinaryIO, dst: BinaryIO | None, size: int) -> tuple[int, str]:
        """Read ``size`` bytes of ``src`` (writing them to ``dst`` unless None) and hash them;
        returns (bytes read, sha256 hex); fewer bytes: ``src`` ended early."""
        h = hashlib.sha256()
        pending = None
        done, i = 0, 0
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
                done += n
                i ^= 1
        finally:
            if pending is not None:
                pending.result()
        return done, h.hexdigest()
