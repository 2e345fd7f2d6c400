"""Byte-level access to a state location (a local path, ``file://``, ``memory://``, ``s3://``,
``gs://``, ``az://``), given as text or a ``Location``: local ones through ``os``, the rest
through fsspec (imported lazily). ``put_bytes`` is atomic (locally a temporary name, fsynced,
renamed over the target, never over a FIFO, device or folder). Temporary names are
recognisable (``is_temp``). Listings never come from fsspec's cache.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path, PurePosixPath
from stat import S_ISBLK, S_ISCHR, S_ISDIR, S_ISFIFO, S_ISLNK, S_ISREG, S_ISSOCK
from typing import BinaryIO

from spill.errors import StoreError
from spill.store import drill
from spill.store.location import (  # noqa: F401  (BackendMissing, SCHEMES: this module's API too)
    SCHEMES,
    BackendMissing,
    Location,
    local_path,
    location,
    scheme_of,
)
from spill.store.written import synced

TMP_MARK = ".tmp-"
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 16


def is_local(uri: str | os.PathLike) -> bool:
    if isinstance(uri, Location):
        return uri.local
    return scheme_of(os.fspath(uri)) in ("", "file")


def _local(uri: str) -> str:
    """The local path a local location names (``spill.store.location.local_path``)."""
    return uri.path if isinstance(uri, Location) else local_path(uri)


def absolute(where: str) -> str:
    """A location as its one spelling: a local one as an absolute path (``file://`` and ``~``
    resolved, symlinks kept), a URI without its trailing ``/`` (a ``Location`` as a
    ``Location``: ``Location.absolute``)."""
    if isinstance(where, Location):
        return where.absolute
    return os.path.abspath(_local(where)) if is_local(where) else where.rstrip("/")


def join(uri: str | os.PathLike, *parts: str) -> str:
    """``uri`` with ``parts`` appended, ``/``-separated whatever the scheme (a ``Location`` gives
    a ``Location``, not parsed again)."""
    if isinstance(uri, Location):
        return uri.join(*parts)
    out = os.fspath(uri).rstrip("/") or "/"
    for p in parts:
        out = out.rstrip("/") + "/" + p.strip("/")
    return out


def basename(uri: str) -> str:
    return PurePosixPath(uri.rstrip("/")).name


def is_temp(name: str) -> bool:
    """Whether ``name`` is a temporary file left by an interrupted local ``put_bytes``."""
    return name.startswith(".") and TMP_MARK in name


def filesystem(uri: str):
    """``(fsspec filesystem, path)`` for a non-local URI (``Location.remote``)."""
    return location(uri).remote


@contextmanager
def store_errors(uri: str, verb: str) -> Iterator[None]:
    """Turn backend failures other than a missing object into one-line ``StoreError``s."""
    # remote backends raise OSError, botocore and google errors alike; local ones only OSError
    catch = OSError if is_local(uri) else Exception
    try:
        yield
    except (FileNotFoundError, StoreError):
        raise
    except catch as e:
        what = "path and its free space" if catch is OSError else "location and its credentials"
        raise StoreError(f"{uri}: cannot {verb} ({type(e).__name__}: {e}); check the {what}") from e


def fsync(path: str | os.PathLike) -> None:  # a file or a folder, by its path
    fd = os.open(path, os.O_RDONLY)
    try:
        synced(fd)
    finally:
        os.close(fd)


def makedirs_durable(path: str) -> None:
    """``mkdir -p`` that also fsyncs the parent of every directory it creates."""
    missing = []
    p = os.path.abspath(path)
    while not os.path.isdir(p):
        missing.append(p)
        p = os.path.dirname(p)
    for d in reversed(missing):
        try:
            os.mkdir(d)
        except FileExistsError:
            pass
        fsync(os.path.dirname(d))


def kind_of(path: str) -> str | None:
    """What ``path`` names when it is not a regular file, a link or missing: ``"a folder"``,
    ``"a FIFO"``, ``"a character device"``, ... (a rename must not replace it), else None."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if S_ISREG(mode) or S_ISLNK(mode):
        return None
    kinds = ((S_ISDIR, "a folder"), (S_ISFIFO, "a FIFO"), (S_ISCHR, "a character device"))
    kinds += ((S_ISBLK, "a block device"), (S_ISSOCK, "a socket"))
    return next((what for test, what in kinds if test(mode)), "not a regular file")


