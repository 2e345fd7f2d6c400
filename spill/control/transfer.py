"""The control transitions of a move: a run handed from one state location to another.

A move is seven steps, each a conditional transition of a control object (``spill.control.cas``)
recorded in its ``transfer`` field (id, from, to, step, times), so that running the move again
after an interruption anywhere continues it:

1. ``quiesce``  the source's status becomes ``quiescing`` (a live writer notices within
                ``control.WATCH`` seconds, or at its next transition, and stops at a
                committed boundary, exit 75);
2. ``take``     the mover owns the source run at the next generation (still ``quiescing``);
3. ``copy``     the snapshot is copied (``spill.project.move``), recorded as done;
4. ``verify``   the destination was read back and every checksum matched;
5. ``incoming`` the destination's control object is created as ``incoming``;
6. ``fence``    the source becomes ``transferred``, naming the destination (from now on it only
                says ``moved to <uri> at <time>; continue there``);
7. ``activate`` the destination becomes ``active`` and released: any machine may acquire it.

Nobody but a mover of the same transfer acquires a ``quiescing`` (with a transfer) or
``incoming`` run (``runs.refuse_moving``), and the source is fenced before the destination is
activated, so at no moment may two places be acquired. Crash points for kill drills
(``spill.store.drill``), each right after its step's write: ``move-<step>``.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from typing import Any

from spill.control.cas import (
    ATTEMPTS,
    CONTROL,
    CURRENT,
    Store,
    _Conflict,
    _Uncertain,
    read_control,
    read_runs,
    run_list,
)
from spill.control.control import Run, _iso
from spill.control.owner import home_of, lease_seconds, me
from spill.control.runs import CopiedRun, _busy, _holder
from spill.errors import StoreError
from spill.store import drill

STEPS = drill.MOVE_STEPS


def step_number(step: str) -> int:
    return STEPS.index(step) + 1


def _read(store: Store) -> tuple[dict[str, Any], str | None]:
    runs, _ = read_runs(store)
    if runs is None:
        raise StoreError(f"nothing to move at {store.state}: it holds no run")
    doc, tag = read_control(store, runs["current"])
    if doc is None:
        raise StoreError(f"{store.uri(CURRENT)} names a run without a control object; damaged")
    return doc, tag


def _write(store: Store, doc: dict[str, Any], tag: str | None, what: str) -> str:
    now = time.time()
    doc["seq"] += 1
    doc["last"] = {"op": f"{secrets.token_hex(8)}:{what}", "what": what, "at": now}
    doc["updated"] = _iso(now)
    return store.put(f"{doc['run']}/{CONTROL}", doc, "control", tag)


def _record(doc: dict[str, Any], step: str) -> None:
    doc["transfer"]["step"] = step
    doc["transfer"]["at"] = time.time()


def begin(src: Store, to: str, *, wait: bool, poll: float = 0.5) -> dict[str, Any]:
    """Step 1: the source's run, quiescing under a transfer to ``to`` (a new one, or the one
    an interrupted move to the same place left). Returns the control document."""
    for _ in range(ATTEMPTS):
        with src.exclusive():
            doc, tag = _read(src)
            t, status = doc.get("transfer"), doc["status"]
            if status == "copy":
                raise CopiedRun(
                    f"run {doc['run']} at {src.state} is an installed copy; move the original "
                    f"({doc['lineage']['copied_from']}) or fork it with `spill build --new-run`"
                )
            if status in ("transferred", "incoming") or status == "quiescing" and t:
                if t is None or t["to"] != to or status == "incoming":
                    where = t["to"] if t else "another place"
                    if status == "incoming":
                        raise StoreError(
                            f"run {doc['run']} at {src.state} is itself arriving from "
                            f"{t and t['from']}; finish that move first"
                        )
                    raise StoreError(
                        f"run {doc['run']} at {src.state} is being moved (or was moved) to "
                        f"{where}, not {to}; run `spill move` to {where} to finish it"
                    )
                return doc  # an interrupted move to the same place: continue it
            if status == "complete":
                return doc  # read-only: copied as it is, see move.py
            if _holder(doc, "", time.time()) and not wait:
                raise _busy(
                    doc, src.state, "; add --wait to stop it at its next committed boundary"
                )
            now = time.time()
            doc["status"] = "quiescing"
            doc["transfer"] = {
                "id": secrets.token_hex(8),
                "from": home_of(src.state),
                "to": to,
                "step": "quiesce",
                "started": now,
                "at": now,
            }
            try:
                _write(src, doc, tag, "move-quiesce")
            except (_Conflict, _Uncertain):
                continue  # read again: a writer's transition, or our own that landed
        drill.at(drill.MOVE_QUIESCE)
        return doc
    raise StoreError(f"{src.state}: could not start the move; try again")


def take(src: Store, tid: str, *, lease: float | None, poll: float = 0.5) -> Run:
    """Step 2: own the quiescing source run as the mover, at the next generation, once its
    writer stopped (released, gone, or its lease ran out)."""
    lease = lease_seconds(lease)
    nonce = secrets.token_hex(16)
    tries = 0
    while True:
        with src.exclusive():
            doc, tag = _read(src)
            t = doc.get("transfer")
            if t is None or t["id"] != tid or doc["status"] != "quiescing":
                raise StoreError(
                    f"run {doc['run']} at {src.state} left the move (status {doc['status']}); "
                    "run `spill move` again"
                )
            if not _holder(doc, nonce, time.time()):
                now = time.time()
                new = json.loads(json.dumps(doc))
                new.update(generation=doc["generation"] + 1, owner=me(nonce))
                new["lease"] = {"seconds": lease, "expires": now + lease}
                _record(new, "take")
                try:
                    tag = _write(src, new, tag, "move-take")
                except (_Conflict, _Uncertain):
                    tries += 1
                    continue
                run = Run(src, new, lease)
                run._tag = tag
                break
        time.sleep(min(poll, 0.02 * 2**tries))  # the writer is finishing its step
        tries += 1
    drill.at(drill.MOVE_TAKE)
    return run


def step(run: Run, name: str, *, done: Callable[[dict[str, Any]], None] | None = None) -> None:
    """Record that step ``name`` is done, fenced by the mover's generation."""

    def change(d: dict[str, Any]) -> dict[str, Any]:
        _record(d, name)
        if done is not None:
            done(d)
        return d

    run._transact(f"move-{name}", change)
    drill.at(f"move-{name}")


