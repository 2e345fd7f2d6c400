"""``spill status``, and the tables a build prints: each stage, its result, where it ran; and
``spill status <state>``, a state location's current run and what it has committed (a job's
steps or rows, a build's stages); and whether a path is a state location at all.

Everything here reads ``state.json`` (and, for an unfinished stage, the small probe files of
its job state; for a finished one, the stats of its outputs); nothing loads a model or imports
an engine, Hydra or jsonschema. A finished stage whose outputs are gone or changed shows as
``out of date`` with what is wrong, never with a result that no longer has its files.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from spill.console import table
from spill.control.keys import current, has_runs, missing_note
from spill.control.owner import describe
from spill.control.place import Place
from spill.control.transfer import describe_move
from spill.errors import StoreError
from spill.ground.paths import STATE_DIR
from spill.jobs.authority import read_command
from spill.payloads.newest import newest_commit
from spill.payloads.rows import commit_markers
from spill.project import sources
from spill.project.build import record
from spill.project.build.stages import EXPORT, STAGES, TUNE, get
from spill.project.build.stages import finished as stages_finished
from spill.project.report import series
from spill.store.fs import join, listdir
from spill.store.location import Location, location


def ran_on(producers: list[dict]) -> str:
    """``torch float32 on host (Linux 6.1)`` (``torch float32 x 2 processes on ...``); a stage
    made by several producers lists each."""
    out = []
    for p in producers:
        os_short = (p.get("os") or "").split(" (")[0]
        procs = f" x {p['procs']} processes" if p.get("procs") else ""
        out.append(
            f"{p.get('engine')} {p.get('numerics')}{procs} on {p.get('machine')} ({os_short})"
        )
    return " + ".join(out)


def rows(doc: dict[str, Any] | None) -> list[dict[str, Any]]:
    """One row per stage: stage, status, result (or progress), where it ran."""
    recs = (doc or {}).get("stages") or {}
    out = []
    for stage in STAGES:
        name, rec = stage.name, recs.get(stage.name)
        if rec is None:
            out.append({"stage": name, "status": "not run", "result": "", "ran on": ""})
            continue
        status, result = rec["status"], stage.summarize(rec.get("result") or {})
        if status == "skipped":
            result = stage.skipped
        elif rec.get("problem"):
            status, result = "out of date", rec["problem"]
        elif status != "done":
            result = f"at {rec['unit']} {rec['progress']} of {rec['total']}"
        out.append(
            {
                "stage": name,
                "status": status,
                "result": result,
                "ran on": ran_on(rec.get("producers") or []),
            }
        )
    return out


def render(summary: dict[str, Any]) -> str:
    """The text a build, a resume or a status prints on stdout."""
    if summary.get("dry_run"):
        plan = [
            {"stage": d["stage"], "action": d["action"], "reason": d["reason"]}
            for d in summary["plan"]
        ]
        return f"plan for {summary['project']} (state {summary['state']}):\n" + table(plan)
    lines = [table(rows(summary.get("doc")))]
    for name, found in (summary.get("losses") or {}).items():
        lines += series.lines(found, name)
    if run := summary.get("run"):
        lines.append(
            f"run {run['id']} · {run['status']} · generation {run['generation']} · "
            f"owner {run['owner']}"
        )
        if run.get("move"):
            lines.append(f"move: {run['move']}")
    lines += [f"note: {n}" for n in summary.get("notes", [])]
    return "\n".join(lines)


def run_view(where: Location) -> dict[str, Any] | None:
    """The current run at ``where`` as ``spill status`` shows it: id, status, generation, owner
    (host, pid, since, lease left), lineage."""
    doc = current(where)
    if doc is None:
        return None
    left = doc["lease"]["expires"] - time.time()
    return {
        "id": doc["run"],
        "status": doc["status"],
        "generation": doc["generation"],
        "owner": describe(doc),
        "host": doc["owner"]["host"],
        "pid": doc["owner"]["pid"],
        "released": doc["owner"]["released"],
        "lease_left_s": round(max(0.0, left), 1) if not doc["owner"]["released"] else 0.0,
        "parent": doc["lineage"]["parent"],
        "move": describe_move(doc),
    }


def is_state(where: Location) -> bool:
    """Whether ``where`` is a state location (it holds runs), not a project folder."""
    if (project := where.on_disk("spill.yaml")) and os.path.isfile(project):
        return False
    return has_runs(where)


def progress(where: Location, doc: dict[str, Any]) -> str:
    """What the run at ``where`` has committed: a job's last step (and cursor) or rows, else
    each stage of a build's state."""
    place = Place(where)
    if (found := newest_commit(place)) is not None:
        step, state = found
        hyper = state.get("hyperparameters") or {}
        line = (
            f"step {step} of {hyper.get('steps', '?')} committed, cursor {state.get('cursor', '?')}"
        )
        last = (state.get("metrics") or [None])[-1]  # a preference tune's newest step
        if isinstance(last, dict) and isinstance(last.get("rewards/accuracies"), int | float):
            margin = last.get("rewards/margins")
            line += f"; {str(hyper.get('method', '')).upper()} reward accuracy "
            line += f"{last['rewards/accuracies']:.3f}"
            line += f", margin {margin:.3f}" if isinstance(margin, int | float) else ""
        return line
    if "rows" in doc["pointers"]:
        return f"{sum(int(m.get('count', 0)) for m in commit_markers(place))} rows committed"
    if "state" in doc["pointers"]:
        recs = (record.read(where) or {}).get("stages") or {}
        done = [f"{n} {r['status']} ({r['progress']} of {r['total']})" for n, r in recs.items()]
        return "; ".join(done) or "nothing committed yet"
    return "nothing committed yet"


