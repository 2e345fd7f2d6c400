"""Reading a bundle as untrusted input: its member list and manifest checked, its bytes verified.

``open_bundle`` reads only headers and the manifest, and refuses in one line, before anything is
written anywhere, a bundle whose tar, entries, names or manifest are unsafe or inconsistent. What is
wrong with single files (named but not there, another size, cut short by a truncation) is returned
as one line per file (``verify``), for ``--verify`` to print all of them and ``--install`` to refuse
on the first. ``tarfile`` is used for its header parser only; nothing is extracted through it.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spill.ground.validate import SchemaInvalid, parse_json, validate
from spill.project.bundle.format import (
    FORMAT,
    KIND,
    MANIFEST,
    MAX_BYTES,
    MAX_ENTRIES,
    MAX_MANIFEST,
    PREFIX,
    BundleError,
    Hasher,
    bad_path,
)

_TYPES = {
    tarfile.SYMTYPE: "a symbolic link",
    tarfile.LNKTYPE: "a hard link",
    tarfile.CHRTYPE: "a character device",
    tarfile.BLKTYPE: "a block device",
    tarfile.FIFOTYPE: "a fifo",
    tarfile.DIRTYPE: "a folder",
}


@dataclass
class Entry:
    path: str
    role: str
    size: int
    sha256: str
    offset: int = -1  # where its bytes start in the bundle; -1: not in the bundle


@dataclass
class Bundle:
    path: Path
    manifest: dict[str, Any]
    entries: list[Entry]  # in the manifest's order
    manifest_sha256: str
    problems: list[str] = field(default_factory=list)  # one line per file that is not whole

    @property
    def bytes(self) -> int:
        return sum(e.size for e in self.entries)


def _refuse(path: Path, why: str) -> BundleError:
    return BundleError(
        f"{path}: {why}; it was not written by spill or was tampered with, so nothing was installed"
    )


def _members(path: Path) -> list[tarfile.TarInfo]:
    """The entries' headers; a bundle cut short keeps those before the cut (its files are then
    named as cut short or missing), any other unreadable header is refused."""
    out: list[tarfile.TarInfo] = []
    try:
        with tarfile.open(path, "r:") as tf:
            while (m := tf.next()) is not None:
                out.append(m)
                if len(out) > MAX_ENTRIES + 1:  # + the manifest
                    raise _refuse(path, f"it holds more than {MAX_ENTRIES} files, spill's limit")
    except tarfile.ReadError as e:
        if not (out and "unexpected end of data" in str(e)):
            raise _refuse(path, f"not a readable bundle ({e})") from None
    except (tarfile.TarError, EOFError, UnicodeError, ValueError, OverflowError) as e:
        raise _refuse(path, f"not a readable bundle ({type(e).__name__}: {e})") from None
    return out


def _check_member(path: Path, m: tarfile.TarInfo, seen: set[str]) -> None:
    name = m.name
    if not m.isreg():
        kind = _TYPES.get(m.type, f"an entry of tar type {m.type!r}")
        raise _refuse(path, f"entry {name!r} is {kind}; a bundle holds regular files only")
    why = bad_path(name)
    if why:
        raise _refuse(path, f"entry {name!r} is {why}")
    if name != MANIFEST and not name.startswith(tuple(PREFIX.values())):
        raise _refuse(path, f"entry {name!r} lies outside project/, state/ and models/")
    folded = name.casefold()
    if folded in seen:
        raise _refuse(path, f"entry {name!r} is in the bundle twice (or twice but for case)")
    seen.add(folded)


def _manifest(path: Path, first: tarfile.TarInfo, size: int) -> tuple[dict[str, Any], str]:
    if first.name != MANIFEST:
        raise _refuse(path, f"its first entry is {first.name!r}, not the manifest {MANIFEST}")
    if first.size > MAX_MANIFEST or first.offset_data + first.size > size:
        raise _refuse(path, f"its manifest is {first.size} bytes, cut short or too big")
    with open(path, "rb") as f:
        f.seek(first.offset_data)
        raw = f.read(first.size)
    try:
        doc = parse_json(raw)
    except ValueError as e:
        raise _refuse(path, f"its manifest is not JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("kind") != KIND:
        raise _refuse(path, f"its manifest is not a {KIND} manifest")
    version = doc.get("schema_version")
    if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT:
        raise BundleError(
            f"{path} is a bundle of format {version}, written by a newer spill (this one reads "
            f"format {FORMAT}); upgrade spill to install it"
        )
    try:
        validate(doc, "bundle", where=f"{path}: {MANIFEST}")
    except SchemaInvalid as e:
        raise _refuse(path, str(e).split("; it was written")[0].split(": ", 1)[-1]) from None
    _whole_numbers(doc)
    if doc["bytes"] > MAX_BYTES:
        raise _refuse(path, f"its manifest says {doc['bytes']} bytes, over spill's limit of 1 TiB")
    return doc, hashlib.sha256(raw).hexdigest()


def _whole_numbers(doc: dict[str, Any]) -> None:
    """The schema's integers as ints: JSON Schema calls 1118.0 an integer, Python does not."""
    doc["bytes"] = int(doc["bytes"])
    for f in doc["files"]:
        f["size"] = int(f["size"])
    for m in doc["models"]:
        for f in m["files"]:
            f["size"] = int(f["size"])
        if "seed" in m["source"]:
            m["source"]["seed"] = int(m["source"]["seed"])


