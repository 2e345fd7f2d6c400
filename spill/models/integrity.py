"""Per-file sha256 records of a cached model folder (``record``), and the checks that use them:
``check`` at every job start, ``verify`` (``spill models verify``) re-hashing every file and
reporting each change, and ``same_weights`` holding a recorded weight fingerprint (a job state's, an
adapter's) against the model now. A safetensors file whose float tensors hold NaN or inf is never
recorded. A folder without records (a user's own folder) is used as it is, and is reported as
unrecorded; spill never invents a record for bytes it did not see arrive.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from spill.console import note
from spill.errors import ModelError
from spill.models.cache import is_model_file, read_marker, write_marker
from spill.models.scan import NotFinite, not_finite, scan_file
from spill.models.weights import weight_files

SCHEMA_VERSION = 1
CHUNK = 1 << 22


class ModelChanged(ModelError):
    """A cached model file whose bytes differ from the sha256 recorded when it arrived."""


def stat_key(path: Path) -> list[int]:
    st = os.stat(path)  # follows the hub cache's symlinks to the blobs
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def model_files(folder: Path) -> list[str]:
    """The model files in ``folder`` (what a source copies; never the marker)."""
    return sorted(p.name for p in Path(folder).iterdir() if is_model_file(p.name) and p.is_file())


def is_weight_file(name: str) -> bool:
    """The files the weight fingerprint reads: config, shards, shard index."""
    return name == "config.json" or name.endswith((".safetensors", ".safetensors.index.json"))


def _hash(path: Path) -> tuple[str, list[int] | None, str | None]:
    """sha256 of ``path``, its stat key (None when the file moved meanwhile) and the first
    float tensor holding NaN or inf (None: none, or not a safetensors file)."""
    before = stat_key(path)
    digest, bad = scan_file(path)
    return digest, before if stat_key(path) == before else None, bad


def hash_now(path: Path) -> tuple[str, list[int] | None]:
    """sha256 of ``path`` and its stat key, or None for the key when the file moved meanwhile;
    ``NotFinite`` for a float tensor holding NaN or inf."""
    digest, key, bad = _hash(path)
    if bad is not None:
        raise NotFinite(f"{not_finite(path, bad)}: import, fetch or generate it again")
    return digest, key


# Every source records each model file's size and sha256 in ``spill-source.json`` under ``files``
# when the folder enters the cache (tiny generation and GGUF import hash what they wrote, staging
# hashes while copying, a hub snapshot takes the sha256 the hub reported for each LFS file from the
# name of its blob and hashes the small files). Every hash is taken by ``spill.models.scan``, which
# checks a safetensors file's float tensors for NaN and inf in the same pass: such a file is never
# recorded (``record`` refuses it), and a recorded one (an older spill's record) is named when a job
# start re-hashes it or by ``verify``.
def record(
    folder: Path,
    known: Mapping[str, str] | None = None,
    hashed: Mapping[str, tuple[str, list[int] | None]] | None = None,
    stat_cache: bool = True,
    **fields,
) -> dict:
    """Record size and sha256 of every model file in ``folder`` in its marker (with ``fields``).

    ``known``: name -> sha256 reported by the source (the hub), recorded as is and verified in
    full at first use; ``hashed``: name -> (sha256, stat key) already computed while copying.
    ``stat_cache=False`` leaves out the stat keys (machine-specific), so the marker's bytes are
    the same wherever the same files are written; the first check then hashes them once.
    """
    folder = Path(folder)
    files, verified = {}, {}
    for name in model_files(folder):
        path = folder / name
        size = os.stat(path).st_size
        if known and name in known:
            files[name] = {"size": size, "sha256": known[name], "from": "hub"}
            continue
        digest, key = (hashed or {}).get(name) or hash_now(path)
        files[name] = {"size": size, "sha256": digest, "from": "local"}
        if stat_cache and key is not None and key == stat_key(path):
            verified[name] = key
    return write_marker(
        folder, schema_version=SCHEMA_VERSION, files=files, verified=verified, **fields
    )


def recorded(folder: Path) -> dict[str, dict] | None:
    """The folder's file records (name -> size, sha256), or None when it has none."""
    return read_marker(folder).get("files") or None