def run_summary(where: Location) -> dict[str, Any]:
    """``spill status <state>``: the current run, its owner and lease, and its progress."""
    doc = current(where)
    if doc is None:
        raise StoreError(f"no run at {where}")
    notes = [line] if (line := missing_note(where)) else []
    return {"state": where, **run_view(where), "progress": progress(where, doc), "notes": notes}


def as_json(summary: dict[str, Any]) -> dict[str, Any]:
    """What ``--json`` prints: the plan and, per stage, status, result and producers; the tune
    stage's loss series under ``losses``."""
    doc = summary.get("doc") or {}
    stages = {
        name: {
            k: rec.get(k) for k in ("status", "progress", "total", "unit", "result", "producers")
        }
        | ({"problem": rec["problem"]} if rec.get("problem") else {})
        for name, rec in (doc.get("stages") or {}).items()
    }
    keys = ("project", "state", "dry_run", "plan", "notes", "run")
    out = {k: summary.get(k) for k in keys if k in summary}
    out["losses"] = summary.get("losses") or {}
    found = {"adapter": adapter(summary), "exports": exports(summary)}
    return {**out, "stages": stages, "data": doc.get("data"), **found}


def with_losses(summary: dict[str, Any]) -> dict[str, Any]:
    """``summary`` with ``losses``: the loss series (``spill.project.report.series``) of its tune stage
    by name, when it has run and committed a checkpoint (a dry run's: none)."""
    recs = (summary.get("doc") or {}).get("stages") or {}
    if summary.get("dry_run") or not summary.get("state") or TUNE.name not in recs:
        return summary
    found = series.losses(summary["state"])
    return {**summary, "losses": {TUNE.name: found} if found else {}}


def adapter(summary: dict[str, Any]) -> str | None:
    """Where the finished tune stage published the adapter (``<state>/adapters/<name>``), or
    None while it is not done, is out of date, or this is a dry run (or a summary that names no
    state or project)."""
    return published(summary, TUNE)


def exports(summary: dict[str, Any]) -> str | None:
    """Where the finished export stage wrote its models (``<state>/exports/<name>``), as
    ``adapter`` says it."""
    return published(summary, EXPORT)


def published(summary: dict[str, Any], stage) -> str | None:
    doc = summary.get("doc") or {}
    rec = (doc.get("stages") or {}).get(stage.name) or {}
    name = (doc.get("project") or {}).get("name")
    if summary.get("dry_run") or rec.get("status") != "done" or rec.get("problem"):
        return None
    if not name or not summary.get("state"):
        return None
    return join(summary["state"], stage.output(name))


def score(recs: dict, stage: str) -> float | None:
    """A finished eval stage's accuracy from a state's stage records, else None."""
    rec = recs.get(stage) or {}
    return (rec.get("result") or {}).get("accuracy") if rec.get("status") == "done" else None


