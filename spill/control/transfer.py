"""The control transitions of a move at its source: ``check_source``, ``begin`` (quiesce), ``take``,
``step`` (copy, verify, incoming), ``fence``, ``abort``, ``describe_move``. The destination's side
(its claim, ``incoming``, ``activate``) is ``spill.control.arrival``.

The invariant: the source is fenced before the destination is activated, and nobody but a mover of
the same transfer acquires a ``quiescing`` or ``incoming`` run (``ownership.refuse_moving``), so two
places are never both acquirable. ``abort`` returns a source that has not reached ``fence`` to its
status before the quiesce, at the next generation. Steps and drills: docs/move.md.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from typing import Any

from spill.control.control import Ownership, iso_time
from spill.control.keys import CONTROL, CURRENT, read_control, restore
from spill.control.owner import home_of, lease_seconds, me
from spill.control.ownership import CopiedRun, busy, holds_against
from spill.errors import StoreError, UsageError
from spill.store import drill
from spill.store.cas import ATTEMPTS, Conflict, Store, Uncertain
from spill.store.location import Location

# Each of a move's seven steps is a conditional transition of a control object (``spill.store.cas``)
# recorded in its ``transfer`` field, so a rerun continues where the move stopped; the destination's
# ``activate`` is the seventh.
STEPS = drill.MOVE_STEPS


def step_number(step: str) -> int:
    """1..7 for the seven steps; 0 for the destination's claim, made before them."""
    return STEPS.index(step) + 1 if step in STEPS else 0