def weight_hashes(files: Mapping[str, Mapping] | None) -> dict[str, str] | None:
    """name -> sha256 of the weight files among ``files``, for a run's identity."""
    if not files:
        return None
    return {n: r["sha256"] for n, r in sorted(files.items()) if is_weight_file(n)} or None


def _fix(folder: Path, name: str) -> str:
    # a hub snapshot links to blobs named by hash: only deleting the repo's folder re-downloads
    gone = folder.parent.parent if folder.parent.name == "snapshots" else folder
    return (
        f"run `spill models verify {name}` to list every change, then delete {gone} and "
        "fetch, import or generate the model again"
    )


@dataclass
class FileStatus:
    name: str
    status: str  # ok, changed, missing, added, not finite
    size: int = 0
    sha256: str | None = None  # recorded
    now: str | None = None  # found
    size_now: int | None = None  # found, when the size differs (then the file is not read)
    tensor: str | None = None  # not finite: the first float tensor holding NaN or inf

    def line(self, folder: Path) -> str:
        path = Path(folder) / self.name
        if self.status == "not finite":
            return not_finite(path, self.tensor)
        if self.status == "missing":
            return f"{path} is missing (spill recorded it when the model entered the cache)"
        if self.status == "added":
            return f"{path} was not there when the model entered the cache"
        if self.size_now is not None:
            return f"{path} changed since the model entered the cache ({self.size} -> {self.size_now} bytes)"
        return f"{path} changed since the model entered the cache (sha256 {self.sha256[:12]}.. -> {self.now[:12]}..)"


def _compare(folder: Path, files: Mapping[str, Mapping], full: bool) -> tuple[list, dict, int]:
    """(differences, stat keys verified now, bytes hashed); ``full``: ignore the stat cache."""
    known = {} if full else read_marker(folder).get("verified") or {}
    diffs, fresh, nbytes = [], {}, 0
    present = set(model_files(folder))
    for name, rec in sorted(files.items()):
        path = folder / name
        if name not in present:
            diffs.append(FileStatus(name, "missing", rec["size"], rec["sha256"]))
            continue
        key = stat_key(path)
        if key[0] != rec["size"]:
            diffs.append(FileStatus(name, "changed", rec["size"], rec["sha256"], size_now=key[0]))
            continue
        if known.get(name) == key:
            continue
        digest, key, bad = _hash(path)
        nbytes += rec["size"]
        if digest != rec["sha256"]:
            diffs.append(FileStatus(name, "changed", rec["size"], rec["sha256"], digest))
        elif bad is not None:  # recorded by a spill that did not look
            diffs.append(FileStatus(name, "not finite", rec["size"], rec["sha256"], tensor=bad))
        elif key is not None:
            fresh[name] = key
    diffs += [FileStatus(n, "added") for n in sorted(present - set(files))]
    return diffs, fresh, nbytes


def _remember(folder: Path, fresh: dict, full: bool) -> None:
    if not fresh:
        return
    try:
        old = {} if full else read_marker(folder).get("verified") or {}
        write_marker(folder, verified={**old, **fresh})
    except OSError:
        pass  # a read-only folder is checked in full each time, never refused for it


# A file is re-hashed in full only when its stat key (size, mtime_ns, ctime_ns, inode) differs from
# the one recorded under ``verified`` when its hash last matched; any write to a file, even a
# same-size byte flip, moves its ctime, which userland cannot set back, so an unchanged stat key
# means unchanged bytes for every change made through the filesystem. Silent media corruption (bit
# rot) keeps the stat: ``spill models verify`` re-hashes everything and finds it.
def check(folder: Path, name: str, remember: bool = True) -> dict[str, dict] | None:
    """At job start: the folder's file records once every file matches them (re-hashing only
    files whose stat changed), None when it has none; else one line naming the first change.
    ``remember=False`` writes nothing (a look at a folder that is not ours to touch)."""
    folder = Path(folder)
    files = recorded(folder)
    if files is None:
        return None
    diffs, fresh, _ = _compare(folder, files, full=False)
    if diffs:
        more = f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else ""
        error = NotFinite if diffs[0].status == "not finite" else ModelChanged
        raise error(f"{diffs[0].line(folder)}{more}; {_fix(folder, name)}")
    if remember:
        _remember(folder, fresh, full=False)
    return files


