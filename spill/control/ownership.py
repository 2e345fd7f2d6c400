"""Starting and acquiring a state location's run: ``acquire`` and ``held``. docs/authority.md.

``acquire`` makes this process the owner of the current run at the next generation when the run is
free (no owner, released, lease expired, or a gone process on this host and boot), else raises
``Busy`` (exit 75) or, with ``wait``, polls. Two processes never start two runs in one place; a
missing list is rebuilt (``keys.restore``), never started afresh. A state copied from elsewhere may
not continue while the original's owner holds it, where the original can be read.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any

from spill.control.control import SCHEMA_VERSION, Busy, Ownership, RunComplete, Superseded, iso_time
from spill.control.keys import (
    CONTROL,
    CURRENT,
    controls,
    current,
    has_runs,
    read_control,
    read_runs,
    restore,
    run_list,
    store_for,
)
from spill.control.owner import describe, gone, home_of, host, lease_seconds, me
from spill.control.place import generations
from spill.errors import StoreError
from spill.store import drill
from spill.store.cas import ATTEMPTS, Conflict, LockHeld, Store, Uncertain
from spill.store.location import Location, from_home, shown_home


def _new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


def next_generation(store: Store) -> int:
    """A new run's generation: above every control object's and every payload folder's here."""
    docs = controls(store)
    gens = [d["generation"] for d in docs.values()] + generations(store.state)
    return max(gens, default=0) + 1


def _fresh(
    run: str,
    owner: dict,
    lease: float,
    home: str,
    parent: str | None,
    pointers: dict,
    generation: int,
) -> dict[str, Any]:
    now = time.time()
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "spill-control",
        "run": run,
        "status": "active",
        "generation": generation,
        "seq": 1,
        "owner": owner,
        "lease": {"seconds": lease, "expires": now + lease},
        "home": home,
        "pointers": pointers,
        "lineage": {"parent": parent, "copied_from": None},
        "last": {"op": f"{owner['nonce']}:0", "what": "create", "at": now},
        "created": iso_time(now),
        "updated": iso_time(now),
    }


def holds_against(doc: dict[str, Any], nonce: str, now: float) -> bool:
    """Whether ``doc``'s owner still holds the run against us."""
    o = doc["owner"]
    if o["nonce"] == nonce or o["released"]:
        return False
    if doc["lease"]["expires"] <= now:
        return False
    return not gone(o)


def busy(doc: dict[str, Any], state: Location, extra: str = "") -> Busy:
    return Busy(
        f"run {doc['run']} at {state} is held by {describe(doc)}{extra}; try again later, "
        "or add --wait to wait for it"
    )


def acquire(
    state: Location,
    *,
    lease: float | None = None,
    wait: bool = False,
    new_run: bool = False,
    poll: float = 0.5,
) -> Ownership:
    """Own the current run at ``state`` (creating the first one), at its next generation.

    ``new_run``: when the current run is complete (a build whose inputs changed after
    completion) or an installed copy (``spill build --new-run``), start a new run from its
    pointers, whose lineage names it as the parent. Without it a complete run raises
    ``RunComplete``. A held run raises ``Busy`` unless ``wait``, which polls until it is free.
    """
    lease = lease_seconds(lease)
    _refuse_nested(state)
    store = store_for(state)
    nonce = secrets.token_hex(16)
    tries = 0
    while True:
        try:
            run = _try_acquire(store, nonce, lease, new_run)
        except (Busy, LockHeld):
            if not wait:
                raise
            # soon at first (a killed owner may still be dying), then every ``poll`` seconds
            time.sleep(min(poll, 0.02 * 2**tries))
            tries += 1
            continue
        drill.at(drill.CONTROL_ACQUIRE)
        return run


# The first run of a location and a new run after a completed one (``acquire(new_run=True)``) are
# created by a conditional write of ``runs/current.json``, so two processes never start two runs in
# one place.
def _try_acquire(store: Store, nonce: str, lease: float, new_run: bool) -> Ownership:
    home = home_of(store.state)
    for _ in range(ATTEMPTS):
        with store.exclusive():
            runs, runs_tag = restore(store)  # a missing list: rebuilt from the control objects
            now = time.time()
            if runs is None or new_run and _forkable(store, runs):
                parent = None if runs is None else read_control(store, runs["current"])[0]
                rid = _new_run_id()
                gen = next_generation(store)  # above every generation here: no name reused
                ptrs = dict(parent["pointers"]) if parent else {}
                doc = _fresh(rid, me(nonce), lease, home, parent and parent["run"], ptrs, gen)
                # the run's control object first (a new key, no contention), then the list
                try:
                    store.put(f"{rid}/{CONTROL}", doc, "control", None)
                except (Conflict, Uncertain):
                    # a new random key: a conflict is our own retried create that landed
                    got, _ = read_control(store, rid)
                    if got is None or got["last"]["op"] != doc["last"]["op"]:
                        continue
                try:
                    listing = run_list([*(runs["runs"] if runs else []), rid])
                    store.put(CURRENT, listing, "runs", runs_tag)
                except (Conflict, Uncertain):
                    got, _ = read_runs(store)
                    if got is not None and got["current"] == rid:
                        return Ownership(store, doc, lease)
                    continue  # someone else started a run here first: compete for theirs
                return Ownership(store, doc, lease)
            rid = runs["current"]
            doc, tag = read_control(store, rid)
            if doc is None:
                raise StoreError(
                    f"{store.uri(CURRENT)} names run {rid}, which has no control object; the "
                    "state was copied incompletely"
                )
            if doc["status"] == "complete":
                raise RunComplete(f"run {rid} at {store.state} is complete and read-only")
            refuse_moving(doc, store.state)
            if doc["home"] != home:
                _check_copy(doc, home)
            if holds_against(doc, nonce, now):
                raise busy(doc, store.state)
            new = json.loads(json.dumps(doc))
            new.update(generation=doc["generation"] + 1, seq=doc["seq"] + 1, status="active")
            new["owner"] = me(nonce)
            new["lease"] = {"seconds": lease, "expires": now + lease}
            if doc["home"] != home:
                new["lineage"]["copied_from"] = doc["home"]
                new["home"] = home
            new["last"] = {"op": f"{nonce}:0", "what": "acquire", "at": now}
            new["updated"] = iso_time(now)
            try:
                store.put(f"{rid}/{CONTROL}", new, "control", tag)
            except (Conflict, Uncertain):
                got, _ = read_control(store, rid)
                if got is not None and got["last"]["op"] == f"{nonce}:0":
                    return Ownership(store, got, lease)
                continue
            return Ownership(store, new, lease)
    raise StoreError(f"{store.state}: could not acquire its run; try again")


