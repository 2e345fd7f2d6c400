"""``spill move [DIR] URI`` (``move``): hand a project's run (its state and its files) to another
place; ``spill move --abort [DIR]`` (``abort``): call off a move that cannot (or should not) finish,
removing this transfer's claim and partial copy at the destination, never anything else there. A
complete run is copied, not moved. What a user sees, step by step: docs/move.md.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from typing import Any

from spill.console import note
from spill.control import arrival, transfer
from spill.control.arrival import manifest_uri
from spill.control.keys import current, read_control, store_for
from spill.control.owner import home_of, lease_seconds
from spill.errors import StoreError, UsageError
from spill.ground.paths import STATE_DIR
from spill.ground.validate import parse_json, validate
from spill.project.move import checks
from spill.project.move.checks import locations
from spill.project.move.copy import copy_snapshot, verify
from spill.store import drill
from spill.store.fs import get_bytes
from spill.store.location import Location, location


def _places(src: Location, to: Location, state: Location | None):
    """Checks 1 to 4 (``move_checks``): the places and their stores."""
    root, src_state, dst_root, dst_state = locations(src, to, state)
    src_store = store_for(src_state)
    dst_store = store_for(dst_state)  # a refused file system or object store says so now
    checks.check_place(dst_root)
    return root, src_state, (dst_root, dst_state, dst_store), src_store


def _claim(
    root, src_state, dst, doc, name, lease, tid=None, moving=False, exports=False
) -> tuple[str, float]:
    """Checks 6 to 9, then the destination's claim: (transfer id, the quiesce's deadline).
    ``tid``: the transfer's id when it has one already; ``moving``: the source is in it;
    ``exports``: the exports go too (``--with-exports``)."""
    dst_root, _, dst_store = dst
    frm = home_of(src_state)
    for gone in arrival.check_destination(dst_store, dst_root, doc, frm, name, mine=tid):
        t = gone["transfer"]
        note(
            f"removed a claim at {dst_root} that nobody will finish (run {gone['run']} from "
            f"{t['from']}, transfer {t['id']}, step {t['step']} done)"
        )
    files = checks.snapshot_files(root, src_state, doc, exports)
    checks.check_room(dst_root, files, STATE_DIR if root else "", doc["run"], moving)
    drill.at(drill.MOVE_CHECKED)
    lease = lease_seconds(lease)
    tid = tid or secrets.token_hex(8)
    tid, ends = arrival.claim(
        dst_store, doc, tid, frm, name, lease=lease, nonce=secrets.token_hex(16)
    )
    return tid, ends - lease / 2


def _gave_back(src_store, why: Exception, name: str) -> StoreError:
    """The source of a move whose destination is someone else's now, returned (``abort``)."""
    doc = transfer.abort(src_store)
    what = str(why).split("; ")[0]
    return StoreError(
        f"{what}, not this move's claim: the move of run {doc['run']} to {name} is aborted, and "
        f"the run is {doc['status']} again at {src_store.state} (generation {doc['generation']}); "
        "move it to another place"
    )


# ``move`` checks the destination (``spill.project.move.checks``), claims it (``arrival.claim``),
# then walks the control steps (``spill.control.transfer``), copying the snapshot under a manifest
# and reading it back (``spill.project.move.copy``) while the mover owns the run.
def move(
    src: Location,
    to: Location,
    *,
    state: Location | None = None,
    wait: bool = False,
    lease: float | None = None,
    with_exports: bool = False,
) -> dict[str, Any]:
    """Move the run of project (or state location) ``src`` to ``to`` (docs/move.md); the merged
    models under ``exports/`` stay where they were made unless ``with_exports``."""
    t0 = time.monotonic()
    root, src_state, dst, src_store = _places(src, to, state)
    dst_root, dst_state, dst_store = dst
    now = current(src_state)
    if now is None:
        raise StoreError(f"nothing to move at {src_state}: it holds no run")
    # a project's move names the project's new place (what `spill build` is given there)
    name = dst_root if root else dst_state
    if now["status"] == "complete":
        return _copy_complete(root, src_state, dst, now, name, t0, with_exports)
    transfer.check_source(now, src_state, name, wait=wait)
    was = transfer.pending(now)
    doc = now
    if now["status"] != "transferred":  # fenced already: only the activation is left
        try:
            tid, deadline = _claim(
                root, src_state, dst, now, name, lease, was and was["id"], bool(was), with_exports
            )
        except arrival.Taken as e:
            if was:
                raise _gave_back(src_store, e, name) from None
            raise
        except StoreError as e:
            if was and "spill move --abort" not in str(e):  # the source is in the move: a way back
                raise StoreError(f"{e} (or `spill move --abort` calls the move off)") from None
            raise
        try:
            doc = transfer.begin(src_store, name, wait=wait, tid=tid, deadline=deadline)
        except BaseException:
            if not was:  # the source changed since it was read: the claim made now goes
                arrival.remove_claim(dst_store, dst_root, now["run"], tid)
            raise
        if doc["status"] == "complete":  # finished meanwhile by its writer: copied instead
            arrival.remove_claim(dst_store, dst_root, now["run"], tid)
            return _copy_complete(root, src_state, dst, doc, name, t0, with_exports)
        if doc["transfer"]["id"] != tid:
            raise StoreError(
                f"run {doc['run']} at {src_state} is being moved to {name} by another `spill "
                f"move` (transfer {doc['transfer']['id']}); let it finish"
            )
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
            try:  # the claim confirmed under the mover's generation, before any file lands
                arrival.incoming(dst_store, run.doc, step="take")
            except arrival.Taken as e:
                run.release()
                raise _gave_back(src_store, e, name) from None
            manifest = copy_snapshot(root, src_state, dst_root, dst_state, run.doc, with_exports)
            transfer.step(run, "copy")
            verify(dst_root, manifest)
            transfer.step(run, "verify")
            arrival.incoming(dst_store, run.doc)
            transfer.step(run, "incoming")
            transfer.fence(run)
        finally:
            run.release()
    done = arrival.activate(dst_store, t["id"])
    if manifest is None:
        manifest = _read_manifest(dst_state, doc["run"], t["id"])
    return _result(done, src_state, dst_root, manifest, t0)


