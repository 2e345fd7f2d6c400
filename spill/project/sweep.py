"""``spill build DIR -m a=1,2 b=x,y``: a Hydra multirun, each combination its own build.

The sweep is Hydra's own: ``GlobalHydra.instance().hydra.multirun`` with spill's task function,
so the configured sweeper and launcher run the jobs unchanged (basic: one after the other in
this process; ``hydra/launcher=joblib``: parallel processes on this machine; the Ray and
submitit launchers: other machines, see docs/sweeps.md). A job composes nothing itself: it
gets its config from Hydra, validates and freezes it (``config.from_composed``), and builds it
with the state ``<state>/sweep/<its overrides>/``, so running the same sweep again continues
or skips each combination like a plain build does.

A job never raises (Hydra would drop every other job's result): it returns a small dict with
its status, scores and state location, from which the comparison table is made.
"""

from __future__ import annotations

import functools
import os
import platform
import re
from pathlib import Path
from typing import Any

from spill.errors import SpillError
from spill.jobs.preempt import Preempted
from spill.paths import STATE_DIR
from spill.project import build, config, state
from spill.project.plan import StopAfter
from spill.project.status import score
from spill.store.fs import is_local, join

SILENT = ["hydra/job_logging=none", "hydra/hydra_logging=none", "hydra.output_subdir=null"]


def run_name(overrides: list[str] | tuple[str, ...]) -> str:
    """A state folder name for a job: its overrides, ``/`` and odd characters made safe."""
    text = ",".join(overrides) or "default"
    return re.sub(r"[^A-Za-z0-9._=,+@:-]+", "_", text)


def job(cfg: Any, *, root: str, base: str, stop_after: str | None, dry_run: bool) -> dict:
    """Hydra's task function: one build; errors come back as a status, never raised."""
    from hydra.core.hydra_config import HydraConfig

    overrides = tuple(HydraConfig.get().overrides.task)
    name = run_name(overrides)
    where = join(base, "sweep", name)
    out: dict[str, Any] = {"run": name, "overrides": list(overrides), "state": where}
    out.update(machine=platform.node(), pid=os.getpid())  # where the launcher ran it
    try:
        project = config.from_composed(cfg, root, overrides)
        stop = StopAfter.parse(stop_after) if stop_after else None
        key = config.compose_key(root, overrides)
        summary = build.run(project, where, key, state.read(where), stop, dry_run)
    except Preempted as e:
        return {**out, "status": "preempted", "error": str(e)}
    except SpillError as e:
        return {**out, "status": "error", "error": str(e)}
    except Exception as e:  # a bug in one job must not lose the others' results
        return {**out, "status": "error", "error": f"{type(e).__name__}: {e}"}
    doc = summary["doc"]
    recs = (doc or {}).get("stages") or {}
    finished = all(recs.get(s, {}).get("status") in ("done", "skipped") for s in recs) and recs
    status = "planned" if dry_run else ("done" if finished and len(recs) == 4 else "stopped")
    tune = (recs.get("tune") or {}).get("progress")
    return {
        **out,
        "status": status,
        "base": score(recs, "eval:base"),
        "tuned": score(recs, "eval"),
        "steps": tune,
        "plan": summary["plan"],
    }


def sweep(root: Path | str, opts: build.BuildOptions) -> dict[str, Any]:
    """Run the multirun; returns ``{"runs": [...]}`` in Hydra's job order."""
    root = Path(root).resolve()
    if not (root / config.FILE).is_file():
        config.compose(root)  # the one-line "no spill.yaml here" error
    if opts.stop_after:
        StopAfter.parse(opts.stop_after)  # fail before any job starts
    base = opts.state or str(root / STATE_DIR)
    logs = join(base, "hydra") if is_local(base) else str(root / STATE_DIR / "hydra")
    overrides = [*SILENT, f"hydra.sweep.dir='{logs}'", *opts.overrides]  # later ones win
    task = functools.partial(
        job, root=str(root), base=base, stop_after=opts.stop_after, dry_run=opts.dry_run
    )
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=str(root), version_base="1.3", job_name="spill"):
            returns = GlobalHydra.instance().hydra.multirun(
                config_name=config.CONFIG_NAME, task_function=task, overrides=overrides
            )
    except (HydraException, OmegaConfBaseException) as e:
        raise config.ConfigError(f"{root / config.FILE}: {config.hydra_line(e)}") from None
    runs = [r.return_value for batch in returns for r in batch]
    return {
        "project": root.name,
        "state": base,
        "dry_run": opts.dry_run,
        "pid": os.getpid(),
        "runs": runs,
    }


def exit_code(result: dict[str, Any]) -> int:
    statuses = {r["status"] for r in result["runs"]}
    return 1 if "error" in statuses else 75 if "preempted" in statuses else 0


def render(result: dict[str, Any]) -> str:
    from spill.console import table

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
            "state": r["state"] if r["status"] != "error" else r["error"],
        }
        for r in result["runs"]
    ]
    return "\n".join([*lines, table(rows)])
