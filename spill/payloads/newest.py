"""The newest committed tune checkpoint's ``state.json``, read without numpy or hashing.

``spill status`` and ``spill report`` of a finished build read a tune stage's loss series and
producer ranges from here; ``spill.payloads.checkpoint`` (which imports numpy for the tensors)
keeps the formats and re-exports ``newest_commit`` and the names below.
"""

from __future__ import annotations

from typing import Any

from spill.control.place import Place, payload_seq
from spill.store.fs import exists, get_bytes, join
from spill.validate import parse_json

KIND = "ckpt"  # the run's pointer to its checkpoint folders
STATE = "state.json"
COMMIT = "COMMIT"


def newest_commit(place: Place) -> tuple[int, dict[str, Any]] | None:
    """The newest pointed step and its ``state.json`` (``{}`` if unreadable), read without
    hashing anything: a light progress probe (what a job trusts is ``latest_checkpoint``)."""
    for uri in place.pointer(KIND):
        if not exists(join(uri, COMMIT)):
            continue  # pointed at, but its folder is gone (removed by hand)
        try:
            state = parse_json(get_bytes(join(uri, STATE)))
        except (FileNotFoundError, ValueError):
            state = {}
        return payload_seq(uri), state if isinstance(state, dict) else {}
    return None
