"""A build's state location: ``state.json`` and light probes of each stage's job state.

Layout under ``--state`` (default ``<project>/.spill``)::

    state.json            the plan, every stage's status, inputs, result and producers
    stages/<stage>/       the stage's job state (tune: ckpt/, row jobs: rows/)
    files/                the split, the teacher's answers, graded rows
    adapters/<name>/      the tuned adapter (spill, PEFT and MLX-LM layouts)

``state.json`` (schema ``build-state``) is one object written atomically through
``spill.store.fs`` after everything it names; a reader that finds none starts fresh. Writing
validates it, and so does reading (its ``config`` too, against the strict spill.yaml schema,
and each stage's result), through ``schemas.validate_once``: bytes already validated on this
machine (by a read, or by the write that made them) cost one hash, so ``spill status`` and a
build of a finished project still start without importing jsonschema.

The probes read only small files: the newest committed tune checkpoint's ``state.json`` and
the row segments' commit markers. They say how far a stopped stage got and which engine,
machine and OS produced it; they do not verify hashes (the jobs do, when they continue).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from spill.errors import StoreError
from spill.store.fs import get_bytes, join, listdir, put_bytes

STAGES = ("eval:base", "distill", "tune", "eval")
NEEDS = {"tune": ("distill",), "eval": ("tune",)}  # the stages whose output a stage reads
ALIASES = {"train": "tune"}
DIRS = {"eval:base": "eval-base", "distill": "distill", "tune": "tune", "eval": "eval"}
UNITS = {"eval:base": "row", "distill": "row", "tune": "step", "eval": "row"}
STATE = "state.json"
KIND = "spill-build"
SCHEMA_VERSION = 1
PRODUCER_KEYS = ("engine", "numerics", "machine", "os", "hardware")
_STEP = re.compile(r"step-(\d+)")
_SEG = re.compile(r"seg-(\d+)\.commit")


def stage_uri(root: str, stage: str) -> str:
    return join(root, "stages", DIRS[stage])


def read(root: str) -> dict[str, Any] | None:
    """``state.json`` under ``root`` (None when there is none), validated against the
    ``build-state`` schema, its ``config`` against the strict spill.yaml schema."""
    from spill.store.schemas import parse_json, short, validate_once

    uri = join(root, STATE)
    try:
        raw = get_bytes(uri)
    except FileNotFoundError:
        return None
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
    from spill.store.schemas import short

    try:
        validate(doc["config"], "config")
    except ConfigError as e:
        raise StoreError(f"{uri} holds a damaged {e}; move it away to rebuild") from None
    for name, rec in doc["stages"].items():
        try:
            summarize(name, rec["result"])
        except (KeyError, TypeError, ValueError) as e:
            raise StoreError(
                f"{uri} holds a damaged result of stage {name} ({short(repr(e), 60)}); "
                "move it away to rebuild"
            ) from None


def write(root: str, doc: dict[str, Any]) -> None:
    from spill.store.schemas import remember, validate

    uri = join(root, STATE)
    validate(doc, "build-state", where=uri)
    _check_more(doc, uri)
    raw = json.dumps(doc, indent=1, sort_keys=True, allow_nan=False).encode() + b"\n"
    put_bytes(uri, raw)
    remember(raw, "build-state")  # what ``read`` checks, checked: its next read costs a hash


def summarize(stage: str, result: Mapping[str, Any]) -> str:
    """A stage's result in a few words (the table and the plan's ``done`` reasons)."""
    if not result:
        return ""
    if stage in ("eval:base", "eval"):
        if result.get("accuracy") is None:
            return f"{result.get('rows', 0)} rows graded"
        text = f"accuracy {result['accuracy']:.3f} ({result['correct']}/{result['rows']})"
        if result.get("gold_logprob_per_token") is not None:
            text += f", logprob/token {result['gold_logprob_per_token']:.3f}"
        return text
    if stage == "tune":
        loss = result.get("loss")
        return f"{result['step']} of {result['steps']} steps" + (
            f", loss {loss:.4f}" if loss is not None else ""
        )
    if stage == "distill":
        return f"{result['rows']} rows answered" + (
            f", {result['truncated']} cut at max_new_tokens" if result.get("truncated") else ""
        )
    return ""


def _json(uri: str) -> dict:
    """A small JSON object a probe reads; ``{}`` when it is missing, damaged or no object (a
    probe reports what it can; the job that continues verifies everything)."""
    from spill.store.schemas import parse_json

    try:
        doc = parse_json(get_bytes(uri))
    except (FileNotFoundError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _producer(p: Any) -> dict:
    p = p if isinstance(p, dict) else {}
    return {k: v if isinstance(v := p.get(k), str) else None for k in PRODUCER_KEYS}


def _distinct(producers: list[dict]) -> list[dict]:
    out: list[dict] = []
    for p in producers:
        p = _producer(p)
        if p not in out:
            out.append(p)
    return out


def probe(root: str, stage: str) -> tuple[int, list[dict]]:
    """(steps or rows committed, distinct producers) from a stage's job state."""
    where = stage_uri(root, stage)
    if stage == "tune":
        base = join(where, "ckpt")
        steps = sorted((int(m[1]), n) for n in listdir(base) if (m := _STEP.fullmatch(n)))
        for step, name in reversed(steps):
            if "COMMIT" in listdir(join(base, name)):
                producers = _json(join(base, name, "state.json")).get("producers")
                return step, _distinct(producers if isinstance(producers, list) else [])
        return 0, []
    rows, producers = 0, []
    base = join(where, "rows")
    for name in sorted(listdir(base), key=lambda n: int(m[1]) if (m := _SEG.fullmatch(n)) else -1):
        if _SEG.fullmatch(name) and (commit := _json(join(base, name))):
            count = commit.get("count")
            rows += count if type(count) is int and count > 0 else 0
            producers.append(commit.get("producer", {}))
    return rows, _distinct(producers)


def recorded(root: str, doc: dict[str, Any] | None) -> dict:
    """The planner's view of a state: records of finished stages with the check of their outputs
    (and, when those are missing or changed, what can restore them), probes of unfinished ones."""
    from spill.project import outputs
    from spill.project.plan import Recorded

    out = {}
    project = ((doc or {}).get("project") or {}).get("name", "")
    for name, rec in ((doc or {}).get("stages") or {}).items():
        done, problem, source = rec.get("progress", 0), "", ""
        if rec["status"] in ("running", "stopped"):
            done = probe(root, name)[0]
        if rec["status"] == "done":
            problem = outputs.problem(root, name, project, rec.get("outputs"))
            source = outputs.source(root, name, rec["total"]) if problem else ""
        result = rec.get("result") or {}
        out[name] = Recorded(
            rec["status"], rec["fingerprint"], rec.get("inputs", {}), done, result, problem, source
        )
    return out
