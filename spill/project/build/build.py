"""``spill build`` and ``spill resume``: plan, then hand the stages that need work to the executor.

A recorded build that is complete, made from the same sources and whose outputs are still there
answers from ``state.json`` (``finished``: no Hydra, jsonschema or engine). Otherwise: the
``Project`` (recorded when the compose key matches, else composed), the stage specs, the plan
against the recorded state, the model names checked (no weights loaded), and unless
``--dry-run`` the executor. ``spill resume`` builds the recorded config and overrides.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any, NamedTuple

from spill.console import note
from spill.control.control import RunComplete
from spill.control.ownership import CopiedRun
from spill.errors import StoreError
from spill.ground.paths import STATE_DIR
from spill.jobs.authority import Writer, own
from spill.project import sources
from spill.project.build import record
from spill.project.build.stages import STAGES, get
from spill.project.build.stages import finished as every_stage_finished
from spill.store.fs import listdir
from spill.store.location import Location, location

KNOWN = {"runs", "payloads", "command.json", "stages", "files", "adapters", "sweep", "hydra"}


class BuildOptions(NamedTuple):
    writer: Writer = Writer()  # the state (None: DIR/.spill), lease, --wait, the command line
    stop_after: str | None = None
    dry_run: bool = False
    overrides: tuple[str, ...] = ()
    resume: bool = False
    engine: tuple[str, ...] = ()  # resume: engine.* overrides on top of the recorded config
    new_run: bool = False  # fork a new run from an installed copy (or a completed run)


def _done_plan(doc: dict) -> list[dict[str, str]]:
    out = []
    for stage in STAGES:
        name, rec = stage.name, doc["stages"][stage.name]
        if rec["status"] == "skipped":
            out.append({"stage": name, "action": "skip", "reason": f"skipped: {stage.skipped}"})
        else:
            done = stage.summarize(rec.get("result") or {})
            out.append({"stage": name, "action": "done", "reason": f"done: {done}"})
    return out


def finished(doc: dict | None, key: str, root: Path, state_root: Location) -> bool:
    """Whether the recorded build is complete, nothing it was made from has changed and every
    stage's outputs are still what it recorded (``Stage.problem``: stats, a hash only for a
    file whose mtime moved)."""
    if doc is None or doc.get("compose_key") != key:
        return False
    stages = doc.get("stages") or {}
    if not every_stage_finished(stages):
        return False
    data = Path(root) / doc["config"]["data"]["file"]
    if sources.data_sha256(data) != doc["data"]["sha256"]:
        return False
    name = doc["project"]["name"]
    return not any(
        get(stage).problem(state_root, name, rec.get("outputs"))
        for stage, rec in stages.items()
        if rec["status"] == "done"
    )


def build(root: Path | str, opts: BuildOptions) -> dict[str, Any]:
    """``spill build`` / ``spill resume`` on a project folder; returns the summary to print. As
    a rank other than 0 of a process group it runs rank 0's jobs with it (``follow``); asked for
    ``engine.procs`` > 1 as one process it raises ``Relaunch``."""
    from spill.jobs.group import current as current_group
    from spill.project.build.follow import follow

    group = current_group()
    if not group.leader:
        return follow(group)
    summary = _build(root, opts, group)
    if group.world > 1:
        group.share(None)  # the build is over: the other ranks return
    return summary


def _build(root: Path | str, opts: BuildOptions, group) -> dict[str, Any]:
    root = Path(root).resolve()
    if not (root / sources.FILE).is_file():
        from spill.project.config import compose

        compose(root)  # raises the one-line "no spill.yaml here" error
    state_root = location(opts.writer.state or str(root / STATE_DIR))
    doc = record.read(state_root)
    if opts.resume:
        if doc is None:
            raise StoreError(
                f"nothing to resume: {state_root} holds no build; `spill build {root}` starts one"
            )
        overrides = tuple(doc["overrides"])
        key = doc["compose_key"]
        if opts.engine:  # where the stages compute may change; what they mean may not
            overrides = (*overrides, *opts.engine)
            key = sources.compose_key(root, overrides)
    else:
        overrides = tuple(opts.overrides)
        key = sources.compose_key(root, overrides)
    summary = {"project": root.name, "state": state_root, "dry_run": opts.dry_run}
    if not opts.dry_run and finished(doc, key, root, state_root):
        if opts.stop_after:  # a typo still fails, even with nothing to do
            from spill.project.build.plan import StopAfter, check_stop

            totals = {name: rec["total"] for name, rec in doc["stages"].items()}
            check_stop(StopAfter.parse(opts.stop_after), totals)
        return {**summary, "project": doc["project"]["name"], "plan": _done_plan(doc), "doc": doc}
    from spill.project import config
    from spill.project.build.plan import StopAfter

    stop = StopAfter.parse(opts.stop_after) if opts.stop_after else None
    if opts.resume:
        project = with_engine(config.from_record(doc["config"], root, overrides), opts.engine)
        if sources.compose_key(root, overrides) != key:
            note(
                "spill.yaml changed since this build started; resume continues with the recorded config"
            )
    elif doc is not None and doc["compose_key"] == key:
        project = config.from_record(doc["config"], root, overrides)
    else:
        project = config.compose(root, overrides)
    if project.engine.procs > 1 and group.world == 1 and not opts.dry_run:
        from spill.project.build.follow import Relaunch

        raise Relaunch(project.engine.procs)
    return reconcile(
        project,
        state_root,
        key,
        doc,
        stop,
        opts.dry_run,
        writer=opts.writer,
        new_run=opts.new_run,
    )


def with_engine(project, engine: tuple[str, ...]):
    """``project`` with ``engine.<key>=<value>`` overrides applied to its engine section."""
    if not engine:
        return project
    import yaml

    values = {}
    for item in engine:
        key, _, value = item.partition("=")
        values[key.removeprefix("engine.")] = yaml.safe_load(value)
    return dataclasses.replace(project, engine=dataclasses.replace(project.engine, **values))


def check_location(project, doc: dict | None, root: Location) -> None:
    """A state location holds one project's build; anything else there is refused."""
    if doc is not None:
        theirs = doc["project"]
        ids = theirs.get("id"), project.id
        same = ids[0] == ids[1] if all(ids) else theirs["name"] == project.name
        if not same:
            which = f" (id {theirs['id']})" if theirs.get("id") else ""
            raise StoreError(
                f"{root} holds the build of project {theirs['name']!r}{which}, not of "
                f"{project.name!r}; give this project its own --state location"
            )
        return
    stray = [n for n in listdir(root) if n not in KNOWN and not n.startswith(".")]
    if stray:
        raise StoreError(
            f"{root} is not empty ({stray[0]}, ...) and holds no spill build; give the build "
            "an empty or new --state location"
        )


