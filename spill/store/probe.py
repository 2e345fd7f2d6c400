"""Probes of a location before anything is written there. ``probe_writable``: a job's state can be
written at all, found before it loads a model. ``not_a_file``, ``check_names``, ``probe_names`` and
``space``: a move's destination is a folder or prefix, holds every name the copy will write, and has
room, all found before the source changes. Probe files are temporary names (``is_temp``): one a
killed process left is litter the store already ignores, and the folders a probe made go with it.
"""

from __future__ import annotations

import errno
import os
import uuid
from collections.abc import Sequence

from spill.errors import StoreError
from spill.store.fs import (
    TMP_MARK,
    filesystem,
    makedirs_durable,
    remove,
    store_errors,
)
from spill.store.location import location

KEY_MAX = 1024  # bytes in an object key: S3's limit (GCS and Azure blob names allow as many)


def write_failure(e: BaseException) -> str:
    """The short cause of a failed write, on one line."""
    cause = e.__cause__ or e
    if isinstance(cause, OSError) and cause.strerror:
        return cause.strerror
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[0][:200]}" if text else type(cause).__name__


def probe_writable(uri: str | os.PathLike) -> None:
    """Write and remove a small temporary object under ``uri``; a ``StoreError`` if it cannot."""
    uri = location(uri)  # parsed once (a Location as it is)
    probe = uri.join(f".write-probe{TMP_MARK}{uuid.uuid4().hex[:12]}")
    try:  # a plain write, not put_bytes: no fsync, and no drill point to shift the drills' counts
        if uri.local:
            with store_errors(probe, "write"):
                makedirs_durable(uri.path)
                with open(probe.path, "wb") as f:
                    f.write(b"spill write probe\n")
        else:
            fs, path = filesystem(probe)
            with store_errors(probe, "write"):
                fs.pipe_file(path, b"spill write probe\n")
        remove(probe)
    except (StoreError, FileNotFoundError, NotADirectoryError) as e:
        raise StoreError(
            f"state location {uri} cannot be written ({write_failure(e)}); "
            "give --state a location you can write to"
        ) from None


def _existing(path: str) -> str:
    """The nearest of ``path`` and its parents that exists."""
    while not os.path.lexists(path):
        path = os.path.dirname(path)
    return path


def not_a_file(uri: str) -> None:
    """Refuse, in one line, a destination that is a file (or lies under one)."""
    uri = location(uri)
    if uri.local:
        path = os.path.abspath(uri.path)
        there = _existing(path)
        if os.path.isdir(there):
            return
        where = "is a file" if there == path else f"lies under {there}, which is a file"
        raise StoreError(f"{uri} {where}; move to a new or empty folder")
    fs, path = filesystem(uri)
    with store_errors(uri, "check"):
        fs.invalidate_cache(path)
        if fs.isfile(path):
            raise StoreError(f"{uri} is an object, not a prefix; move to a new or empty prefix")


def _too_long(root: str, name: str, limit: int, what: str) -> StoreError:
    shown = name if len(name) <= 48 else f"{name[:24]}...{name[-16:]}"
    return StoreError(
        f"{root}: {shown} is {len(name.encode())} bytes long, and {what} takes at most {limit}; "
        "move to a shorter path"
    )


def _limits(base: str) -> tuple[int, int]:
    """(NAME_MAX, PATH_MAX) of the file system holding the existing folder ``base``."""
    out = []
    for name, default in (("PC_NAME_MAX", 255), ("PC_PATH_MAX", 4096)):
        try:
            out.append(os.pathconf(base, name))
        except (OSError, ValueError):
            out.append(default)
    return out[0], out[1]


def check_names(root: str, rels: Sequence[str] = ()) -> None:
    """Refuse, in one line, a path segment of ``root`` (the part not there yet) or of ``rels``
    longer than the file system takes, or a ``root`` past ``PATH_MAX``, so that reading and
    writing there fail on nothing but the disk (no write: see ``probe_names``)."""
    root = location(root)
    if not root.local:
        _, path = filesystem(root)
        prefix = path.split("/", 1)[1] if "/" in path.strip("/") else ""
        for rel in rels or ("",):
            key = f"{prefix.strip('/')}/{rel}".strip("/")
            if len(key.encode()) > KEY_MAX:
                raise _too_long(root, key, KEY_MAX, "an object store key")
        return
    full = os.path.abspath(root.path)
    base = _existing(full)
    name_max, path_max = _limits(base)
    made = os.path.relpath(full, base).split(os.sep) if full != base else []
    for seg in {*made, *(s for r in rels for s in r.split("/"))}:
        if len(seg.encode()) > name_max:
            raise _too_long(root, seg, name_max, "this file system")
    if len(full.encode()) >= path_max:
        raise StoreError(
            f"{root[:40]}...: the path is {len(full.encode())} bytes long, and this file system "
            f"takes at most {path_max - 1}; move to a shorter path"
        )


# Locally the names are probed by writing a temporary file at the deepest folder the copy will make,
# its name as long as the longest there; on an object store each key is checked against 1024 bytes.
def probe_names(root: str, rels: Sequence[str], passing: Sequence[str] = ()) -> None:
    """Refuse, in one line, a destination ``root`` (absolute) that cannot hold every one of
    ``rels`` (``/``-separated, relative to it), nor locally the temporary names ``passing`` a
    copy makes on the way (an object store's writes make none); see the module doc."""
    root = location(root)
    rels = [*rels, *passing] if root.local else rels
    check_names(root, rels)
    if not root.local or not rels:
        return
    full = os.path.abspath(root.path)
    longest = max(rels, key=lambda r: len(os.path.join(full, r).encode()))
    folder, name = os.path.split(os.path.join(full, longest))
    width = max(len(name.encode()), len(TMP_MARK) + 1)
    probe = os.path.join(folder, (f"{TMP_MARK}{uuid.uuid4().hex}" + "p" * width)[:width])
    created = []
    try:
        d = folder
        while not os.path.isdir(d):
            created.append(d)
            d = os.path.dirname(d)
        for d in reversed(created):
            os.mkdir(d)
        with open(probe, "xb"):
            pass
        os.unlink(probe)
    except OSError as e:
        if e.errno == errno.ENAMETOOLONG:
            raise StoreError(
                f"{root}: {longest} would be {len(os.path.join(full, longest).encode())} bytes "
                "long there, longer than this file system takes; move to a shorter path"
            ) from None
        raise StoreError(
            f"{root} cannot be written ({write_failure(e)}); move to a place you can write to"
        ) from None
    finally:
        for d in created:  # deepest first; only what the probe made, and only if empty
            try:
                os.rmdir(d)
            except OSError:
                break


def space(uri: str) -> tuple[int, int] | None:
    """(bytes free to this user, block size) of the file system a local ``uri`` would be on;
    None for an object store, which cannot say."""
    uri = location(uri)
    if not uri.local:
        return None
    try:
        st = os.statvfs(_existing(os.path.abspath(uri.path)))
    except OSError:
        return None
    return st.f_bavail * st.f_frsize, st.f_frsize or 4096
