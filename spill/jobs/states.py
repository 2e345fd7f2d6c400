"""A state location seen from outside: whether a path or URI is one (it holds runs), what its
current run has committed, and the view ``spill status <state>`` prints for it.
"""

from __future__ import annotations

import os
from typing import Any

from spill.store.fs import is_local


def is_state(where: str) -> bool:
    """Whether ``where`` is a state location (it holds runs), not a project folder."""
    from spill.control.runlist import has_runs

    if is_local(where) and os.path.isfile(os.path.join(where, "spill.yaml")):
        return False
    return has_runs(where)


def progress(where: str, doc: dict[str, Any]) -> str:
    """The last committed step (and cursor) or row count of the run at ``where``."""
    from spill.control.place import Place
    from spill.payloads.checkpoint import newest_commit
    from spill.payloads.rows import commit_markers

    place = Place(where)
    if (found := newest_commit(place)) is not None:
        step, state = found
        total = (state.get("hyperparameters") or {}).get("steps", "?")
        return f"step {step} of {total} committed, cursor {state.get('cursor', '?')}"
    if "rows" in doc["pointers"]:
        return f"{sum(int(m.get('count', 0)) for m in commit_markers(place))} rows committed"
    if "state" in doc["pointers"]:
        from spill.project import state as build_state

        recs = (build_state.read(where) or {}).get("stages") or {}
        done = [f"{n} {r['status']} ({r['progress']} of {r['total']})" for n, r in recs.items()]
        return "; ".join(done) or "nothing committed yet"
    return "nothing committed yet"


def summary(where: str) -> dict[str, Any]:
    """``spill status <state>``: the current run, its owner and lease, and its progress."""
    from spill.control.keys import current
    from spill.control.runlist import missing_note
    from spill.errors import StoreError
    from spill.project.status import run_view

    doc = current(where)
    if doc is None:
        raise StoreError(f"no run at {where}")
    notes = [line] if (line := missing_note(where)) else []
    return {"state": where, **run_view(where), "progress": progress(where, doc), "notes": notes}
