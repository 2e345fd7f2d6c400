"""The newest committed tune checkpoint's ``state.json``, read without numpy or hashing.

``spill status`` and ``spill report`` of a finished build read a tune stage's loss series and
producer ranges from here; ``spill.payloads.checkpoint`` (which imports numpy for the tensors)
keeps the formats and re-exports ``newest_commit`` and the names below.
"""

from __future__ import annotations

from typing import Any

from spill.control.place import Place, payload_seq
from spill.ground.validate import parse_json, validate_once
from spill.store.fs import exists, get_bytes, join

KIND = "ckpt"  # the run's pointer to its checkpoint folders
STATE = "state.json"
COMMIT = "COMMIT"


def newest_commit(place: Place) -> tuple[int, dict[str, Any]] | None:
    """The newest pointed step and its ``state.json`` (``{}`` if unreadable), read without
    hashing the tensors: a light progress probe (what a job trusts is ``latest_checkpoint``).
    A ``state.json`` that parses but does not match its schema (a producer range whose
    ``to_step`` is a string, say) is refused in one line naming it (``SchemaInvalid``), so no
    reader computes with its fields; a checked one costs one hash the next time."""
    for uri in place.pointer(KIND):
        if not exists(join(uri, COMMIT)):
            continue  # pointed at, but its folder is gone (removed by hand)
        where = join(uri, STATE)
        try:
            raw = get_bytes(where)
            state = parse_json(raw)
        except (FileNotFoundError, ValueError):
            return payload_seq(uri), {}
        if not isinstance(state, dict):
            return payload_seq(uri), {}
        validate_once(raw, state, "checkpoint-state", where)
        return payload_seq(uri), state
    return None
