"""``spill build DIR -m a=1,2 b=x,y``: a Hydra multirun, each combination its own build (``sweep``).

Each job builds with the state ``<state>/sweep/<run_name(overrides)>/``; a job that a launcher loses
is ``lost``. ``hydra_safety`` checks the sweep before anything is instantiated. ``render`` and
``exit_code`` make the table and the exit code; docs/sweeps.md says what each launcher does.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from spill.console import table
from spill.control.control import Busy
from spill.errors import EXIT_PREEMPTED, EXIT_USER, SpillError
from spill.ground.paths import STATE_DIR
from spill.jobs.authority import Writer
from spill.jobs.preempt import Preempted
from spill.project import config, hydra_safety
from spill.project.build import build, record, stages
from spill.project.build.plan import StopAfter
from spill.project.build.tracking import run_name  # a job's state folder and its tracked run's name
from spill.project.report.status import score
from spill.store.fs import get_bytes, join, listdir, put_bytes
from spill.store.location import Location, location

RECORD = "spill-job.json"  # a job's result, in its Hydra output folder


class LauncherError(SpillError):
    """Hydra's launcher failed before any job of the sweep reported back."""


# ``sweep`` runs Hydra's own ``multirun`` with ``job`` as the task function, so the configured
# sweeper and launcher run the jobs unchanged; each job validates the config Hydra gives it and
# builds it. A job never raises (Hydra would drop every other result): it returns a small dict, and
# writes it to ``<sweep dir>/<num>/spill-job.json`` too, so that when a launcher loses a job and
# raises, the finished jobs' results are read back and the unfinished one is ``lost``.
def job(
    cfg: Any,
    *,
    root: str,
    base: Location,
    stop_after: str | None,
    dry_run: bool,
    token: str = "",
    writer: Writer | None = None,
    new_run: bool = False,
) -> dict:
    """Hydra's task function: one build; errors come back as a status, never raised.
    ``new_run`` (``--new-run``): a job whose run is an installed copy forks a new one."""
    from hydra.core.hydra_config import HydraConfig  # lazy: Hydra, only when composing

    hydra = HydraConfig.get()
    overrides = tuple(hydra.overrides.task)
    name = run_name(overrides)
    where = join(base, "sweep", name)
    out: dict[str, Any] = {"run": name, "overrides": list(overrides), "state": where}
    out.update(machine=platform.node(), pid=os.getpid())  # where the launcher ran it
    out["started"] = round(time.time(), 3)  # epoch s: with "seconds", where a launcher's time went
    record_at = join(hydra.runtime.output_dir, RECORD) if token else None
    _record(record_at, {**out, "num": hydra.job.num, "token": token, "status": "running"})
    try:
        project = config.from_composed(cfg, root, overrides)
        stop = StopAfter.parse(stop_after) if stop_after else None
        key = config.compose_key(root, overrides)
        doc = record.read(where)
        summary = build.reconcile(
            project, where, key, doc, stop, dry_run, writer=writer or Writer(), new_run=new_run
        )
    except Preempted as e:
        result = {**out, "status": "preempted", "error": str(e), **_committed(where)}
    except Busy as e:  # another process holds this combination's run (a requeued job's elder)
        result = {**out, "status": "busy", "error": str(e)}
    except SpillError as e:
        result = {**out, "status": "error", "error": str(e)}
    except Exception as e:  # a bug in one job must not lose the others' results
        result = {**out, "status": "error", "error": f"{type(e).__name__}: {e}"}
    else:
        recs = (summary["doc"] or {}).get("stages") or {}
        status = "done" if stages.finished(recs) else "stopped"
        result = {**out, "status": "planned" if dry_run else status, **_scores(recs)}
        result["plan"] = summary["plan"]
    result["seconds"] = round(time.time() - out["started"], 3)
    _record(record_at, {**result, "num": hydra.job.num, "token": token})
    return result


def _scores(recs: dict) -> dict[str, Any]:
    tune = (recs.get("tune") or {}).get("progress")
    return {"base": score(recs, "eval:base"), "tuned": score(recs, "eval"), "steps": tune}


def _committed(where: Location) -> dict[str, Any]:
    """The scores and tune progress a stopped job's state has committed (best effort)."""
    try:
        recs = (record.read(where) or {}).get("stages") or {}
        for name, rec in recs.items():
            if rec["status"] in ("running", "stopped"):
                rec["progress"] = stages.get(name).probe(where)[0]
    except Exception:  # noqa: BLE001 (a report of a stopped job must not fail the sweep)
        return {}
    return _scores(recs)


def _record(where: str | None, doc: dict) -> None:
    """Best effort: a record that cannot be written must not fail the build it describes."""
    if where is None:
        return
    try:
        put_bytes(where, json.dumps(doc, sort_keys=True).encode(), drilled=False)
    except Exception:  # noqa: BLE001 (the record only matters if the launcher fails)
        pass


def _recover(logs: str, token: str, error: BaseException) -> list[dict]:
    """The sweep's jobs from their records after the launcher raised, in job order; a job that
    started and never ended is ``lost``, with the progress its state had committed."""
    found = _records(logs, token)
    while any(_alive_here(d) for d in found):  # the launcher stopped waiting; spill does not
        time.sleep(1)
        found = _records(logs, token)
    if not found:
        raise LauncherError(
            f"the sweep's launcher failed before any job reported: {_line(error)}; "
            "check the launcher's settings (hydra.launcher.*) and run the same command again"
        )
    runs = []
    for doc in sorted(found, key=lambda d: d["num"]):
        del doc["token"], doc["num"]
        if doc["status"] == "running":
            doc.update(status="lost", error=f"the launcher lost it: {_line(error)}")
            doc.update(_committed(location(doc["state"])))  # as its record names it
        runs.append(doc)
    return runs


