"""The destination's side of a move: ``check_destination``, ``claim``, ``incoming``, ``activate``,
and ``remove_claim`` when the move is aborted. The source's side is ``spill.control.transfer``; the
protocol and its reasons: docs/move.md.

``check_destination`` runs before anything is written and refuses (``Taken``) a destination that is
not empty and not this run's under a move to the same place. ``remove_claim`` removes only the given
transfer's claim, never a file of another run.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from spill.control.keys import CURRENT, LOCK, RUNS, current, read_control, read_runs, run_list
from spill.control.owner import home_of, host, me
from spill.control.ownership import holds_against
from spill.control.transfer import pending, read_current, record_step, write_control
from spill.errors import StoreError
from spill.ground.validate import parse_json, validate
from spill.store import drill
from spill.store.cas import ATTEMPTS, Conflict, Store, Uncertain
from spill.store.fs import files_under, get_bytes, join, prune_empty, remove, remove_named
from spill.store.location import Location, from_home

_ELSEWHERE = "move to a new or empty location"


class Taken(StoreError):
    """The destination holds another run, another move's claim, or files of its own."""


def manifest_uri(dst_state: Location, run: str, tid: str) -> str:
    return join(dst_state, RUNS, run, f"move-{tid}.json")


def _what(doc: dict[str, Any]) -> str:
    t = doc.get("transfer") or {}
    if doc["status"] == "incoming":
        return (
            f"a claim of another move (run {doc['run']} from {t.get('from')}, step "
            f"{t.get('step')} done)"
        )
    return f"run {doc['run']} ({doc['status']})"


def _source(home: str) -> Location | None:
    """The state location a claim's ``from`` names, where this process can read it."""
    return from_home(home, host())


def abandoned(doc: dict[str, Any]) -> bool:
    """Whether the destination's claim ``doc`` is one nobody will finish (docs/move.md)."""
    if doc["status"] != "incoming" or holds_against(doc, "", time.time()):
        return False
    t = doc.get("transfer") or {}
    where = _source(t.get("from") or "")
    if where is None:
        return False
    try:
        theirs = current(where)
    except (StoreError, OSError):
        return False
    if theirs is None or theirs["run"] != doc["run"]:
        return True
    return (pending(theirs) or {}).get("id") != t.get("id")


def _adoptable(there: dict[str, Any], frm: str, to: Location, src_tid: str | None) -> bool:
    t = there.get("transfer") or {}
    return (
        there["status"] == "incoming"
        and t.get("step") == "claim"
        and (t.get("from"), t.get("to")) == (frm, to)
        and t.get("id") != src_tid
    )


# A claim nobody will finish (``abandoned``) is removed first; anything else is ``Taken``.
def check_destination(
    dst: Store, root: Location, src: dict[str, Any], frm: str, to: Location, mine: str | None = None
) -> list[dict[str, Any]]:
    """Before anything is written: refuse (``Taken``) a destination ``root`` that is not empty
    and not this run's under a move to ``to`` (``mine``: the transfer id, when the source does
    not say it); the abandoned claims it removed first."""
    mine = mine or (pending(src) or {}).get("id")
    removed = []
    runs, _ = read_runs(dst)
    if runs is not None:
        rid = runs["current"]
        there, _ = read_control(dst, rid)
        if there is None:
            raise Taken(
                f"{dst.uri(CURRENT)} names run {rid}, which has no control object; move to a "
                "new or empty location"
            )
        t = there.get("transfer") or {}
        if rid == src["run"] and t.get("to") == to and t.get("from") == frm:
            if there["status"] != "incoming" or t.get("id") == mine:
                return removed  # this move's claim, or the run it moved (or copied) here
            if _adoptable(there, frm, to, (src.get("transfer") or {}).get("id")):
                return removed  # this move's own claim, made before its quiesce: adopted
        if not abandoned(there):
            raise Taken(f"{root} holds {_what(there)}; {_ELSEWHERE}")
        remove_claim(dst, root, rid, t["id"])
        removed.append(there)
    found, lock = files_under(root), join(dst.state, RUNS, LOCK)
    if found == [""]:
        raise Taken(f"{root} is a file; {_ELSEWHERE}")
    stray = [r for r in found if join(root, r) != lock]
    if stray:
        raise Taken(f"{root} is not empty ({stray[0]}, ...); {_ELSEWHERE}")
    return removed