def _consistent(path: Path, doc: dict[str, Any]) -> list[Entry]:
    """The manifest's files, once its paths, roles, models and run agree with each other."""
    entries, seen = [], set()
    for f in doc["files"]:
        name, role = f["path"], f["role"]
        if not name.startswith(PREFIX[role]) or name == PREFIX[role]:
            raise _refuse(path, f"its manifest lists {name!r} as a {role} file")
        if role == "state" and (doc["run"] is None or name.startswith("state/runs/")):
            raise _refuse(path, f"its manifest lists {name!r}, a state file it cannot carry")
        if name.casefold() in seen:
            raise _refuse(path, f"its manifest lists {name!r} twice")
        seen.add(name.casefold())
        entries.append(Entry(name, role, f["size"], f["sha256"]))
    by_path = {e.path: e for e in entries}
    pinned = set()
    folders = [m["folder"].casefold() for m in doc["models"]]
    if len(set(folders)) != len(folders):
        raise _refuse(path, "its manifest pins two models to one folder")
    for m in doc["models"]:
        for f in m["files"]:
            name = f"models/{m['folder']}/{f['name']}"
            e = by_path.get(name)
            if e is None or e.role != "model" or (e.size, e.sha256) != (f["size"], f["sha256"]):
                raise _refuse(path, f"its manifest pins {name!r} unlike its file list")
            pinned.add(name)
    stray = [e.path for e in entries if e.role == "model" and e.path not in pinned]
    if stray:
        raise _refuse(path, f"its manifest lists {stray[0]!r}, a model file no model pins")
    run = doc["run"]
    if run is not None:
        try:
            validate(run["control"], "control", where="its run's control object")
        except SchemaInvalid as e:
            raise _refuse(path, str(e).split("; it was written")[0]) from None
        if run["control"]["run"] != run["id"]:
            raise _refuse(path, "its manifest's run and control object disagree")
    return entries


# Refused: a file that is not a tar, an entry that is not a regular file (a symlink, a hard link, a
# device, a fifo, a folder), a name that is absolute, has ``..``, a hidden part, a backslash, a
# control character, or lies outside ``project/``, ``state/`` and ``models/``, two names one
# case-insensitive file system would merge, a manifest that is missing, not first, too big, from a
# newer format, or off its schema, a manifest whose paths, roles and model folders disagree with
# each other, and an entry the manifest does not name.
def open_bundle(path: Path | str) -> Bundle:
    """The bundle at ``path``, checked as described above (no file's bytes read yet)."""
    path = Path(path)
    if not path.is_file():
        raise BundleError(f"{path}: no such bundle file")
    size = path.stat().st_size
    members = _members(path)
    if not members:
        raise _refuse(path, "it is empty or not a tar file")
    seen: set[str] = set()
    for m in members:
        _check_member(path, m, seen)
    doc, digest = _manifest(path, members[0], size)
    entries = _consistent(path, doc)
    at = {m.name: m for m in members[1:]}
    listed = {e.path for e in entries}
    extra = [n for n in at if n not in listed]
    if extra:
        raise _refuse(path, f"entry {extra[0]!r} is not in its manifest")
    out = Bundle(path, doc, entries, digest)
    for e in entries:
        m = at.get(e.path)
        if m is None:
            out.problems.append(f"{e.path}: missing from the bundle (the manifest names it)")
        elif m.size != e.size:
            out.problems.append(
                f"{e.path}: {m.size} bytes in the bundle, the manifest says {e.size}"
            )
        elif m.offset_data + m.size > size:
            have = max(0, size - m.offset_data)
            out.problems.append(f"{e.path}: cut short ({have} of {e.size} bytes; truncated bundle)")
        else:
            e.offset = m.offset_data
    return out


def verify(bundle: Bundle, bar=None) -> list[str]:
    """Hash every file that is whole; one line per file that is missing, short or damaged."""
    problems = list(bundle.problems)
    hasher = Hasher()
    try:
        with open(bundle.path, "rb", buffering=0) as f:
            for e in sorted(bundle.entries, key=lambda e: e.offset):
                if e.offset < 0:
                    continue
                f.seek(e.offset)
                got, sha = hasher.copy(f, None, e.size)
                if got != e.size or sha != e.sha256:
                    problems.append(damaged(e, sha))
                if bar is not None:
                    bar.update(e.size)
    finally:
        hasher.close()
    return problems


def damaged(e: Entry, sha: str) -> str:
    return f"{e.path}: damaged (sha256 {sha[:12]}.., the manifest says {e.sha256[:12]}..)"


def free_space_ok(where: Path, need: int) -> bool:
    try:
        st = os.statvfs(where)
    except OSError:
        return True
    return st.f_bavail * st.f_frsize >= need
