"""``spill models list`` and ``spill models verify``: the cache as a table (or JSON), and a full
re-hash of model files against the sha256 recorded when they entered the cache."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from spill.console import table
from spill.models.cache import list_models
from spill.models.integrity import ModelChanged, verify


def list_command(as_json: bool) -> None:
    models = list_models()
    if as_json:
        print(json.dumps(models, indent=2, sort_keys=True))
        return
    if not models:
        print(
            "no models cached yet; `spill models import smollm2:135m` or `spill run <model> ...` adds one"
        )
        return
    rows = [
        {
            "name": m["name"],
            "size": f"{m['bytes'] / 1e6:.1f} MB",
            "source": m["source"],
            "hashes": m["hashes"] or "none",
            "fingerprint": (m["fingerprint"] or "-")[:19],
            "problem": m["error"] or "",
        }
        for m in models
    ]
    print(table(rows))


def verify_command(name: str | None, as_json: bool, progress: Callable[[str], object]) -> None:
    """Verify ``name`` (as ``spill run`` takes it) or every cached model; print a table, one line
    per changed, missing or added file on stderr, and raise ``ModelChanged`` if there is any."""
    from spill.models.resolve import resolve_model

    if name:
        targets = [(name, Path(resolve_model(name, progress=progress).folder))]
    else:
        targets = [(m["name"], Path(m["folder"])) for m in list_models()]
    results = []
    for label, folder in targets:
        r = verify(folder)
        results.append(
            {
                "name": label,
                "folder": str(folder),
                "files": r.files,
                "bytes": r.bytes,
                "status": r.status,
                "seconds": round(r.seconds, 3),
                "problems": r.problems,
            }
        )
    if as_json:
        print(json.dumps(results, indent=2, sort_keys=True))
    elif not results:
        print("no models cached yet; nothing to verify")
    else:
        cols = ("files", "status")
        rows = [
            {"model": r["name"], **{c: r[c] for c in cols}}
            | {"bytes": f"{r['bytes'] / 1e6:.1f} MB", "seconds": f"{r['seconds']:.2f}"}
            for r in results
        ]
        print(table(rows, ["model", "files", "bytes", "status", "seconds"]))
    sys.stdout.flush()
    problems = [line for r in results for line in r["problems"]]
    for line in problems:
        print(line, file=sys.stderr)
    bad = [r["name"] for r in results if r["problems"]]
    if bad:
        raise ModelChanged(
            f"{len(problems)} problem(s) in {', '.join(bad)} (each named above); re-fetch or "
            "re-import the model, or delete its folder"
        )