def prepare(project):
    """The project's data as the stages read it (``spill.project.data.Prepared``)."""
    from spill.project.data import prepare as prepare_data

    p = project
    return prepare_data(
        p.data_path,
        p.data.input,
        p.data.output,
        p.data.task,
        p.seed,
        p.data.test_fraction,
        p.prompt.template,
        p.prompt.chat,
        p.tune.valid,
        p.data.rejected,
        p.tune.method,
    )


def reconcile(
    project,
    state_root: Location,
    key: str,
    doc: dict | None,
    stop=None,
    dry_run=False,
    *,
    writer: Writer | None = None,
    new_run: bool = False,
) -> dict:
    """Plan ``project`` against the state at ``state_root`` and execute (builds and sweeps).

    Everything that can refuse the build (the data, the stage specs, the model names) is checked
    first. Then, unless ``dry_run``, the build owns the location's run (``spill.jobs.authority``:
    a second writer exits 75 naming the owner) and plans again against the state as the run holds
    it now; a completed run whose project changed starts the next run. When every stage is done
    the run is completed."""
    from spill.project.build.context import BuildContext
    from spill.project.build.specs import specs as stage_specs

    check_location(project, doc, state_root)
    data_sha = sources.data_sha256(project.data_path)
    ctx = BuildContext(project, state_root, prepare(project), data_sha, key)
    specs = stage_specs(project, ctx.prepared)
    decisions = _plan(project, specs, state_root, doc, stop)
    summary = {"project": project.name, "state": state_root, "dry_run": dry_run}
    if dry_run:
        return {**summary, "plan": [d.to_dict() for d in decisions], "doc": doc}
    owner = Owner(writer or Writer(), new_run)
    with contextlib.ExitStack() as stack:
        ctx.run = _own(stack, ctx, specs, stop, owner)
        if ctx.run is None:  # a completed run that already says all this: nothing to write
            doc = record.read(state_root)
            decisions = _plan(project, specs, state_root, doc, stop)
            return {**summary, "plan": [d.to_dict() for d in decisions], "doc": doc}
        now_doc = record.read(state_root)  # as the run holds it now that it is ours
        if now_doc != doc:
            check_location(project, now_doc, state_root)
            doc, decisions = now_doc, _plan(project, specs, state_root, now_doc, stop)
        summary["plan"] = [d.to_dict() for d in decisions]
        summary["doc"] = _execute(ctx, doc, decisions, specs)
        recs = (summary["doc"] or {}).get("stages") or {}
        if every_stage_finished(recs):
            ctx.run.complete()
    return summary


