"""Wall time of each stage of the README's main command, ``spill build projects/tickets``, for
docs/reports (issue 13: before and after, on a quiet machine).

    python bench/stages.py [--python PY ...] [--project NAME] [--json OUT]

Each ``--python`` is an interpreter with a spill installed (default: this one), for example a
virtual environment of an older checkout; each builds a fresh copy of the project with a fresh
state and its own ``SPILL_HOME`` (the GGUF import of the first use is timed apart, by ``spill
models import`` before the build). A stage's time runs from the build's ``== <stage>:`` line on
stderr (the name before ": ") to the next one (the last to the process's end); the plan before the first stage is
"start". The builds run one after the other, in the order given.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def build(python: str, project: str) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="spill-stages-"))
    root = work / project
    shutil.copytree(REPO / "projects" / project, root, ignore=shutil.ignore_patterns(".spill"))
    env = dict(os.environ, SPILL_HOME=str(work / "home"), PYTHONUNBUFFERED="1")
    t = time.perf_counter()
    # cwd: the temp folder, so that ``-m spill`` imports each interpreter's own install, never
    # a spill/ in the folder this bench was started from
    subprocess.run([python, "-m", "spill", "models", "import", "smollm2:135m"], env=env,
                   check=True, capture_output=True, cwd=work)  # fmt: skip
    imported = time.perf_counter() - t
    which = [python, "-c", "import spill; print(spill.__file__)"]
    spill_at = subprocess.run(which, env=env, cwd=work, capture_output=True, text=True).stdout
    spill_at = spill_at.strip()
    t0 = time.perf_counter()
    proc = subprocess.Popen([python, "-m", "spill", "build", str(root), "--json"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=work)  # fmt: skip
    marks: list[tuple[str, float]] = [("start", 0.0)]
    assert proc.stderr is not None
    tail: list[str] = []
    for line in proc.stderr:
        tail = [*tail[-19:], line]
        if line.startswith("== ") and ":" in line:
            marks.append((line[3:].split(": ", 1)[0], time.perf_counter() - t0))
    out = proc.stdout.read() if proc.stdout else ""
    end = time.perf_counter() - t0
    if proc.wait() != 0:
        sys.exit(f"{python}: spill build exited {proc.returncode}:\n{''.join(tail)}")
    doc = json.loads(out)
    stages = {}
    for (name, at), nxt in zip(marks, [*marks[1:], ("end", end)], strict=True):
        stages[name] = round(nxt[1] - at, 1)
    shutil.rmtree(work)
    return {
        "python": python,
        "spill": spill_at,
        "import_s": round(imported, 1),
        "build_s": round(end, 1),
        "stages_s": stages,
        "scores": {s: doc["stages"][s]["result"].get("accuracy") for s in ("eval:base", "eval")},
        "numerics": doc["stages"]["tune"]["producers"][0]["numerics"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", action="append", help="an interpreter with spill installed")
    ap.add_argument("--project", default="tickets")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    # a path is made absolute: each build runs from its own temp folder
    pythons = [os.path.abspath(p) if os.sep in p else p for p in a.python or [sys.executable]]
    runs = [build(py, a.project) for py in pythons]
    for r in runs:
        parts = ", ".join(f"{k} {v} s" for k, v in r["stages_s"].items())
        print(f"{r['python']}: build {r['build_s']} s ({parts}); scores {r['scores']}")
    if len(runs) > 1:
        print(f"build time, last / first: {runs[-1]['build_s'] / runs[0]['build_s']:.2f}x")
    if a.json:
        a.json.write_text(json.dumps({"project": a.project, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
