"""``spill report``: everything a project's state knows about its builds, gathered for one page.
``gather`` reads what ``spill status`` reads, through the same functions; ``write`` renders it
(``spill.project.report.html``) to one self-contained HTML file. Nothing here loads a model or
imports an engine, numpy or Hydra.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from spill.errors import StoreError
from spill.ground.paths import STATE_DIR
from spill.project.build import record
from spill.project.build.stages import STAGES, EvalStage, distinct
from spill.project.report import status
from spill.project.report.html import page
from spill.store.location import Location, location
from spill.store.output import put_output

FILE = "report.html"  # in the project folder, unless -o says otherwise
SCORES = {
    "accuracy": "accuracy",
    "gold_logprob_per_token": "logprob/token",
    "preference_accuracy": "prefers chosen",  # a preference project's (data.rejected)
}
BUILD = "build"  # the name of the project's own build, beside its sweep jobs


def _scores(recs: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Each finished eval stage's scores, by stage then score name."""
    out = {}
    for stage in STAGES:
        rec = recs.get(stage.name) or {}
        if isinstance(stage, EvalStage) and rec.get("status") == "done":
            result = rec.get("result") or {}
            out[stage.name] = {
                label: result.get(key)
                for key, label in SCORES.items()
                if key in result or key != "preference_accuracy"  # only a pairs project has it
            }
    return out


def _timeline(where: Location, recs: dict[str, Any]) -> list[dict[str, Any]]:
    """Per stage that ran: its unit, total and the producer of each range of it; a stage whose
    job state is gone shows its recorded producer over what it did, when it had one."""
    out = []
    for stage in STAGES:
        rec = recs.get(stage.name)
        if rec is None or rec["status"] == "skipped":
            continue
        ranges = stage.ranges(where)
        made = distinct(rec.get("producers") or [])
        if not ranges and len(made) == 1 and rec.get("progress"):
            ranges = [{"from": 0, "to": rec["progress"], "producer": made[0]}]
        for r in ranges:
            r["label"] = status.ran_on([r["producer"]])
        out.append(
            {"stage": stage.name, "unit": stage.unit, "total": rec["total"], "ranges": ranges}
        )
    return out


def _models(where: Location, doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Per stage that ran: the model it names in the config and the one its job is pinned to
    (id and fingerprint), with the stage's own fingerprint (of everything that decides it)."""
    out = []
    config = doc.get("config") or {}
    for stage in STAGES:
        rec = (doc.get("stages") or {}).get(stage.name)
        if rec is None or rec["status"] == "skipped":
            continue
        group = config.get(stage.model_key.split(".")[0]) or {}
        pinned = stage.pinned(where) or {}
        quant = pinned.get("quantization") or {}
        out.append(
            {
                "stage": stage.name,
                "model": group.get("name"),
                "quantize": group.get("quantize"),
                "pinned": pinned.get("id"),
                "fingerprint": pinned.get("fingerprint"),
                "quantization": quant.get("format") if isinstance(quant, dict) else None,
                "files": sorted(pinned.get("files") or {}),
                "stage_fingerprint": rec.get("fingerprint"),
            }
        )
    return out


def _run(name: str, summary: dict[str, Any]) -> dict[str, Any]:
    doc, where = summary["doc"], summary["state"]
    recs = doc.get("stages") or {}
    return {
        "name": name,
        "project": (doc.get("project") or {}).get("name"),
        "state": where,
        "overrides": list(doc.get("overrides") or []),
        "table": status.rows(doc),
        "notes": list(summary.get("notes") or []),
        "losses": (summary.get("losses") or {}).get("tune"),
        "scores": _scores(recs),
        "timeline": _timeline(where, recs),
        "models": _models(where, doc),
        "data": doc.get("data"),
        "updated": doc.get("updated"),
    }


def _value(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


# The swept parameters are the override keys whose values differ between the sweep's jobs.
def swept(runs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Each swept parameter (an override key whose value differs between the sweep's jobs):
    one point per job, its value (a number where every job's is one) and its scores."""
    jobs = [r for r in runs if r["name"] != BUILD]
    given = [dict(o.split("=", 1) for o in r["overrides"] if "=" in o) for r in jobs]
    keys = sorted({k for g in given for k in g if len({h.get(k) for h in given}) > 1})
    out = {}
    for key in keys:
        values = [g.get(key, "") for g in given]
        numbers = all(isinstance(_value(v), float) for v in values)
        out[key] = [
            {"run": r["name"], "value": _value(v) if numbers else v, "scores": r["scores"]}
            for r, v in zip(jobs, values, strict=True)
        ]
    return out


# The build and each sweep job under ``<state>/sweep/`` (``status.status``, ``status.sweep_runs``,
# ``status.rows``), then from each build's job state the tune stage's loss series
# (``series.losses``), who computed which steps and rows (``Stage.ranges``: tune checkpoint ranges,
# row segments in commit order) and the model each job is pinned to (``Stage.pinned``).
def gather(root: Path | str, state_root: Location | None = None) -> dict[str, Any]:
    """The project's build (if it has one) and every sweep job with a build, as ``spill report``
    shows them; a state with neither fails as ``spill status`` does."""
    root = Path(root).resolve()
    where = state_root or location(root / STATE_DIR)
    runs = []
    if record.read(where) is not None:
        runs.append(_run(BUILD, status.status(root, where)))
    for job in status.sweep_runs(where):
        if record.read(job["state"]) is not None:  # a job that never started has no build
            runs.append(_run(job["run"], status.status(root, job["state"])))
    if not runs:
        status.status(root, where)  # its one-line error: no build here, and how to start one
        raise StoreError(f"no build at {where}; `spill build {root}` starts one")
    keys = swept(runs)
    for r in runs:  # a sweep job is named by its swept values (the rest they share)
        mine = [o for o in r["overrides"] if o.split("=", 1)[0] in keys]
        r["label"] = ", ".join(mine) if r["name"] != BUILD and mine else r["name"]
    return {
        "project": runs[0]["project"],
        "folder": str(root),
        "state": where,
        "generated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "runs": runs,
        "swept": keys,
    }


def target(root: Path | str, out: Path | str | None = None) -> Path:
    """Where the page goes: ``out`` (a folder: ``report.html`` in it), else ``<root>/report.html``."""
    path = Path(out) if out is not None else Path(root).resolve() / FILE
    return path / FILE if path.is_dir() else path


def write(
    root: Path | str, state_root: Location | None = None, out: Path | str | None = None
) -> dict:
    """Gather the report and write its page to ``target(root, out)`` through the store's atomic
    write (a FIFO or character device: into it); returns the gathered report with ``path``."""
    report = gather(root, state_root)
    path = target(root, out)
    text = page(report)
    try:
        if not path.parent.is_dir():
            raise FileNotFoundError(f"no folder {path.parent}")
        put_output(str(path), text.encode("utf-8"))
    except (OSError, StoreError) as e:
        cause = e.__cause__ if isinstance(e.__cause__, OSError) else e
        why = getattr(cause, "strerror", None) or str(cause)
        raise StoreError(f"cannot write {path} ({why}); give -o a writable file") from None
    return {**report, "path": str(path)}
