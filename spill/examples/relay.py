"""``spill example relay [DIR]``: write a runnable relay folder, and the two commands its
``relay.sh`` calls (``relay-leg``, ``relay-check``).

The folder holds ``relay.sh`` (the legs and the checks, plain shell over spill's own commands),
``project/`` (a copy of an example project: ``tickets`` by default, ``toy`` for a run of
seconds), ``noise-floor.json`` (the measured tolerances, shipped with spill from
``docs/reports``) and a README. ``relay.sh`` takes its stop step from the noise floor (the step
its moved builds were stopped at), leg a's engine is torch and leg b's is MLX where MLX is
installed, else torch again (a second ``SPILL_HOME`` is still a second machine's cache).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

from spill.errors import UsageError

HERE = Path(__file__).resolve().parent
FLOOR = "noise-floor.json"
PROJECTS = ("tickets", "toy")


def _floor_file() -> Path:
    from spill.reports import HERE as reports

    found = sorted(reports.glob("*-noise-floor.json"))
    if not found:
        raise UsageError("this spill ships no measured noise floor; run bench/noise_floor.py")
    return found[-1]


def write(folder: Path, project: str, force: bool = False) -> dict[str, Any]:
    """Write the relay folder; refuses a non-empty folder unless ``force`` (which rewrites the
    files it writes and keeps ``work/``)."""
    from spill.projects import HERE as projects

    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{folder} is a file; give a folder for the relay")
    if folder.is_dir() and any(folder.iterdir()) and not force:
        raise UsageError(f"{folder} is not empty; give a new folder or --force to rewrite it")
    floor_src = _floor_file()
    floor = json.loads(floor_src.read_text())
    stop = (floor.get("projects", {}).get(project) or {}).get("stop_step")
    if stop is None:
        raise UsageError(f"{floor_src.name} measured no tolerance for {project}")
    second = "mlx" if importlib.util.find_spec("mlx") else "torch"
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / "project"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(
        projects / project, target, ignore=shutil.ignore_patterns(".spill", "__pycache__")
    )
    shutil.copyfile(floor_src, folder / FLOOR)
    settings = {"@PROJECT@": project, "@FROM@": "torch", "@TO@": second, "@STOP@": str(stop)}
    script = (HERE / "relay.sh").read_text()
    for key, value in settings.items():
        script = script.replace(key, value)
    (folder / "relay.sh").write_text(script)
    (folder / "relay.sh").chmod(0o755)
    readme = (HERE / "relay.md").read_text()
    for key, value in settings.items():
        readme = readme.replace(key, value)
    (folder / "README.md").write_text(readme)
    return {"folder": str(folder), "project": project, "from": "torch", "to": second, "stop": stop}


def cmd_relay(args) -> int:
    out = write(Path(args.dir), args.project, args.force)
    print(
        f"wrote {out['folder']}: relay.sh builds {out['project']} on {out['from']}, stops after "
        f"tune step {out['stop']}, moves it and finishes on {out['to']}; run {out['folder']}/relay.sh"
    )
    return 0


def cmd_leg(args) -> int:
    from spill.examples.relay_check import record_leg

    got = record_leg(Path(args.legs), args.name, args.engine)
    print(f"leg {args.name}: {got['engine']} on {got['machine']} ({got['os']})")
    return 0


def _read_json(path: str, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: cannot read the {what} ({e})") from None
    if not isinstance(doc, dict):
        raise UsageError(f"{path}: the {what} is not a JSON object")
    return doc


def cmd_check(args) -> int:
    from spill.console import table
    from spill.examples.relay_check import check, passed

    rows = check(
        _read_json(args.reference, "reference build's status"),
        args.relay,
        _read_json(args.legs, "legs file"),
        _read_json(args.noise_floor, "noise floor"),
        args.stop,
    )
    ok = passed(rows)
    if args.json:
        print(json.dumps({"passed": ok, "checks": rows}, indent=2))
    else:
        print(table(rows))
        failed = sum(r["ok"] != "ok" for r in rows)
        print("relay passed every check" if ok else f"relay FAILED {failed} of {len(rows)} checks")
    return 0 if ok else 1


def add_parser(sub) -> None:
    p = sub.add_parser("example", help="write a runnable example folder (the relay)")
    ex = p.add_subparsers(dest="example", metavar="EXAMPLE", required=True)
    p = ex.add_parser(
        "relay",
        help="a build stopped inside tune, moved to a second place, finished there and checked",
    )
    p.add_argument("dir", nargs="?", default="relay", help="the folder to write (./relay)")
    p.add_argument("--project", choices=PROJECTS, default="tickets", help="the example project")
    p.add_argument("--force", action="store_true", help="rewrite a folder that is not empty")
    p.set_defaults(func=cmd_relay)
    p = ex.add_parser("relay-leg", help="record this machine as a leg of a relay (relay.sh)")
    p.add_argument("name", choices=("a", "b"))
    p.add_argument("--engine", choices=("torch", "mlx"), required=True)
    p.add_argument("--legs", required=True, help="the legs file to add to")
    p.set_defaults(func=cmd_leg)
    p = ex.add_parser("relay-check", help="check a relayed build against its reference")
    p.add_argument("--reference", required=True, help="the reference's `spill status --json`")
    p.add_argument("--relay", required=True, help="the relayed project's folder or URI")
    p.add_argument("--legs", required=True, help="what ran each leg (relay-leg's file)")
    p.add_argument("--noise-floor", required=True, help="the measured tolerances")
    p.add_argument("--stop", type=int, required=True, help="the tune step leg a stopped at")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.set_defaults(func=cmd_check)