def fence(run: Run) -> None:
    """Step 6: the source is ``transferred`` (read-only, pointing at the destination)."""
    run.stop_heartbeat()

    def done(d: dict[str, Any]) -> None:
        d["status"] = "transferred"
        d["owner"]["released"] = True
        d["lease"]["expires"] = time.time()

    step(run, "fence", done=done)


def incoming(dst: Store, doc: dict[str, Any], step: str = "incoming") -> None:
    """The destination's run list and control object, ``incoming`` under this transfer (created,
    or replaced when an interrupted mover of the same transfer made them). The mover claims the
    destination so before it copies anything (``step`` the source's last, so that nobody
    acquires a partial copy), and confirms it as step 5 once the copy is verified."""
    rid, tid = doc["run"], doc["transfer"]["id"]
    new = json.loads(json.dumps(doc))
    new["home"] = home_of(dst.state)
    new["status"] = "incoming"
    _record(new, step)
    with dst.exclusive():
        runs, runs_tag = read_runs(dst)
        if runs is not None and runs["current"] != rid:
            raise StoreError(
                f"{dst.state} already holds run {runs['current']}; move to an empty location"
            )
        there, tag = read_control(dst, rid)
        if there is not None:
            t = there.get("transfer") or {}
            if there["status"] != "incoming" or t.get("id") != tid:
                raise StoreError(
                    f"{dst.state} holds run {rid} already ({there['status']}); nothing to move"
                )
            new["seq"] = there["seq"]
        _write(dst, new, tag, "move-incoming")
        if runs is None:
            dst.put(CURRENT, run_list([rid]), "runs", runs_tag)


def activate(dst: Store, tid: str, status: str = "active") -> dict[str, Any]:
    """Step 7: the incoming destination becomes ``active`` (a copied complete run: ``complete``)
    and free to acquire."""
    for _ in range(ATTEMPTS):
        with dst.exclusive():
            doc, tag = _read(dst)
            t = doc.get("transfer") or {}
            if t.get("id") != tid:
                raise StoreError(f"{dst.state} holds run {doc['run']} of another move")
            if doc["status"] != "incoming":
                return doc  # activated already (an interrupted mover's last step landed)
            doc["status"] = status
            doc["owner"]["released"] = True
            doc["lease"]["expires"] = time.time()
            _record(doc, "activate")
            try:
                _write(dst, doc, tag, "move-activate")
            except (_Conflict, _Uncertain):
                continue
        drill.at(drill.MOVE_ACTIVATE)
        return doc
    raise StoreError(f"{dst.state}: could not activate the moved run; run `spill move` again")


def check_destination(dst: Store, root: str, run: str, to: str) -> None:
    """Before the source changes: the destination is empty, or it holds this run arriving from
    (or moved in by) a move to the same place, which a rerun continues."""
    from spill.store.fs import files_under

    there, _ = read_control(dst, run)
    if there is not None and (there.get("transfer") or {}).get("to") == to:
        return
    stray = [r for r in files_under(root) if r]
    if stray:
        raise StoreError(f"{root} is not empty ({stray[0]}, ...); move to a new or empty location")


def describe_move(doc: dict[str, Any]) -> str | None:
    """What ``spill status`` says of a run's move: in progress (which step), or done."""
    t = doc.get("transfer")
    if not t:
        return None
    n = step_number(t["step"])
    if doc["status"] == "transferred":
        return f"moved to {t['to']} at {_iso(t['at'])}; continue there"
    if doc["status"] in ("quiescing", "incoming"):
        side = f"to {t['to']}" if doc["status"] == "quiescing" else f"from {t['from']}"
        return f"moving {side}: step {n} of {len(STEPS)} ({t['step']}) done"
    if t["step"] != "activate":  # the move was abandoned for a build that finished the run
        return None
    return f"moved here from {t['from']} at {_iso(t['at'])}"