def _records(logs: str, token: str) -> list[dict]:
    """``logs``: the local folder Hydra's jobs write their records in (``sweep``)."""
    found = []
    for sub in listdir(logs) if os.path.isdir(logs) else []:
        try:
            doc = json.loads(get_bytes(join(logs, sub, RECORD)))
        except (OSError, ValueError, SpillError):
            continue
        if doc.get("token") == token:
            found.append(doc)
    return found


def _alive_here(doc: dict) -> bool:
    """A job still running in a live process on this machine (elsewhere it cannot be known)."""
    import psutil  # lazy: psutil, when used

    if doc["status"] != "running" or doc["machine"] != platform.node():
        return False
    try:
        return psutil.Process(doc["pid"]).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _line(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first}"[:300]


def sweep(root: Path | str, opts: build.BuildOptions) -> dict[str, Any]:
    """Run the multirun; returns ``{"runs": [...]}`` in Hydra's job order."""
    root = Path(root).resolve()
    if not (root / config.FILE).is_file():
        config.compose(root)  # the one-line "no spill.yaml here" error
    if opts.stop_after:
        StopAfter.parse(opts.stop_after)  # fail before any job starts
    base = opts.writer.state or location(root / STATE_DIR)  # the Writer parsed a --state
    logs = base.on_disk("hydra") or str(root / STATE_DIR / "hydra")  # a folder here, always
    overrides = [*config.SILENT, f"hydra.sweep.dir='{logs}'", *opts.overrides]  # later ones win
    token = uuid.uuid4().hex
    task = functools.partial(
        job,
        root=str(root),
        base=base,
        stop_after=opts.stop_after,
        dry_run=opts.dry_run,
        token=token,
        writer=Writer(lease=opts.writer.lease, wait=opts.writer.wait),
        new_run=opts.new_run,
    )
    # Ray relays its workers' and raylet's lines to this process's stdout: keep them off the
    # table and the --json document, and leave Ray before printing (its relay is a thread)
    with contextlib.redirect_stdout(sys.stderr):
        try:
            runs, lost = _launch(root, task, overrides, logs, token)
        finally:
            ray = sys.modules.get("ray")
            if ray is not None and ray.is_initialized():
                ray.shutdown()  # a cluster ray.init() started here stops; a running one stays
    out = {"project": root.name, "state": base, "dry_run": opts.dry_run, "pid": os.getpid()}
    return {**out, "runs": runs, **({"launcher_error": lost} if lost else {})}


def _launch(
    root: Path, task: Any, overrides: list[str], logs: str, token: str
) -> tuple[list[dict], str | None]:
    """Hydra's multirun: the jobs' dicts, and the launcher's error if it lost any."""
    from hydra import initialize_config_dir  # lazy: Hydra, only when composing
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    where = str(root / config.FILE)
    hydra_safety.check_sources(root / config.FILE, overrides, where)
    try:
        with initialize_config_dir(config_dir=str(root), version_base="1.3", job_name="spill"):
            hydra = GlobalHydra.instance().hydra
            # before multirun instantiates or runs any of it
            hydra_safety.check_sweep(hydra, config.CONFIG_NAME, overrides, where)
            returns = hydra.multirun(
                config_name=config.CONFIG_NAME, task_function=task, overrides=overrides
            )
    except (HydraException, OmegaConfBaseException) as e:
        raise config.ConfigError(f"{where}: {config.hydra_line(e)}") from None
    except SpillError:
        raise
    except Exception as e:  # a launcher that lost a job (a killed Ray worker, submitit process)
        return _recover(logs, token, e), _line(e)
    return [r.return_value for batch in returns for r in batch], None


def exit_code(result: dict[str, Any]) -> int:
    """1 if a job failed; 75 if one was preempted, lost or busy (the same command continues)."""
    statuses = {r["status"] for r in result["runs"]}
    again = statuses & {"preempted", "lost", "busy"}
    return EXIT_USER if "error" in statuses else EXIT_PREEMPTED if again else 0


def render(result: dict[str, Any]) -> str:
    def pct(x: float | None) -> str:
        return "" if x is None else f"{x:.3f}"

    lines = []
    if result["dry_run"]:
        for r in result["runs"]:
            plan = [
                f"  {d['stage']:<9}  {d['action']:<8}  {d['reason']}" for d in r.get("plan", [])
            ]
            lines += [f"{r['run']}:", *plan]
    rows = [
        {
            "run": r["run"],
            "status": r["status"],
            "base": pct(r.get("base")),
            "tuned": pct(r.get("tuned")),
            "steps": r.get("steps") if r.get("steps") is not None else "",
            "state": r["state"] if r["status"] not in ("error", "busy") else r["error"],
        }
        for r in result["runs"]
    ]
    if result.get("launcher_error"):
        lines.append(f"the launcher raised {result['launcher_error']}; the jobs' own records:")
    tail = ["lost jobs continue from their checkpoints: run the same command again"]
    lost = any(r["status"] == "lost" for r in result["runs"])
    return "\n".join([*lines, table(rows), *(tail if lost else [])])
