"""The relay's checks (``check``, ``check_files``): a build handed from one place to another, judged
against an uninterrupted reference build of the same project and the measured noise floor. Each
check is one row of the final table: both builds complete; each eval stage's accuracy within the
project's tolerance in ``noise-floor.json`` (no tolerance, no pass); tuned beats base; no step or
row missing or repeated; the run arrived by a finished ``spill move``; and each stage's recorded
producers match the leg that ran it, as ``legs.json`` (``record_leg``) wrote it on that leg's
machine. Everything here reads state; nothing loads a model.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

from spill.control.keys import current
from spill.errors import UsageError
from spill.ground.paths import STATE_DIR
from spill.jobs.producer import os_name
from spill.payloads.newest import newest_commit
from spill.payloads.rows import commit_markers
from spill.project.build import record
from spill.project.build.stages import EVAL, EVAL_BASE, TUNE, RowStage
from spill.project.report.status import run_view
from spill.store.fs import exists, get_bytes, join
from spill.store.location import Location, location

SCORE = "accuracy"
WHO = ("engine", "machine", "os")  # what a leg record and a producer must agree on


def leg(engine: str) -> dict[str, str]:
    """What this machine is, as a producer records it, running ``engine``."""
    return {"engine": engine, "machine": platform.node() or "unknown", "os": os_name()}


def record_leg(path: Path, name: str, engine: str) -> dict[str, str]:
    """Add leg ``name`` (this machine, ``engine``) to the legs file at ``path``."""
    legs = json.loads(path.read_text()) if path.is_file() else {}
    legs[name] = leg(engine)
    path.write_text(json.dumps(legs, indent=1, sort_keys=True) + "\n")
    return legs[name]


def _who(p: dict[str, Any]) -> dict[str, Any]:
    return {k: p.get(k) for k in WHO}


def _show(p: dict[str, Any]) -> str:
    return f"{p.get('engine')} on {p.get('machine')} ({(p.get('os') or '').split(' (')[0]})"


def _row(check: str, reference: Any, relay: Any, ok: bool, tolerance: Any = "") -> dict[str, Any]:
    return {
        "check": check,
        "reference": reference,
        "relay": relay,
        "tolerance": tolerance,
        "ok": "ok" if ok else "FAIL",
    }


def _complete(stages: dict[str, Any]) -> bool:
    return bool(stages) and all(r.get("status") in ("done", "skipped") for r in stages.values())


def _score(stages: dict[str, Any], name: str) -> float | None:
    return ((stages.get(name) or {}).get("result") or {}).get(SCORE)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def tune_ledger(root: Location) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The newest committed tune checkpoint's state and its producer ranges."""
    found = newest_commit(TUNE.place(root))
    if found is None:
        return None, []
    return found[1], list(found[1].get("producers") or [])


def steps_once(ckpt: dict[str, Any] | None, ranges: list[dict[str, Any]], steps: int) -> str:
    """Why the ranges do not cover ``0..steps`` exactly once, or ``""``."""
    if ckpt is None:
        return "no committed tune checkpoint"
    at = 0
    for r in ranges:
        if r["from_step"] != at:
            what = "repeated" if r["from_step"] < at else "missing"
            lo, hi = sorted((at, r["from_step"]))
            return f"steps {lo}-{hi} {what}"
        at = r["to_step"]
    if at != steps or ckpt.get("step") != steps:
        return f"the checkpoint ends at step {ckpt.get('step')} (ranges to {at}), not {steps}"
    if len(ckpt.get("losses") or []) != steps:
        return f"{len(ckpt.get('losses') or [])} losses for {steps} steps"
    return ""


def row_ledger(root: Location, stage: RowStage) -> list[dict[str, Any]]:
    """The commit markers of a row stage's committed segments (row ids and producer each)."""
    return commit_markers(stage.place(root))


def rows_once(markers: list[dict[str, Any]], ids: list[Any]) -> str:
    """Why the segments do not hold each of ``ids`` exactly once, or ``""``."""
    seen: list[Any] = [i for m in markers for i in m.get("row_ids") or []]
    twice = sorted({i for i in seen if seen.count(i) > 1}, key=str)
    missing = sorted(set(ids) - set(seen), key=str)
    extra = sorted(set(seen) - set(ids), key=str)
    parts = []
    for what, found in (("repeated", twice), ("missing", missing), ("not held out", extra)):
        if found:
            parts.append(f"{len(found)} rows {what} (first {found[0]!r})")
    return "; ".join(parts)


def _test_ids(root: Location, stage: RowStage) -> list[Any]:
    data = get_bytes(join(root, "files", stage.reads)).decode()
    return [json.loads(line)["id"] for line in data.splitlines() if line.strip()]


def _ran_on(producers: list[dict[str, Any]], want: dict[str, Any]) -> str:
    """Why a list of producers was not all made by ``want``, or ``""``."""
    if not producers:
        return "no producer recorded"
    wrong = [p for p in producers if _who(p) != _who(want)]
    return f"recorded {_show(wrong[0])}" if wrong else ""


