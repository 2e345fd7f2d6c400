"""Steps 3 and 4 of ``spill move``: the snapshot copied to the destination under a manifest
(``copy_snapshot``), and read back (``verify``). docs/move.md, "The seven steps".

The manifest (schema ``move-manifest``, ``runs/<run>/move-<transfer>.json`` at the destination)
names every path the copy will write (what ``--abort`` removes); a rerun of the same transfer copies
only what differs. A failed write ends the copy in one line naming the file, a full destination with
the bytes needed and free; the source stays quiescing.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from typing import Any

from spill.console import progress
from spill.control.arrival import manifest_uri
from spill.errors import StoreError
from spill.ground.hashing import CHUNK
from spill.ground.validate import validate
from spill.project.move import checks
from spill.store import snapshot
from spill.store.fs import (
    exists,
    failed_there,
    get_bytes,
    join,
    open_read,
    open_whole,
    put_bytes,
    stat,
)
from spill.store.location import Location
from spill.store.probe import write_failure


def _copy(src: Location, dst: Location) -> tuple[int, str]:
    """Copy one file, streamed, hashing the bytes as they pass: (size, sha256)."""
    h, size = hashlib.sha256(), 0
    with open_read(src) as f, open_whole(dst, f".move-{os.getpid()}-") as g:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            g.write(chunk)
            size += len(chunk)
    return size, h.hexdigest()


FULL = (errno.ENOSPC, errno.EDQUOT)


def _errno(e: BaseException | None) -> int | None:
    while e is not None:
        if isinstance(e, OSError) and e.errno:
            return e.errno
        e = e.__cause__
    return None


def _put_manifest(uri: str, manifest: dict[str, Any]) -> None:
    validate(manifest, "move-manifest", where=uri)
    put_bytes(uri, json.dumps(manifest, indent=1, sort_keys=True).encode() + b"\n")


# The manifest is written unsealed first, and sealed with each file's size and sha256 at the end. A
# file lands whole (``fs.open_whole``; locally through ``.move-<pid>-<name>``).
def copy_snapshot(
    root: Location | None,
    src_state: Location,
    dst_root: Location,
    dst_state: Location,
    doc: dict[str, Any],
    exports: bool = False,
) -> dict[str, Any]:
    """Step 3: an unsealed manifest naming every path first, then the snapshot (hashed in the
    same pass), then the manifest sealed with every file's size and sha256. A rerun of the same
    transfer hashes both sides first and copies only what differs; it carries the exports when
    this one or the first attempt was asked to (``exports``, ``--with-exports``), so what the
    manifest names stays named."""
    t = doc["transfer"]
    uri = manifest_uri(dst_state, doc["run"], t["id"])
    fresh = not exists(uri)  # else a rerun of this transfer: its partial copy is there
    if not fresh and not exports:
        named = json.loads(get_bytes(uri)).get("paths") or []
        exports = any(checks.is_export(rel, root is not None) for rel in named)
    files = checks.snapshot_files(root, src_state, doc, exports)
    manifest = {
        "schema_version": 1,
        "kind": "spill-move",
        "transfer": t["id"],
        "run": doc["run"],
        "from": t["from"],
        "to": t["to"],
        "project": root is not None,
        "sealed": False,
        "files": [],
        "bytes": 0,
        "paths": [rel for _, rel in files],
    }
    done: set[str] = set()

    def one(item: tuple[str, str]) -> dict[str, Any]:
        src, rel = item
        dst = join(dst_root, rel)
        same = None
        if not fresh and (have := stat(dst)) is not None:
            size, sha = snapshot.digest(src)
            if have[0] == size and snapshot.digest(dst)[1] == sha:
                same = size, sha
        try:
            size, sha = same or _copy(src, dst)
        except StoreError:
            raise
        except Exception as e:  # noqa: BLE001 - a remote backend's error, or the disk's
            if not failed_there(dst, e):
                raise
            raise StoreError(f"{dst}: cannot write ({write_failure(e)})") from e
        done.add(rel)
        bar.update(1)
        return {"path": rel, "size": size, "sha256": sha}

    try:
        _put_manifest(uri, manifest)  # the claim's list: what an abort removes
        with progress(len(files), "copy", "file") as bar:
            entries = _each(one, files, _workers(root or src_state, dst_root))
        manifest.update(sealed=True, files=entries, bytes=sum(e["size"] for e in entries))
        _put_manifest(uri, manifest)
    except StoreError as e:
        if _errno(e) not in FULL:
            raise
        left = [(rel, (stat(src) or (0, None))[0]) for src, rel in files if rel not in done]
        room = checks.room_needed(dst_root, left)
        need, free = room or (sum(size for _, size in left), 0)
        why = f" to finish the copy ({write_failure(e)})"
        raise checks.full(dst_root, need, free, why, checks.AGAIN) from None
    return manifest


def verify(dst_root: Location, manifest: dict[str, Any]) -> None:
    """Step 4: read every destination file back; a mismatch names the file."""
    assert manifest["sealed"], "verify an unsealed manifest"

    def one(e: dict[str, Any]) -> None:
        uri = join(dst_root, e["path"])
        try:
            size, sha = snapshot.digest(uri)
        except FileNotFoundError:
            raise StoreError(f"{uri} is missing after the copy; run `spill move` again") from None
        if (size, sha) != (e["size"], e["sha256"]):
            raise StoreError(
                f"{uri} does not match what was copied ({size} bytes, sha256 {sha[:12]}, not "
                f"{e['size']} bytes, {e['sha256'][:12]}); run `spill move` again"
            )

    _each(one, manifest["files"], _workers(dst_root, dst_root))


def _workers(src: Location, dst: Location) -> int:
    """Files copied (or read back) at once: one on local disks, where one stream is as fast as
    the disk; several when an object store is a side, whose requests wait on the network."""
    return max(src.requests, dst.requests)


def _each(fn, items: list, workers: int) -> list:
    """``[fn(x) for x in items]``, on ``workers`` threads; the first error is raised."""
    if workers == 1 or len(items) < 2:
        return [fn(x) for x in items]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, items))