# The claim is made before the source is quiesced, so of two moves to one place the second loses
# before its source changes.
def claim(
    dst: Store,
    src: dict[str, Any],
    tid: str,
    frm: str,
    to: Location,
    *,
    lease: float,
    nonce: str,
) -> tuple[str, float]:
    """Claim the destination for run ``src`` (the source's control document) under transfer
    ``tid``: (the transfer id the claim stands under, when its lease ends)."""
    rid, src_tid = src["run"], (src.get("transfer") or {}).get("id")
    for _ in range(ATTEMPTS):
        with dst.exclusive():
            runs, runs_tag = read_runs(dst)
            if runs is not None and runs["current"] != rid:
                other, _ = read_control(dst, runs["current"])
                shown = _what(other) if other else f"run {runs['current']}"
                raise Taken(f"{dst.state} holds {shown} now; {_ELSEWHERE}")
            there, tag = read_control(dst, rid)
            if there is not None and (there.get("transfer") or {}).get("id") != tid:
                if not _adoptable(there, frm, to, src_tid):
                    raise Taken(f"{dst.state} holds {_what(there)} now; {_ELSEWHERE}")
                tid = there["transfer"]["id"]  # a mover stopped before its quiesce: go on with it
            elif there is not None and there["status"] != "incoming":
                raise Taken(f"{dst.state} holds {_what(there)} now; {_ELSEWHERE}")
            now = time.time()
            new = json.loads(json.dumps(src))
            new.update(home=home_of(dst.state), status="incoming", owner=me(nonce))
            new["lease"] = {"seconds": lease, "expires": now + lease}
            new["transfer"] = {
                "id": tid,
                "from": frm,
                "to": to,
                "step": "claim",
                "started": now,
                "at": now,
            }
            if there is not None:
                new["seq"] = there["seq"]
            try:
                write_control(dst, new, tag, "move-claim")
                if runs is None:
                    dst.put(CURRENT, run_list([rid]), "runs", runs_tag)
            except (Conflict, Uncertain):
                continue  # read again: another claim, or our own write that landed
        drill.at(drill.MOVE_CLAIM)
        return tid, now + lease
    raise StoreError(f"{dst.state}: could not claim it for the move; try again")


def incoming(dst: Store, doc: dict[str, Any], step: str = "incoming") -> None:
    """The destination's control object replaced, ``incoming`` under this transfer, from the
    source's document ``doc`` (owned by the mover): after the take (``step`` "take": the claim
    confirmed, so that nobody acquires a partial copy) and as step 5 once the copy is verified.
    A destination that no longer holds this transfer's claim is ``Taken``."""
    rid, tid = doc["run"], doc["transfer"]["id"]
    new = json.loads(json.dumps(doc))
    new["home"] = home_of(dst.state)
    new["status"] = "incoming"
    record_step(new, step)
    for _ in range(ATTEMPTS):
        with dst.exclusive():
            runs, _ = read_runs(dst)
            there, tag = read_control(dst, rid)
            t = (there or {}).get("transfer") or {}
            if runs is None or runs["current"] != rid or there is None:
                other = runs and read_control(dst, runs["current"])[0]
                shown = _what(other) if other else "nothing"
                raise Taken(f"{dst.state} holds {shown}, not the claim of this move")
            if there["status"] != "incoming" or t.get("id") != tid:
                raise Taken(f"{dst.state} holds {_what(there)}, not the claim of this move")
            new["seq"] = there["seq"]
            try:
                write_control(dst, new, tag, "move-incoming")
            except (Conflict, Uncertain):
                continue
        return
    raise StoreError(f"{dst.state}: could not record the move there; run `spill move` again")


def activate(dst: Store, tid: str, status: str = "active") -> dict[str, Any]:
    """Step 7: the incoming destination becomes ``active`` (a copied complete run: ``complete``)
    and free to acquire."""
    for _ in range(ATTEMPTS):
        with dst.exclusive():
            doc, tag = read_current(dst)
            t = doc.get("transfer") or {}
            if t.get("id") != tid:
                raise StoreError(f"{dst.state} holds run {doc['run']} of another move")
            if doc["status"] != "incoming":
                return doc  # activated already (an interrupted mover's last step landed)
            doc["status"] = status
            doc["owner"]["released"] = True
            doc["lease"]["expires"] = time.time()
            record_step(doc, "activate")
            try:
                write_control(dst, doc, tag, "move-activate")
            except (Conflict, Uncertain):
                continue
        drill.at(drill.MOVE_ACTIVATE)
        return doc
    raise StoreError(f"{dst.state}: could not activate the moved run; run `spill move` again")


def _claimed_paths(dst: Store, rid: str, tid: str) -> list[str]:
    """What the transfer's manifest says it copies (none: it copied nothing yet). Only a valid
    manifest is read: its paths are relative and never climb out (``..``) of the destination."""
    uri = manifest_uri(dst.state, rid, tid)
    try:
        m = parse_json(get_bytes(uri))
        validate(m, "move-manifest", where=uri)
    except FileNotFoundError:
        return []
    except (ValueError, StoreError):  # not the manifest a mover writes: nothing to go by
        return []
    return list(m.get("paths") or [e["path"] for e in m["files"]])


def remove_claim(dst: Store, root: Location, rid: str, tid: str) -> bool:
    """Remove transfer ``tid``'s claim of run ``rid`` at ``root``; False when
    there is none (removed already, or never made) or it is not that transfer's."""
    with dst.exclusive():
        runs, _ = read_runs(dst)
        there, _ = read_control(dst, rid)
        if there is not None:
            t = there.get("transfer") or {}
            if there["status"] != "incoming" or t.get("id") != tid:
                return False
            rels = _claimed_paths(dst, rid, tid)
            for rel in rels:
                remove(join(root, rel))
            for folder in {os.path.dirname(r) for r in rels}:  # a mover killed mid-file left
                remove_named(join(root, folder), ".move-")  # `.move-<pid>-<name>` beside it
            remove(join(dst.state, RUNS, rid))  # its control object and manifest
        elif runs is None or runs["current"] != rid:
            return False
        if runs is not None and runs["runs"] == [rid]:
            remove(dst.uri(CURRENT))
    prune_empty(root)
    return True