class Owner(NamedTuple):
    """How a build takes its run (``spill.jobs.authority.own``)."""

    writer: Writer
    new_run: bool


def _own(stack, ctx, specs, stop, owner: Owner):
    """Own the run at the build's state for the block of ``stack``: the current one; or, when
    that one is complete (or an installed copy, with ``--new-run``) and this build would change
    anything, the next one (lineage: that run). None when the complete run or the copy already
    records exactly this build (a sweep's jobs come here with no ``finished`` check first)."""
    w = owner.writer
    how = {"lease": w.lease, "wait": w.wait, "command": w.command}
    try:
        return stack.enter_context(own(ctx.root, **how))
    except (RunComplete, CopiedRun) as e:
        doc = record.read(ctx.root)
        decisions = _plan(ctx.project, specs, ctx.root, doc, stop)
        if not _changes(ctx, doc, decisions):
            return None
        if isinstance(e, CopiedRun) and not owner.new_run:
            raise  # a copy forks only when asked: its original stays the one that continues
    return stack.enter_context(own(ctx.root, new_run=True, **how))


def _record(ctx) -> dict[str, Any]:
    """What a build records about what it was made from."""
    from spill.project.build.execute import data_record

    return {
        "compose_key": ctx.key,
        "overrides": list(ctx.project.overrides),
        "config": ctx.project.to_dict(),
        "data": data_record(ctx.project, ctx.prepared, ctx.data_sha),
    }


def _to_record(doc: dict | None, decisions) -> bool:
    """Whether a decision changes what ``doc`` records: one that works or drops a result, or a
    skip of a stage ``doc`` does not record as skipped (switched off since, or a state made
    before that stage existed)."""
    recs = (doc or {}).get("stages") or {}
    skips = [d.stage for d in decisions if d.action == "skip"]
    return any(d.works or d.drop for d in decisions) or any(
        (recs.get(name) or {}).get("status") != "skipped" for name in skips
    )


def _changes(ctx, doc, decisions) -> bool:
    """Whether building ``ctx.project`` would run anything or record anything new in ``doc``."""
    if doc is None or _to_record(doc, decisions):
        return True
    return any(doc.get(k) != v for k, v in _record(ctx).items())


def _plan(project, specs, state_root: Location, doc: dict | None, stop) -> list:
    from spill.project.build.plan import plan
    from spill.project.build.specs import check_model_name

    decisions = plan(specs, record.recorded(state_root, doc), stop)
    for d in decisions:  # a name that can name nothing fails now, not when its stage starts
        stage = get(d.stage)
        if d.action not in ("done", "skip") and (name := stage.model(project)) is not None:
            check_model_name(name, stage.model_key)
    return decisions


def _execute(ctx, doc, decisions, specs):
    """Run the decisions that work (or only record what changed); the new state document."""
    from spill.project.build.execute import Executor, now

    if not _to_record(doc, decisions):
        if doc is not None:
            # nothing to run, but what the build was made from changed (a comment, a value that
            # decides nothing): record it, so that the next build takes the fast path
            doc.update(_record(ctx), updated=now(), plan=[d.to_dict() for d in decisions])
            record.write(ctx.run, doc)
        return doc
    executor = Executor(ctx, doc, specs)
    executor.execute(decisions)
    return executor.doc
