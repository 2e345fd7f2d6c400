"""The pure planner: (stage specs, recorded state, --stop-after) -> one decision per stage.

Like make (DVC's ``plan_repro``) it compares each stage's inputs with what the state recorded
(``Recorded``): no files, engines or clock. A ``Decision`` is ``run``, ``done``, ``restore``,
``continue``, ``skip`` or ``wait``; a stage downstream of one not done is never ``done``;
``drop``: the recorded result no longer belongs to the inputs. docs/projects.md has the table.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from spill.errors import UsageError
from spill.project.build.specs import StageSpec
from spill.project.build.stages import ALIASES, NAMES, get

VALID = ("done", "skip", "restore")  # a stage whose recorded result downstream stages may use


class PlanError(UsageError):
    """A --stop-after that names no stage, or a count past the stage's end."""


@dataclass(frozen=True)
class Recorded:
    """What the state says about a stage (``done`` is probed from the job state when stopped)."""

    status: str  # "running", "stopped", "done" or "skipped"
    fingerprint: str
    inputs: Mapping[str, Any] = field(default_factory=dict)
    done: int = 0  # steps or rows committed
    result: Mapping[str, Any] = field(default_factory=dict)
    problem: str = ""  # a done stage's outputs missing or changed ("adapters/toy missing")
    source: str = ""  # the committed state that can restore them ("tune step 300 checkpoint")


@dataclass(frozen=True)
class StopAfter:
    stage: str
    count: int | None = None  # steps (tune) or rows; None: after the whole stage

    @classmethod
    def parse(cls, text: str) -> StopAfter:
        name, count = text.strip(), None
        head, sep, tail = name.rpartition(":")
        if sep and tail.isdigit():
            name, count = head, int(tail)
        name = ALIASES.get(name, name)
        if name not in NAMES:
            raise PlanError(
                f"--stop-after {text}: no stage {name!r}; stages are {', '.join(NAMES)} "
                "(train is tune), optionally with :N steps or rows"
            )
        if count is not None and count < 1:
            raise PlanError(f"--stop-after {text}: the count must be at least 1")
        return cls(name, count)

    def __str__(self) -> str:
        return self.stage if self.count is None else f"{self.stage}:{self.count}"


@dataclass(frozen=True)
class Decision:
    stage: str
    action: str  # done, skip, restore, run, continue or wait
    reason: str
    fingerprint: str
    total: int
    fresh: bool = False  # clear the stage's state first
    stop: int | None = None  # stop the job when this many steps/rows are done
    drop: bool = False  # the recorded result is out of date: forget it and its outputs

    @property
    def works(self) -> bool:
        return self.action in ("run", "continue", "restore")

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "action": self.action, "reason": self.reason}


def _show(value: Any) -> str:
    if isinstance(value, str) and value.startswith("sha256:"):
        return value[7:19]
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


_DERIVED = {
    "train.jsonl": "training rows",
    "test.jsonl": "test rows",
    "prompts.jsonl": "training inputs",
}


def describe_change(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    """What differs, config values first: ``tune.lr 0.0002 -> 0.0003``."""
    changed = [k for k in dict.fromkeys([*new, *old]) if old.get(k) != new.get(k)]
    config = [k for k in changed if not k.startswith(("data:", "stage:"))]
    data = [k for k in changed if k.startswith("data:")]
    upstream = [k[6:] for k in changed if k.startswith("stage:")]
    parts = [f"{k} {_show(old.get(k))} -> {_show(new.get(k))}" for k in config[:3]]
    if len(config) > 3:
        parts.append(f"{len(config) - 3} more values")
    if data and not config:
        what = ", ".join(_DERIVED.get(k[5:], k[5:]) for k in data)
        parts.append(f"the data changed (its {what} differ)")
    if upstream and not parts:
        parts.append(f"{' and '.join(upstream)} changed")
    return "; ".join(parts) or "its inputs changed"


def check_stop(stop: StopAfter, totals: Mapping[str, int]) -> None:
    """A count past the stage's end (``tune:500`` with 300 steps) is refused."""
    total = totals[stop.stage]
    if stop.count is not None and stop.count > total:
        what = get(stop.stage).count_name()
        raise PlanError(f"--stop-after {stop}: past the end ({what}: {total})")


_WAITS = {"run": "runs first", "continue": "continues first", "restore": "restored first"}


def _decide(
    spec: StageSpec,
    rec: Recorded | None,
    behind: list[Decision],
    stop: StopAfter | None,
    past: bool,
) -> tuple[str, str, bool, int | None, bool]:
    """(action, reason, fresh, stop count, drop) for one stage; ``behind``: the decisions of the
    stages it reads that are not done (make's rule: then neither is this one)."""
    if not spec.enabled:
        return "skip", f"skipped: {spec.why_off}", False, None, False
    same = rec is not None and rec.fingerprint == spec.fingerprint
    stage = get(spec.name)
    unit = stage.unit
    upstream = " and ".join(d.stage for d in behind)
    if same and rec.status == "done" and not behind:
        if not rec.problem:
            done = stage.summarize(rec.result)
            return "done", "done" + (f": {done}" if done else ""), False, None, False
        if rec.source:  # repairing is not computing: it happens even past --stop-after
            return "restore", f"{rec.problem}; restored from {rec.source}", False, None, False
    if rec is None:
        stale = ""
    elif not same:
        stale = describe_change(rec.inputs, spec.inputs)
    elif behind:
        stale = f"{upstream} is not done"
    else:
        stale = rec.problem if rec.status == "done" else ""
    if past:
        working = [d for d in behind if d.works]
        if working:
            why = "waits for " + " and ".join(f"{d.stage} ({_WAITS[d.action]})" for d in working)
        else:
            why = f"not now: after --stop-after {stop}" + (
                f"; out of date: {stale}" if stale else ""
            )
        return "wait", why, False, None, bool(stale)
    count = stop.count if stop is not None and stop.stage == spec.name else None
    if rec is None:
        return "run", "fresh: not run yet", True, count, False
    if not same:
        return "run", f"fresh: {stale}", True, count, True
    if behind:
        return "run", f"fresh: {upstream} runs first", True, count, True
    if stale:
        return "run", f"fresh: {stale}", True, count, True
    if count is not None and rec.done >= count:
        why = f"stopped at {unit} {rec.done} of {spec.total}, at --stop-after {stop}"
        return "wait", why, False, None, False
    if rec.done:
        return "continue", f"continue at {unit} {rec.done} of {spec.total}", False, count, False
    return "continue", "continue (nothing committed yet)", False, count, False


def plan(
    specs: list[StageSpec],
    recorded: Mapping[str, Recorded],
    stop: StopAfter | None = None,
) -> list[Decision]:
    """One ``Decision`` per spec, in order; see the module doc."""
    if stop is not None:
        check_stop(stop, {s.name: s.total for s in specs})
    out: dict[str, Decision] = {}
    past = False
    for spec in specs:
        behind = [out[n] for n in spec.needs if n in out and out[n].action not in VALID]
        action, reason, fresh, count, drop = _decide(
            spec, recorded.get(spec.name), behind, stop, past
        )
        out[spec.name] = Decision(
            spec.name, action, reason, spec.fingerprint, spec.total, fresh, count, drop
        )
        past = past or (stop is not None and spec.name == stop.stage)
    return list(out.values())
