"""A build's state location: ``state.json`` and light probes of each stage's job state
(``recorded``). Its layout under ``--state`` (default ``<project>/.spill``): the comment at
``STATE``.

``write`` (the owner only) publishes ``state.json`` (schema ``build-state``) after everything it
names; ``read`` follows the pointer and validates once per bytes
(``spill.ground.validate.validate_once``).
"""

from __future__ import annotations

import json
from typing import Any

from spill.control.control import Ownership
from spill.control.place import Place
from spill.errors import StoreError
from spill.ground.validate import parse_json, short, validate_once
from spill.project.build import stages
from spill.store.fs import exists, get_bytes, join, put_bytes
from spill.store.location import Location

# Layout under ``--state``:
#   runs/                 the build's runs and their control objects (``spill.control.control``)
#   payloads/state-.../   ``state.json``: the plan, every stage's status, inputs, result and
#                         producers; current when the run's ``state`` pointer names it
#   stages/<stage>/       the stage's job state (its payloads: checkpoints, row segments)
#   files/                the split, the teacher's answers, graded rows
#   adapters/<name>/      the tuned adapter (spill, PEFT and MLX-LM layouts)
STATE = "state.json"
KIND_POINTER = "state"  # the run's pointer to the current state.json payload
KIND = "spill-build"
SCHEMA_VERSION = 1


def read(root: Location) -> dict[str, Any] | None:
    """The current ``state.json`` of the build at ``root`` (None when there is none), validated
    against the ``build-state`` schema, its ``config`` against the strict spill.yaml schema."""
    pointed = Place(root).pointer(KIND_POINTER)
    if not pointed:
        if exists(join(root, STATE)):
            raise StoreError(
                f"{join(root, STATE)} was written by an older spill (no runs/ beside it); move "
                f"{root} away to rebuild"
            )
        return None
    uri = join(pointed[0], STATE)
    try:
        raw = get_bytes(uri)
    except FileNotFoundError:
        raise StoreError(
            f"{uri} is missing; the state was damaged: move it away to rebuild"
        ) from None
    try:
        doc = parse_json(raw)
    except ValueError:
        raise StoreError(f"{uri} is not JSON; it was damaged: move it away to rebuild") from None
    if not isinstance(doc, dict) or doc.get("kind") != KIND:
        raise StoreError(f"{uri} is not a spill build state; use another --state location")
    if doc.get("schema_version") != SCHEMA_VERSION:
        raise StoreError(
            f"{uri} has build-state version {short(repr(doc.get('schema_version')), 40)}; this "
            f"spill reads {SCHEMA_VERSION}; use the spill that wrote it or another --state"
        )
    validate_once(raw, doc, "build-state", uri, also=lambda d: _check_more(d, uri))
    return doc


def _check_more(doc: dict[str, Any], uri: str) -> None:
    """What the schema leaves open: the config (strict spill.yaml) and each stage's result."""
    from spill.project.config import ConfigError, validate

    try:
        validate(doc["config"], "config")
    except ConfigError as e:
        raise StoreError(f"{uri} holds a damaged {e}; move it away to rebuild") from None
    for name, rec in doc["stages"].items():
        try:
            stages.get(name).summarize(rec["result"])
        except (KeyError, TypeError, ValueError) as e:
            raise StoreError(
                f"{uri} holds a damaged result of stage {name} ({short(repr(e), 60)}); "
                "move it away to rebuild"
            ) from None


def write(run: Ownership, doc: dict[str, Any]) -> None:
    """Write ``doc`` as a new payload and make it current (fenced: only the run's owner can)."""
    from spill.ground.validate import remember, validate  # not config's validate (_check_more)

    place = run.place()
    target = place.payload(KIND_POINTER, run.doc["seq"])
    uri = join(target, STATE)
    validate(doc, "build-state", where=uri)
    _check_more(doc, uri)
    raw = json.dumps(doc, indent=1, sort_keys=True, allow_nan=False).encode() + b"\n"
    put_bytes(uri, raw)
    remember(raw, "build-state")  # what ``read`` checks, checked: its next read costs a hash
    place.publish(KIND_POINTER, [target])
    place.collect(KIND_POINTER, {target})


def recorded(root: Location, doc: dict[str, Any] | None) -> dict:
    """The planner's view of a state: records of finished stages with the check of their outputs
    (and, when those are missing or changed, what can restore them), probes of unfinished ones."""
    from spill.project.build.plan import Recorded  # the planner's vocabulary: not on the fast path

    out = {}
    project = ((doc or {}).get("project") or {}).get("name", "")
    for name, rec in ((doc or {}).get("stages") or {}).items():
        stage = stages.get(name)
        done, problem, source = rec.get("progress", 0), "", ""
        if rec["status"] in ("running", "stopped"):
            done = stage.probe(root)[0]
        if rec["status"] == "done":
            problem = stage.problem(root, project, rec.get("outputs"))
            source = stage.source(root, rec["total"]) if problem else ""
        result = rec.get("result") or {}
        out[name] = Recorded(
            rec["status"], rec["fingerprint"], rec.get("inputs", {}), done, result, problem, source
        )
    return out
