"""A state location seen from outside: whether a path or URI is one (it holds runs), and what a
job's current run there has committed (``spill.project.status.progress`` adds a build's).
"""

from __future__ import annotations

import os
from typing import Any

from spill.store.location import location


def is_state(where: str) -> bool:
    """Whether ``where`` is a state location (it holds runs), not a project folder."""
    from spill.control.runlist import has_runs

    if location(where).local and os.path.isfile(os.path.join(where, "spill.yaml")):
        return False
    return has_runs(where)


def progress(where: str, doc: dict[str, Any]) -> str | None:
    """The last committed step (and cursor) or row count of the job whose run is at ``where``,
    or None when it has committed neither (a build's state, or nothing yet)."""
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
    return None