def _put_local(path: str, data: bytes, drilled: bool = True) -> None:
    if what := kind_of(path):
        raise StoreError(f"{path} is {what}, not a file; spill replaces only regular files")
    parent = os.path.dirname(os.path.abspath(path))
    makedirs_durable(parent)
    tmp = os.path.join(parent, f".{os.path.basename(path)}{TMP_MARK}{uuid.uuid4().hex[:12]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            synced(f.fileno())
        if drilled:
            drill.at(drill.PUT_BEFORE_RENAME)
        os.replace(tmp, path)
    except BaseException:
        # a SIGKILL never gets here; the store's next write removes what it leaves
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync(parent)


def put_bytes(uri: str | os.PathLike, data: bytes, *, drilled: bool = True) -> None:
    """Write ``data`` to ``uri`` atomically: a reader sees the old object or the new one.

    ``drilled=False`` skips the ``put-before-rename`` drill point (control transitions have
    drill points of their own, and must not shift the counts of the store's drills)."""
    uri = location(uri)
    if uri.local:
        with store_errors(uri, "write"):
            _put_local(uri.path, data, drilled)
        return
    fs, path = uri.remote
    with store_errors(uri, "write"):
        fs.pipe_file(path, data)
        fs.invalidate_cache(path)


def put_fresh(uri: str | os.PathLike, parts: Sequence[bytes | memoryview]) -> None:
    """Write a new file that nobody trusts before a marker written after it (a checkpoint's
    files before COMMIT): no temporary name, no fsync (``sync_fresh``, before the marker). The
    local name must be new (payload names are unique to their writer); remotely one put."""
    uri = location(uri)
    if uri.local:
        path = uri.path
        with store_errors(uri, "write"):
            makedirs_durable(os.path.dirname(os.path.abspath(path)))
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_all(fd, parts)
                if hasattr(os, "posix_fadvise"):  # start writing it to disk now, not at fsync
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return
    fs, path = uri.remote
    with store_errors(uri, "write"):
        fs.pipe_file(path, b"".join(parts))
        fs.invalidate_cache(path)


def _write_all(fd: int, parts: Sequence[bytes | memoryview]) -> None:
    """Write every buffer, in order, with as few system calls as the OS allows."""
    views = [memoryview(p).cast("B") for p in parts if memoryview(p).nbytes]
    i = 0
    while i < len(views):
        n = os.writev(fd, views[i : i + _IOV_MAX])
        while n:  # a short write: drop what went out, keep the rest of a partial buffer
            if n >= len(views[i]):
                n -= len(views[i])
                i += 1
            else:
                views[i], n = views[i][n:], 0


def sync_fresh(uris: Sequence[str]) -> None:
    """fsync the local files ``put_fresh`` wrote, then their folders (a put is durable already)."""
    local = [_local(u) for u in uris if is_local(u)]
    with store_errors(", ".join(uris), "sync"):
        for path in [*local, *sorted({os.path.dirname(os.path.abspath(p)) for p in local})]:
            fsync(path)


def get_bytes(uri: str | os.PathLike) -> bytes:
    """The whole object at ``uri``; ``FileNotFoundError`` when there is none."""
    uri = location(uri)
    if uri.local:
        with store_errors(uri, "read"), open(uri.path, "rb") as f:
            return f.read()
    fs, path = uri.remote
    with store_errors(uri, "read"):
        # s3fs may size the object from a cached listing of its folder first, which would call
        # an object another process wrote since that listing missing
        fs.invalidate_cache(path)
        return fs.cat_file(path)


def open_read(uri: str | os.PathLike):
    """The file at ``uri`` opened for reading, streamed (``FileNotFoundError`` when none)."""
    uri = location(uri)
    if uri.local:
        return open(uri.path, "rb")
    fs, path = uri.remote
    return fs.open(path, "rb")


def exists(uri: str | os.PathLike) -> bool:
    """Whether an object or a non-empty prefix (directory) exists at ``uri``."""
    uri = location(uri)
    if uri.local:
        return os.path.exists(uri.path)
    fs, path = uri.remote
    with store_errors(uri, "check"):
        fs.invalidate_cache(path)
        return fs.exists(path)


def listdir(uri: str | os.PathLike) -> list[str]:
    """Sorted names directly under ``uri`` (files and subdirectories); ``[]`` when missing."""
    uri = location(uri)
    if uri.local:
        try:
            return sorted(os.listdir(uri.path))
        except (FileNotFoundError, NotADirectoryError):
            return []
    fs, path = uri.remote
    with store_errors(uri, "list"):
        fs.invalidate_cache(path)
        try:
            entries = fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
    own = path.rstrip("/")
    names = {basename(e) for e in entries if e.rstrip("/") != own}
    return sorted(n for n in names if n)


def stat(uri: str | os.PathLike) -> tuple[int, int | None] | None:
    """(size, mtime_ns, or None on an object store) of the file at ``uri``; None when there is
    no file there."""
    uri = location(uri)
    if uri.local:
        try:
            st = os.stat(uri.path)
        except (OSError, ValueError):  # missing, or a name no file system accepts
            return None
        return st.st_size, st.st_mtime_ns
    fs, path = uri.remote
    with store_errors(uri, "check"):
        fs.invalidate_cache(path)
        try:
            info = fs.info(path)
        except FileNotFoundError:
            return None
    return (int(info["size"]), None) if info.get("type") != "directory" else None


def files_under(uri: str | os.PathLike) -> list[str]:
    """Every file below ``uri``, relative, sorted; ``[""]`` for a file, ``[]`` for nothing."""
    uri = location(uri)
    if uri.local:
        base = uri.path
        if os.path.isfile(base):
            return [""]
        found = [
            os.path.relpath(os.path.join(d, f), base).replace(os.sep, "/")
            for d, _, names in os.walk(base)
            for f in names
        ]
    else:
        fs, path = uri.remote
        with store_errors(uri, "list"):
            fs.invalidate_cache(path)
            if fs.isfile(path):
                return [""]
            own = path.rstrip("/") + "/"
            found = [p.removeprefix(own) for p in fs.find(path)]
    return sorted(found)


def remove(uri: str | os.PathLike) -> None:
    """Remove the object or the whole directory/prefix at ``uri``; nothing there is fine."""
    uri = location(uri)
    if uri.local:
        path = uri.path
        with store_errors(uri, "remove"):
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=False)
                fsync(os.path.dirname(os.path.abspath(path)))
            elif os.path.lexists(path):
                os.remove(path)
        return
    fs, path = uri.remote
    with store_errors(uri, "remove"):
        fs.invalidate_cache(path)
        try:
            fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        fs.invalidate_cache(path)