def sweep_runs(where: Location) -> list[dict[str, Any]]:
    """The builds of a sweep under ``<state>/sweep/``, as the sweep's own table rows."""
    out = []
    for name in listdir(join(where, "sweep")):
        doc = record.read(join(where, "sweep", name)) or {}
        recs = doc.get("stages") or {}
        finished = stages_finished(recs)
        for stage, rec in recs.items():  # a stopped job's progress, as its own status shows it
            if rec["status"] in ("running", "stopped"):
                rec["progress"] = get(stage).probe(join(where, "sweep", name))[0]

        out.append(
            {
                "run": name,
                "status": "done" if finished else "stopped" if recs else "not run",
                "base": score(recs, "eval:base"),
                "tuned": score(recs, "eval"),
                "steps": (recs.get("tune") or {}).get("progress"),
                "state": join(where, "sweep", name),
            }
        )
    return out


def _check_outputs(doc: dict[str, Any], where: Location) -> list[str]:
    """Mark finished stages whose outputs are missing or changed, and (make's rule) the stages
    that read them, as out of date; a stage that must rerun shows no result. One note each."""
    recs, name, notes, rerun = doc.get("stages") or {}, doc["project"]["name"], [], set()
    for stage in STAGES:
        rec = recs.get(stage.name)
        if rec is None or rec["status"] != "done":
            continue
        behind = [n for n in stage.needs if n in rerun]
        problem = f"{behind[0]} reruns first" if behind else ""
        problem = problem or stage.problem(where, name, rec.get("outputs"))
        if not problem:
            continue
        source = "" if behind else stage.source(where, rec["total"])
        rec.update(status="out of date", problem=problem)
        if source:
            notes.append(f"{stage.name}: {problem}; `spill build` restores it from {source}")
        else:
            rec["result"] = {}
            rerun.add(stage.name)
            notes.append(f"{stage.name}: {problem}; `spill build` runs it again")
    return notes


def _instead(where: Location, root: Path) -> str:
    """What to do where a build was looked for: a job's state (``--state`` of run, eval,
    distill, predict or tune) is shown by ``spill status`` given it; else build the project."""
    if is_state(where):
        verb = (read_command(where) or {}).get("verb")
        if verb not in ("build", "resume"):
            job = f"a `spill {verb}` job's" if verb else "a job's"
            return f"it holds {job} state: `spill status {where}` shows it"
    return f"`spill build {root}` starts one"


def status(root: Path | str, state_root: Location | None = None) -> dict[str, Any]:
    """Read a project's build state (``state_root``: its ``--state``, parsed; else the project's
    ``.spill/``); refresh the progress of unfinished stages from their probes."""
    root = Path(root).resolve()
    where = location(state_root or root / STATE_DIR)
    doc = record.read(where)
    if doc is None:
        runs = sweep_runs(where)
        if runs:  # a sweep's folder: its jobs, each with its loss series
            losses = {r["run"]: found for r in runs if (found := series.losses(r["state"]))}
            summary = {"project": root.name, "state": where, "runs": runs, "dry_run": False}
            return {**summary, "losses": losses}
        raise StoreError(f"no build at {where}; {_instead(where, root)}")
    notes = []
    for name, rec in (doc.get("stages") or {}).items():
        if rec["status"] in ("running", "stopped"):
            rec["progress"], producers = get(name).probe(where)
            rec["producers"] = producers or rec.get("producers", [])
    notes += _check_outputs(doc, where)
    if (root / sources.FILE).is_file():
        if sources.compose_key(root, doc["overrides"]) != doc["compose_key"]:
            notes.append(
                "spill.yaml or its groups changed since; `spill build --dry-run` shows what reruns"
            )
        data = root / doc["config"]["data"]["file"]
        if data.is_file():
            if sources.data_sha256(data) != doc["data"]["sha256"]:
                notes.append(f"{data.name} changed since; the stages that read it rerun")

    notes += [line] if (line := missing_note(where)) else []
    summary = {"project": doc["project"]["name"], "state": where, "doc": doc, "notes": notes}
    return with_losses({**summary, "run": run_view(where)})