# ``abort`` returns the source (``transfer.abort``) and removes this transfer's claim and partial
# copy at the destination (``arrival.remove_claim``).
def abort(
    src: Location,
    to: Location | None = None,
    *,
    state: Location | None = None,
    wait: bool = False,
) -> dict[str, Any]:
    """``spill move --abort``: return the source of an unfinished move and remove what the
    move left at its destination."""
    root, src_state = checks.source(src, state)
    src_store = store_for(src_state)
    now = current(src_state)
    if now is None:
        raise StoreError(f"nothing to abort at {src_state}: it holds no run")
    t = now.get("transfer") or {}
    if to is not None and t.get("to") not in (to.absolute, to.absolute.join(STATE_DIR)):
        raise UsageError(
            f"run {now['run']} at {src_state} is not being moved to {to.absolute}; "
            "`spill move --abort [DIR]` calls off the move it is in"
        )
    again = bool(t.get("aborted"))
    doc = transfer.abort(src_store, wait=wait)
    t = doc["transfer"]
    dst_root = location(t["to"])  # as the source's control object records it
    dst_state = dst_root.join(STATE_DIR) if root else dst_root
    try:
        cleaned = arrival.remove_claim(store_for(dst_state), dst_root, doc["run"], t["id"])
    except StoreError as e:
        raise StoreError(
            f"run {doc['run']} is {doc['status']} again at {src_state} (generation "
            f"{doc['generation']}), but its claim at {dst_root} was not removed ({e}); run "
            "`spill move --abort` again"
        ) from None
    note(
        f"{'the move was aborted already' if again else 'move aborted'}: run {doc['run']} is "
        f"{doc['status']} at {src_state} (generation {doc['generation']}); "
        + (
            f"its claim and partial copy at {dst_root} removed"
            if cleaned
            else f"{dst_root} untouched"
        )
    )
    return {
        "run": doc["run"],
        "from": src_state,
        "to": dst_root,
        "status": doc["status"],
        "generation": doc["generation"],
        "transfer": t["id"],
        "destination": "cleaned" if cleaned else "untouched",
    }


def _read_manifest(dst_state: Location, run: str, tid: str) -> dict[str, Any]:
    uri = manifest_uri(dst_state, run, tid)
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


def _copy_complete(root, src_state, dst, doc, name, t0, exports=False) -> dict[str, Any]:
    """A complete run is read-only: copy it, verified, and create it complete at the
    destination (checked and claimed first, like a move); the source stays as it is."""
    dst_root, dst_state, dst_store = dst
    # one id per run and destination, so that a rerun after an interruption finds its claim
    tid = hashlib.sha256(f"{doc['run']}\0{dst_state}".encode()).hexdigest()[:16]
    there, _ = read_control(dst_store, doc["run"])
    if (
        there is not None
        and there["status"] == "complete"
        and (there.get("transfer") or {}).get("id") == tid
    ):
        return _result(there, src_state, dst_root, _read_manifest(dst_state, doc["run"], tid), t0)
    now = time.time()
    new = json.loads(json.dumps(doc))
    new["transfer"] = {
        "id": tid,
        "from": home_of(src_state),
        "to": name,
        "step": "claim",
        "started": now,
        "at": now,
    }
    new["lineage"]["copied_from"] = doc["home"]
    _claim(root, src_state, dst, new, name, None, tid, exports=exports)
    note(f"run {doc['run']} is complete (read-only): copying it; the source stays as it is")
    manifest = copy_snapshot(root, src_state, dst_root, dst_state, new, exports)
    verify(dst_root, manifest)
    done = arrival.activate(dst_store, tid, status="complete")
    return _result(done, src_state, dst_root, manifest, t0)