@dataclass
class Verified:
    folder: Path
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    status: str = "ok"  # ok, changed, no hashes recorded, invalid record
    problems: list[str] = field(default_factory=list)  # one line each


def verify(folder: Path) -> Verified:
    """Re-hash every model file of ``folder`` against its records (``spill models verify``)."""
    folder = Path(folder)
    t0 = time.perf_counter()
    out = Verified(folder)
    try:
        files = recorded(folder)
    except ModelError as e:
        out.status, out.problems = "invalid record", [str(e)]
        return out
    if files is None:  # nothing to hold the bytes to; the weights are still looked at
        out.status = "no hashes recorded"
        for name in model_files(folder):
            if name.endswith(".safetensors") and (bad := _hash(folder / name)[2]):
                out.problems.append(not_finite(folder / name, bad))
        out.seconds = time.perf_counter() - t0
        return out
    diffs, fresh, nbytes = _compare(folder, files, full=True)
    out.files, out.bytes = len(files), nbytes
    if diffs:
        damaged = sum(d.status == "not finite" for d in diffs)
        out.status = ", ".join(
            f"{n} {what}"
            for n, what in ((len(diffs) - damaged, "changed"), (damaged, "not finite"))
            if n
        )
        out.problems = [d.line(folder) for d in diffs]
    else:
        _remember(folder, fresh, full=True)
    out.seconds = time.perf_counter() - t0
    return out


def explain(found: Mapping[str, str] | None, want: Mapping[str, str] | None) -> str | None:
    """The first weight file whose sha256 differs between a run's record and the model now, as
    ``the model's file X changed since this run started (sha256 a.. -> b..)``; None if unknown."""
    if not found or not want:
        return None
    for name in sorted(found.keys() | want.keys()):
        a, b = found.get(name), want.get(name)
        if a is None or b is None:
            what = "was added" if a is None else "was removed"
            return f"the model's file {name} {what} since this run started"
        if a != b:
            return f"the model's file {name} changed since this run started (sha256 {a[:12]}.. -> {b[:12]}..)"
    return None


def _legacy_fingerprint(folder: Path) -> str:
    """The weight fingerprint as spill defined it before 2026-12-06: config, shard names and
    sizes, headers, and a sha256 of 64 KiB at each end of each shard's data. It exists only so
    that a state recorded before then continues (``same_weights``); nothing recorded since holds
    it, and on its own it proves nothing (other bytes in the middle of a shard pass it)."""
    files = weight_files(folder)
    samples = []
    for shard in files.shards:
        with open(folder / shard, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            start = 8 + struct.unpack("<Q", f.read(8))[0]
            head = f.read(min(1 << 16, size - start)) if size > start else b""
            f.seek(max(start, size - (1 << 16)))
            samples.append(hashlib.sha256(head + f.read()).hexdigest())
    doc = {
        "config": json.loads((folder / "config.json").read_bytes()),
        "shards": [[s, (folder / s).stat().st_size] for s in files.shards],
        "headers": [files.headers[s] for s in files.shards],
        "samples": samples,
    }
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(raw).hexdigest()


# The one place a recorded weight fingerprint is held against the model now: the fingerprint changed
# definition on 2026-12-06 (a 64 KiB sample of each shard's ends became its full sha256), and a
# record made before then still names these weights when it equals their fingerprint by the old
# definition and the files pass their records.
def same_weights(recorded: str | None, folder: Path, current: str, where: str, then: str) -> bool:
    """Whether the weight fingerprint ``recorded`` at ``where`` names the weights in ``folder``,
    whose fingerprint is ``current``: equal to it, or to the folder's legacy fingerprint while
    every file matches its recorded sha256 (one note says so; ``then``: what records the new
    value, e.g. "its next checkpoint"). A folder without records never matches a legacy value."""
    if recorded == current:
        return True
    folder = Path(folder)
    try:
        if not recorded or check(folder, folder.name, remember=False) is None:
            return False
        if recorded != _legacy_fingerprint(folder):
            return False
    except (ModelError, OSError, ValueError):
        return False
    note(
        f"{where} was recorded with spill's older weight fingerprint; the weights match it (and "
        f"their recorded sha256); {then} records the new one"
    )
    return True