def pending(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The transfer a source run stands under (quiescing or transferred, not aborted), if any."""
    t = doc.get("transfer")
    if t and not t.get("aborted") and doc["status"] in ("quiescing", "transferred"):
        return t
    return None


def check_source(doc: dict[str, Any], state: Location, to: Location, *, wait: bool) -> None:
    """Refuse, in one line, a source run that cannot be moved to ``to`` now: an installed copy,
    a run arriving from elsewhere, one in a move to another place, or one held by a live writer
    (unless ``wait``). Checked before the destination is claimed, and again by ``begin``."""
    t, status = doc.get("transfer"), doc["status"]
    if status == "copy":
        raise CopiedRun(
            f"run {doc['run']} at {state} is an installed copy; move the original "
            f"({doc['lineage']['copied_from']}) or fork it with `spill build --new-run`"
        )
    if status == "incoming":
        raise StoreError(
            f"run {doc['run']} at {state} is itself arriving from {t and t['from']}; finish "
            "that move first"
        )
    if status == "transferred" or status == "quiescing" and t:
        if t is None or t["to"] != to:
            where = t["to"] if t else "another place"
            more = "" if status == "transferred" else ", or `spill move --abort` to call it off"
            raise StoreError(
                f"run {doc['run']} at {state} is being moved (or was moved) to {where}, not "
                f"{to}; run `spill move` to {where} to finish it{more}"
            )
        return
    if status != "complete" and holds_against(doc, "", time.time()) and not wait:
        raise busy(doc, state, "; add --wait to stop it at its next committed boundary")


def read_current(store: Store) -> tuple[dict[str, Any], str | None]:
    """The current run's control object and tag, under the store's lock (a missing run list is
    rebuilt from the control objects, as an acquire does)."""
    runs, _ = restore(store)
    if runs is None:
        raise StoreError(f"nothing to move at {store.state}: it holds no run")
    doc, tag = read_control(store, runs["current"])
    if doc is None:
        raise StoreError(f"{store.uri(CURRENT)} names a run without a control object; damaged")
    return doc, tag


def write_control(store: Store, doc: dict[str, Any], tag: str | None, what: str) -> str:
    now = time.time()
    doc["seq"] += 1
    doc["last"] = {"op": f"{secrets.token_hex(8)}:{what}", "what": what, "at": now}
    doc["updated"] = iso_time(now)
    return store.put(f"{doc['run']}/{CONTROL}", doc, "control", tag)


def record_step(doc: dict[str, Any], step: str) -> None:
    doc["transfer"]["step"] = step
    doc["transfer"]["at"] = time.time()


def begin(
    src: Store, to: Location, *, wait: bool, tid: str | None = None, deadline: float | None = None
) -> dict[str, Any]:
    """Step 1: the source's run, quiescing under transfer ``tid`` (a new id when None) to ``to``,
    or under the transfer an interrupted move to the same place left. Returns the control
    document. ``deadline``: the time by which the quiesce must land (the destination's claim
    counts as live until then; a mover stopped past it claims again)."""
    for _ in range(ATTEMPTS):
        with src.exclusive():
            doc, tag = read_current(src)
            check_source(doc, src.state, to, wait=wait)
            if pending(doc) or doc["status"] == "complete":
                return doc  # an interrupted move to the same place (or a read-only run)
            now = time.time()
            if deadline is not None and now > deadline:
                raise StoreError(
                    f"this move was stopped for {now - deadline:.0f} s too long between claiming "
                    f"{to} and quiescing {src.state}; run it again"
                )
            before = {
                "status": doc["status"],
                "generation": doc["generation"],
                "released": doc["owner"]["released"],
            }
            doc["status"] = "quiescing"
            doc["transfer"] = {
                "id": tid or secrets.token_hex(8),
                "from": home_of(src.state),
                "to": to,
                "step": "quiesce",
                "started": now,
                "at": now,
                "before": before,
            }
            try:
                write_control(src, doc, tag, "move-quiesce")
            except (Conflict, Uncertain):
                continue  # read again: a writer's transition, or our own that landed
        drill.at(drill.MOVE_QUIESCE)
        return doc
    raise StoreError(f"{src.state}: could not start the move; try again")


def take(src: Store, tid: str, *, lease: float | None, poll: float = 0.5) -> Ownership:
    """Step 2: own the quiescing source run as the mover, at the next generation, once its
    writer stopped (released, gone, or its lease ran out)."""
    lease = lease_seconds(lease)
    nonce = secrets.token_hex(16)
    tries = 0
    while True:
        with src.exclusive():
            doc, tag = read_current(src)
            t = doc.get("transfer")
            if t is None or t["id"] != tid or doc["status"] != "quiescing":
                raise StoreError(
                    f"run {doc['run']} at {src.state} left the move (status {doc['status']}); "
                    "run `spill move` again"
                )
            if not holds_against(doc, nonce, time.time()):
                now = time.time()
                new = json.loads(json.dumps(doc))
                new.update(generation=doc["generation"] + 1, owner=me(nonce))
                new["lease"] = {"seconds": lease, "expires": now + lease}
                record_step(new, "take")
                try:
                    tag = write_control(src, new, tag, "move-take")
                except (Conflict, Uncertain):
                    tries += 1
                    continue
                run = Ownership(src, new, lease)
                run._tag = tag
                break
        time.sleep(min(poll, 0.02 * 2**tries))  # the writer is finishing its step
        tries += 1
    drill.at(drill.MOVE_TAKE)
    return run


def step(
    run: Ownership, name: str, *, done: Callable[[dict[str, Any]], None] | None = None
) -> None:
    """Record that step ``name`` is done, fenced by the mover's generation."""

    def change(d: dict[str, Any]) -> dict[str, Any]:
        record_step(d, name)
        if done is not None:
            done(d)
        return d

    run._transact(f"move-{name}", change)
    drill.at(f"move-{name}")


def fence(run: Ownership) -> None:
    """Step 6: the source is ``transferred`` (read-only, pointing at the destination)."""
    run.stop_heartbeat()

    def done(d: dict[str, Any]) -> None:
        d["status"] = "transferred"
        d["owner"]["released"] = True
        d["lease"]["expires"] = time.time()

    step(run, "fence", done=done)


def abort(src: Store, *, wait: bool = False, poll: float = 0.5) -> dict[str, Any]:
    """``spill move --abort``: return the source of a move that has not reached ``fence``; the
    control document after it. A move aborted already is returned as it is (a rerun of an
    abort that was interrupted cleans the destination it left)."""
    tries = 0
    while True:
        with src.exclusive():
            doc, tag = read_current(src)
            t, status, rid = doc.get("transfer"), doc["status"], doc["run"]
            if t and t.get("aborted"):
                return doc
            if status == "transferred":
                raise StoreError(
                    f"run {rid} at {src.state} is transferred (its destination may be active "
                    f"already); finish the move to {t['to'] if t else 'its destination'} by "
                    "running the same `spill move` again"
                )
            if status == "incoming":
                raise StoreError(
                    f"run {rid} at {src.state} is arriving from {t and t['from']}; abort the "
                    "move at its source (`spill move --abort` there)"
                )
            if status != "quiescing" or t is None:
                raise UsageError(f"run {rid} at {src.state} is not in a move; nothing to abort")
            now = time.time()
            if not holds_against(doc, "", now):
                new = json.loads(json.dumps(doc))
                before = t.get("before") or {}
                new["status"] = before.get("status", "active")
                new["generation"] = doc["generation"] + 1
                new["owner"] = {**me(secrets.token_hex(16)), "released": True}
                new["lease"]["expires"] = now
                new["transfer"].update(aborted=now, at=now)
                try:
                    write_control(src, new, tag, "move-abort")
                except (Conflict, Uncertain):
                    tries += 1
                    continue
                break
            if not wait:
                raise busy(doc, src.state, f" (the move to {t['to']}, step {t['step']} done)")
        time.sleep(min(poll, 0.02 * 2**tries))
        tries += 1
    drill.at(drill.MOVE_ABORT)
    return new


def describe_move(doc: dict[str, Any]) -> str | None:
    """What ``spill status`` says of a run's move: in progress (which step), done, or aborted."""
    t = doc.get("transfer")
    if not t:
        return None
    n = step_number(t["step"])
    if t.get("aborted"):
        return (
            f"the move to {t['to']} was aborted at {iso_time(t['aborted'])} (after step {n} of 7)"
        )
    if doc["status"] == "transferred":
        return f"moved to {t['to']} at {iso_time(t['at'])}; continue there"
    if doc["status"] in ("quiescing", "incoming"):
        side = f"to {t['to']}" if doc["status"] == "quiescing" else f"from {t['from']}"
        return f"moving {side}: step {n} of {len(STEPS)} ({t['step']}) done"
    if t["step"] != "activate":  # the move was abandoned for a build that finished the run
        return None
    return f"moved here from {t['from']} at {iso_time(t['at'])}"