# The tolerance is six honest builds' spread plus one row (``bench/noise_floor.py``). Steps and rows
# are read from the committed state: the checkpoint's producer ranges cover ``0..steps`` with one
# loss per step, each row stage holds every held-out id once. One producer on both legs leaves one
# checkpoint range, which must be theirs.
def check(
    reference: dict[str, Any],
    relay_root: str,
    legs: dict[str, dict[str, Any]],
    floor: dict[str, Any],
    stop: int,
) -> list[dict[str, Any]]:
    """Every check of a relay at ``relay_root`` (a project folder or URI), as table rows.

    ``reference``: the reference build's ``spill status --json``; ``legs``: what ran legs ``a``
    and ``b``; ``floor``: the noise-floor JSON; ``stop``: the step leg ``a`` stopped at."""
    where = location(relay_root).join(STATE_DIR)  # the command line's text, parsed once
    doc = record.read(where) if exists(where) else None
    ref, got = reference.get("stages") or {}, (doc or {}).get("stages") or {}
    run = run_view(where) if doc else None
    out = [
        _row(
            "both builds complete",
            "complete" if _complete(ref) else "incomplete",
            (run or {}).get("status", "no build"),
            _complete(ref) and _complete(got) and (run or {}).get("status") == "complete",
        )
    ]
    name = (doc or reference).get("project", {})
    name = name.get("name") if isinstance(name, dict) else name
    measured = (floor.get("projects") or {}).get(name)
    for stage in (EVAL_BASE, EVAL):
        a, b = _score(ref, stage.name), _score(got, stage.name)
        tol = ((measured or {}).get("stages", {}).get(stage.name) or {}).get(SCORE, {})
        tol = tol.get("tolerance")
        ok = None not in (a, b, tol) and abs(a - b) <= tol + 1e-9
        builds = (measured or {}).get("builds", "?")
        shown = "not measured" if tol is None else f"±{tol:.3f} ({builds} builds)"
        out.append(_row(f"{stage.name} {SCORE}", _fmt(a), _fmt(b), ok, shown))
    base, tuned = _score(got, EVAL_BASE.name), _score(got, EVAL.name)
    out.append(
        _row(
            "tuned beats base",
            f"{_fmt(_score(ref, EVAL.name))} > {_fmt(_score(ref, EVAL_BASE.name))}",
            f"{_fmt(tuned)} > {_fmt(base)}",
            None not in (base, tuned) and tuned > base,
        )
    )
    if doc is None:
        return out
    steps = int((got.get(TUNE.name) or {}).get("total") or 0)
    ckpt, ranges = tune_ledger(where)
    why = steps_once(ckpt, ranges, steps)
    spans = ", ".join(f"{r['from_step']}-{r['to_step']} {r['engine']}" for r in ranges)
    out.append(_row(f"tune steps 0-{steps} once", steps, why or spans, not why))
    markers = {stage.name: row_ledger(where, stage) for stage in (EVAL_BASE, EVAL)}
    for stage in (EVAL_BASE, EVAL):
        why = rows_once(markers[stage.name], _test_ids(where, stage))
        n = (got.get(stage.name) or {}).get("total")
        out.append(_row(f"{stage.name} rows once", n, why or f"{n} rows", not why))
    a, b = legs.get("a") or {}, legs.get("b") or {}
    for stage, who in ((EVAL_BASE, a), (EVAL, b)):
        made = [m.get("producer") or {} for m in markers[stage.name]]
        why = _ran_on(made, who) if who else "no leg record"
        out.append(_row(f"{stage.name} ran on", "", _show(who) if not why else why, not why))
    out.append(_moved_in(where))
    if a and b and _who(a) == _who(b):
        # one engine on one machine for both legs: a producer range is one producer, so the
        # legs' steps are one range; the handoff is the move the row above checks
        why = _ran_on(ranges, a)
        shown = f"0-{steps} {_show(a)}, both legs (one producer: one range)" if not why else why
        out.append(_row("tune ran on", "", shown, not why))
        return out
    before = [r for r in ranges if r["to_step"] <= stop]
    after = [r for r in ranges if r["from_step"] >= stop]
    why = "" if len(before) + len(after) == len(ranges) else f"no range ends at step {stop}"
    why = why or ("" if a else "no leg record a") or _ran_on(before, a)
    why = why or ("" if b else "no leg record b") or _ran_on(after, b)
    shown = f"0-{stop} {_show(a)}; {stop}-{steps} {_show(b)}" if not why else why
    out.append(_row("tune ran on", "", shown, not why))
    return out


def _moved_in(where: Location) -> dict[str, Any]:
    """The relay's run arrived by a move from another place (its control object says so)."""
    doc = current(where) or {}
    t = doc.get("transfer") or {}
    ok = t.get("step") == "activate" and bool(t.get("from")) and t.get("from") != t.get("to")
    shown = f"from {t.get('from')}" if ok else f"no finished move recorded ({t.get('step')})"
    return _row("moved between two places", "", shown, ok)


def passed(rows: list[dict[str, Any]]) -> bool:
    return all(r["ok"] == "ok" for r in rows)


def _read_json(path: str, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: cannot read the {what} ({e})") from None
    if not isinstance(doc, dict):
        raise UsageError(f"{path}: the {what} is not a JSON object")
    return doc


def check_files(reference: str, relay_root: str, legs: str, floor: str, stop: int) -> list[dict]:
    """``check`` with the reference's status, the legs and the noise floor read from the JSON
    files ``relay-check`` names (one line for a file that cannot be read)."""
    return check(
        _read_json(reference, "reference build's status"),
        relay_root,
        _read_json(legs, "legs file"),
        _read_json(floor, "noise floor"),
        stop,
    )
