"""``spill move [DIR] URI``: hand a project's run (its state and its files) to another place.

The source is a project folder (its state at ``DIR/.spill`` or ``--state``), a project at a URI,
or a bare state location (a job's ``--state``). The destination ``URI`` becomes a project
folder (the project's files, its state at ``URI/.spill``), or for a bare state location a state
location. The control steps and why two places are never both acquirable are in
``spill.control.transfer``; this module copies and checks what the steps name:

* the snapshot is the run as its control object says it is (``snapshot.state_files``: pointed
  payloads, stage files, adapters; no unpointed payload, no temporary file) plus the project's
  files, taken while the mover owns the run, so nobody changes it meanwhile;
* the destination is checked (empty, or holding this run from a move to the same place) before
  the source changes, and claimed ``incoming`` before any file lands;
* its manifest (schema ``move-manifest``) is written unsealed first, as
  ``runs/<run>/move-<transfer>.json``, so that a rerun recognises its own partial copy, and
  sealed with every file's size and sha256 (hashed as it is copied) at the end; a rerun copies
  only files whose size or hash differ;
* every destination file is read back and hashed before the destination's control object is
  created.

A complete run is read-only: it is copied (verified the same way) and created at the destination
as complete, naming the source in its lineage; the source stays as it was.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import time
from collections.abc import Iterator
from typing import Any, BinaryIO

from spill.errors import StoreError, UsageError
from spill.hashing import CHUNK
from spill.paths import STATE_DIR
from spill.store import snapshot
from spill.store.fs import exists, is_local, join, open_read, put_bytes, stat


def add_parser(sub) -> None:
    from spill.jobs.commands import authority_options

    p = sub.add_parser(
        "move",
        usage="spill move [DIR] URI [--state URI] [--wait] [--json]",
        help="move a project's run (its state and files) to another folder or URI",
        description="Quiesce the run's writer at its next committed boundary, take the run, "
        "copy a consistent snapshot with a checksummed manifest, verify it, and hand the run "
        "over: afterwards `spill build URI` (or `spill resume URI`) continues there, and the "
        "source says where it went. Rerun the same command after any interruption.",
    )
    p.add_argument("where", nargs="+", metavar="[DIR] URI", help="the project (.) and where to")
    p.add_argument("--state", metavar="URI", help="the source's state (default DIR/.spill/)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    authority_options(p)
    p.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    if len(args.where) > 2:
        raise UsageError("spill move takes a project folder and a destination; see --help")
    src, to = (".", args.where[0]) if len(args.where) == 1 else args.where
    from spill.console import emit

    result = move(src, to, state=args.state, wait=args.wait, lease=args.lease)
    keys = None if args.json else ("run", "from", "to", "files", "bytes", "seconds", "status")
    emit(result, args.json, keys)
    return 0


# --- where things are --------------------------------------------------------------------------


def _abs(where: str) -> str:
    return os.path.abspath(where) if is_local(where) else where.rstrip("/")


def locations(src: str, to: str, state: str | None) -> tuple[str | None, str, str, str]:
    """(project root or None, source state, destination root, destination state)."""
    src, to = _abs(src), _abs(to)
    if to.startswith("memory://"):
        raise UsageError(
            f"{to}: memory:// lives only inside one process; move to a folder or an object store"
        )
    if exists(join(src, "spill.yaml")):
        src_state = _abs(state) if state else join(src, STATE_DIR)
        root: str | None = src
        dst_state = join(to, STATE_DIR)
    else:
        from spill.jobs.states import is_state

        if not is_state(src):
            raise UsageError(f"{src} is neither a project folder nor a state location")
        root, src_state, dst_state = None, src, to
    for a, b in ((src_state, to), (to, src_state), *(((root, to), (to, root)) if root else ())):
        if a == b or b.startswith(a.rstrip("/") + "/"):
            raise UsageError(f"{to} and {src} overlap; move to a location outside the project")
    return root, src_state, to, dst_state


# --- copying and checking ----------------------------------------------------------------------


@contextlib.contextmanager
def _writer(dst: str) -> Iterator[BinaryIO]:
    """A file to write ``dst`` through; locally it lands whole (a temporary name, fsynced,
    renamed), on an object store the upload completes when the block ends."""
    if not is_local(dst):
        from spill.store.fs import filesystem

        fs_, path = filesystem(dst)
        with fs_.open(path, "wb") as g:
            yield g
        return
    folder = os.path.dirname(dst)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".move-{os.getpid()}-{os.path.basename(dst)}")
    try:
        with open(tmp, "wb") as g:
            yield g
            g.flush()
            os.fsync(g.fileno())
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _copy(src: str, dst: str) -> tuple[int, str]:
    """Copy one file, streamed, hashing the bytes as they pass: (size, sha256)."""
    h, size = hashlib.sha256(), 0
    with open_read(src) as f, _writer(dst) as g:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            g.write(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def _manifest_uri(dst_state: str, run: str, tid: str) -> str:
    return join(dst_state, "runs", run, f"move-{tid}.json")


def _put_manifest(uri: str, manifest: dict[str, Any]) -> None:
    from spill.store.schemas import validate

    validate(manifest, "move-manifest", where=uri)
    put_bytes(uri, json.dumps(manifest, indent=1, sort_keys=True).encode() + b"\n")


def copy_snapshot(
    root: str | None, src_state: str, dst_root: str, dst_state: str, doc: dict[str, Any]
) -> dict[str, Any]:
    """Step 3: claim the destination with an unsealed manifest, copy the snapshot (hashing it
    in the same pass), then seal the manifest with every file's size and sha256. A rerun of
    the same transfer hashes both sides first and copies only what differs."""
    from spill.console import progress

    t = doc["transfer"]
    uri = _manifest_uri(dst_state, doc["run"], t["id"])
    fresh = not exists(uri)  # else a rerun of this transfer: its partial copy is there
    rels = snapshot.state_files(src_state, doc)
    files = [(join(src_state, r), f"{STATE_DIR}/{r}" if root else r) for r in rels]
    if root:
        files = [(join(root, r), r) for r in snapshot.project_files(root, src_state)] + files
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
    }
    _put_manifest(uri, manifest)  # the claim: a rerun of this transfer knows its partial copy

    def one(item: tuple[str, str]) -> dict[str, Any]:
        src, rel = item
        dst = join(dst_root, rel)
        done = None
        if not fresh and (have := stat(dst)) is not None:
            size, sha = snapshot.digest(src)
            if have[0] == size and snapshot.digest(dst)[1] == sha:
                done = size, sha
        size, sha = done or _copy(src, dst)
        bar.update(1)
        return {"path": rel, "size": size, "sha256": sha}

    with progress(len(files), "copy", "file") as bar:
        entries = _each(one, files, _workers(root or src_state, dst_root))
    manifest.update(sealed=True, files=entries, bytes=sum(e["size"] for e in entries))
    _put_manifest(uri, manifest)
    return manifest


def verify(dst_root: str, manifest: dict[str, Any]) -> None:
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


def _workers(src: str, dst: str) -> int:
    """Files copied (or read back) at once: one on local disks, where one stream is as fast as
    the disk; several when an object store is a side, whose requests wait on the network."""
    return 1 if is_local(src) and is_local(dst) else 4


def _each(fn, items: list, workers: int) -> list:
    """``[fn(x) for x in items]``, on ``workers`` threads; the first error is raised."""
    if workers == 1 or len(items) < 2:
        return [fn(x) for x in items]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, items))


# --- the verb ----------------------------------------------------------------------------------


def move(
    src: str, to: str, *, state: str | None = None, wait: bool = False, lease: float | None = None
) -> dict[str, Any]:
    """Move the run of project (or state location) ``src`` to ``to``; see the module doc."""
    from spill.console import note
    from spill.control import transfer
    from spill.control.cas import current, store_for

    t0 = time.monotonic()
    root, src_state, dst_root, dst_state = locations(src, to, state)
    src_store = store_for(src_state)
    dst_store = store_for(dst_state)  # a refused file system or object store says so now
    now = current(src_state)
    if now is None:
        raise StoreError(f"nothing to move at {src_state}: it holds no run")
    # a project's move names the project's new place (what `spill build` is given there)
    name = dst_root if root else dst_state
    transfer.check_destination(dst_store, dst_root, now["run"], name)
    doc = transfer.begin(src_store, name, wait=wait)
    if doc["status"] == "complete":
        return _copy_complete(root, src_state, (dst_root, dst_state, dst_store), doc, t0)
    t = doc["transfer"]
    note(
        f"moving run {doc['run']} from {src_state} to {dst_root} (transfer {t['id']}, step "
        f"{transfer.step_number(t['step'])} of 7 done)"
    )
    manifest = None
    if doc["status"] == "quiescing":
        if wait:
            note(f"waiting for the writer ({doc['owner']['host']} pid {doc['owner']['pid']})")
        run = transfer.take(src_store, t["id"], lease=lease)
        try:
            run.start_heartbeat()
            transfer.incoming(dst_store, run.doc, step="take")  # claimed before any file lands
            manifest = copy_snapshot(root, src_state, dst_root, dst_state, run.doc)
            transfer.step(run, "copy")
            verify(dst_root, manifest)
            transfer.step(run, "verify")
            transfer.incoming(dst_store, run.doc)
            transfer.step(run, "incoming")
            transfer.fence(run)
        finally:
            run.release()
    done = transfer.activate(dst_store, t["id"])
    if manifest is None:
        manifest = _read_manifest(dst_state, doc["run"], t["id"])
    return _result(done, src_state, dst_root, manifest, t0)


def _read_manifest(dst_state: str, run: str, tid: str) -> dict[str, Any]:
    from spill.store.fs import get_bytes
    from spill.store.schemas import parse_json, validate

    uri = _manifest_uri(dst_state, run, tid)
    doc = parse_json(get_bytes(uri))
    validate(doc, "move-manifest", where=uri)
    return doc


def _result(doc, src_state, dst_root, manifest, t0) -> dict[str, Any]:
    return {
        "run": doc["run"],
        "from": src_state,
        "to": dst_root,
        "files": len(manifest["files"]),
        "bytes": manifest["bytes"],
        "seconds": round(time.monotonic() - t0, 3),
        "status": doc["status"],
        "transfer": manifest["transfer"],
    }


def _copy_complete(root, src_state, dst, doc, t0) -> dict[str, Any]:
    """A complete run is read-only: copy it, verified, and create it complete at the
    destination (claimed ``incoming`` first, like a move); the source stays as it is."""
    from spill.console import note
    from spill.control import transfer
    from spill.control.cas import read_control
    from spill.control.owner import home_of

    dst_root, dst_state, dst_store = dst
    # one id per run and destination, so that a rerun after an interruption finds its claim
    tid = hashlib.sha256(f"{doc['run']}\0{dst_state}".encode()).hexdigest()[:16]
    there, _ = read_control(dst_store, doc["run"])
    if there is not None and there["status"] == "complete":
        return _result(there, src_state, dst_root, _read_manifest(dst_state, doc["run"], tid), t0)
    now = time.time()
    new = json.loads(json.dumps(doc))
    new["transfer"] = {
        "id": tid,
        "from": home_of(src_state),
        "to": dst_root if root else dst_state,
        "step": "take",
        "started": now,
        "at": now,
    }
    new["lineage"]["copied_from"] = doc["home"]
    note(f"run {doc['run']} is complete (read-only): copying it; the source stays as it is")
    transfer.incoming(dst_store, new, step="take")
    manifest = copy_snapshot(root, src_state, dst_root, dst_state, new)
    verify(dst_root, manifest)
    done = transfer.activate(dst_store, tid, status="complete")
    return _result(done, src_state, dst_root, manifest, t0)
