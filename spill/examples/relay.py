"""``spill example relay [DIR]``: write a runnable relay folder (``write``; the two commands its
``relay.sh`` calls, ``relay-leg`` and ``relay-check``, are ``spill.examples.relay_check``'s). The
folder holds ``relay.sh`` (the legs and the checks, plain shell over spill's own commands),
``project/`` (a copy of an example project: ``tickets`` by default, ``toy`` for a run of seconds),
``noise-floor.json`` (the measured tolerances, shipped with spill from ``docs/reports``) and a
README. ``relay.sh`` takes its stop step from the noise floor (the step its moved builds were
stopped at), leg a's engine is torch and leg b's is MLX where MLX is installed, else torch again (a
second ``SPILL_HOME`` is still a second machine's cache).
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