@contextmanager
def open_whole(uri: str | os.PathLike, temp: str) -> Iterator[BinaryIO]:
    """A file to stream ``uri``'s bytes into that lands whole: locally through the temporary
    ``<folder>/<temp><name>`` (fsynced, renamed over ``uri``; removed when the block fails), on
    an object store one upload that completes when the block ends."""
    uri = location(uri)
    if not uri.local:
        fs, path = uri.remote
        with fs.open(path, "wb") as g:
            yield g
        return
    folder = os.path.dirname(uri.path)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, temp + os.path.basename(uri.path))
    try:
        with open(tmp, "wb") as g:
            yield g
            g.flush()
            synced(g.fileno())
        os.replace(tmp, uri.path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def failed_there(uri: str | os.PathLike, e: BaseException) -> bool:
    """Whether ``e`` is the place at ``uri`` failing (an ``OSError`` of a disk; whatever an
    object store's backend raises), not a bug."""
    return isinstance(e, OSError) or not location(uri).local


def remove_named(uri: str | os.PathLike, prefix: str) -> None:
    """Remove the files ``prefix*`` a killed writer left in the local folder ``uri``."""
    uri = location(uri)
    for n in listdir(uri) if uri.local else ():
        if n.startswith(prefix):
            remove(uri.join(n))


def prune_empty(uri: str | os.PathLike) -> None:
    """Remove the emptied folders below the local folder ``uri``."""
    uri = location(uri)
    for d, _, _ in os.walk(uri.path, topdown=False) if uri.local else ():
        if d != uri.path:
            with suppress(OSError):
                os.rmdir(d)  # only an emptied folder goes


def remove_stale(dest, suffix: str) -> None:
    """Delete the local temporary folders ``.<dest name>.<pid>.<...><suffix>`` beside ``dest``
    that killed writers left (their process gone; a live one's, even another user's, stays)."""
    dest = Path(dest)
    for tmp in dest.parent.glob(f".{dest.name}.*{suffix}"):
        pid = tmp.name[len(dest.name) + 2 :].split(".")[0]
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                shutil.rmtree(tmp, ignore_errors=True)
            except PermissionError:  # alive, someone else's
                pass