OUTER_WRITES = ("stages", "payloads", "runs")  # what a run writes below its location


def _refuse_nested(state: Location) -> None:
    """A location inside another run's location (a build's ``.spill/stages/tune``) is that run's
    to write: its own run would collect the other's payloads there (same names, generations
    counted apart), so it is refused in one line."""
    outer = outer_state(state)
    if outer is not None:
        raise StoreError(
            f"{state} lies inside {outer}, which holds runs of its own (a build's state); "
            f"continue it there (spill build / spill resume {outer}), or give another --state"
        )


def outer_state(state: Location, every: bool = False) -> Location | None:
    """The location holding runs whose own folders (``stages``, ``payloads``, ``runs``; with
    ``every`` any folder, as ``spill move`` asks of a destination) hold ``state``, if any."""
    full, above = state.canonical, state.parents()
    for outer in above:
        inside = full[len(outer) :].strip("/").split("/")[0]
        if not every and inside not in OUTER_WRITES:  # a sweep's builds under .spill/sweep/
            continue
        if has_runs(outer):
            return outer
    return None


def _forkable(store: Store, runs: dict[str, Any]) -> bool:
    """Whether the current run may be the parent of a new one: complete, or an installed copy."""
    doc, _ = read_control(store, runs["current"])
    return doc is not None and doc["status"] in ("complete", "copy")


class CopiedRun(StoreError):
    """An installed copy of a run that stays authoritative elsewhere: fork it, never continue it."""


def refuse_moving(doc: dict[str, Any], state: Location) -> None:
    """Refuse, in one line, a run that may not be acquired here: a copy, or a run in a move."""
    rid, t = doc["run"], doc.get("transfer")
    if doc["status"] == "copy":
        raise CopiedRun(
            f"run {rid} at {state} is a copy (of {doc['lineage']['copied_from']}), which stays "
            "authoritative; `spill build DIR --new-run` forks a new run from its committed state"
        )
    if doc["status"] == "transferred":
        to, at = (t["to"], iso_time(t["at"])) if t else ("another place", "?")
        raise StoreError(f"run {rid} moved to {to} at {at}; continue there")
    if doc["status"] == "incoming":
        frm = t["from"] if t else "another place"
        raise StoreError(
            f"run {rid} at {state} is arriving from {frm} (a move, step {t and t['step']}); run "
            "the same `spill move` again to finish it"
        )
    if doc["status"] == "quiescing" and t is not None:
        raise StoreError(
            f"run {rid} at {state} is being moved to {t['to']} (step {t['step']} done); run the "
            "same `spill move` again to finish it, or `spill move --abort` to call it off"
        )


def _check_copy(doc: dict[str, Any], home: str) -> None:
    """A state copied from elsewhere may not continue while the original's owner holds it."""
    original = from_home(doc["home"], host())
    if original is None:
        return  # another machine: the copied lease decides (as where the original moved away)
    try:
        theirs = current(original)
    except (StoreError, OSError):
        return
    if (
        theirs is not None
        and theirs["run"] == doc["run"]
        and holds_against(theirs, "", time.time())
    ):
        here = shown_home(home)
        raise busy(theirs, original, f" (this state at {here} is a copy of it)")


# --- a job's view: its folder, its pointers, its payloads --------------------------------------


@contextlib.contextmanager
def held(
    state: Location,
    *,
    lease: float | None = None,
    wait: bool = False,
    on_lost: Callable[[Superseded], None] | None = None,
) -> Iterator[Ownership]:
    """Own the run at ``state`` for the block, heartbeat included; released when it ends,
    however it ends (a completed run stays complete)."""
    run = acquire(state, lease=lease, wait=wait)
    run.start_heartbeat(on_lost)
    try:
        yield run
    finally:
        run.release()


def is_held(doc: dict[str, Any]) -> bool:
    """Whether a live owner holds the run ``doc`` now (its lease running, its process alive)."""
    return holds_against(doc, "", time.time())


def as_copy(doc: dict[str, Any], state: Location) -> tuple[dict[str, Any], dict[str, Any]]:
    """The control object and run list of a copy of run ``doc`` installed at ``state``: status
    ``copy`` (never continued; ``spill build --new-run`` forks from it), released, its lineage
    naming where the original is."""
    now = time.time()
    new = json.loads(json.dumps(doc))
    new.update(status="copy", seq=doc["seq"] + 1, home=home_of(state), transfer=None)
    new["owner"]["released"] = True
    new["lease"]["expires"] = now
    new["lineage"]["copied_from"] = doc["home"]
    new["last"] = {"op": f"{secrets.token_hex(16)}:0", "what": "install", "at": now}
    new["updated"] = iso_time(now)
    return new, run_list([doc["run"]])
