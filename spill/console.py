"""What a person sees: the pre-run line, progress bars, final tables. Scripts read ``--json``.

Progress and notices go to stderr, results and tables to stdout, so ``spill ... > file`` keeps
only results.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence


def note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def progress(total: int, desc: str, unit: str = "row"):
    """A tqdm bar on stderr; silent when stderr is not a terminal unless SPILL_PROGRESS=1."""
    import os

    from tqdm import tqdm

    disable = not (sys.stderr.isatty() or os.environ.get("SPILL_PROGRESS") == "1")
    return tqdm(
        total=total, desc=desc, unit=unit, file=sys.stderr, disable=disable, dynamic_ncols=True
    )


def table(rows: Sequence[dict], columns: Sequence[str] | None = None) -> str:
    """A plain aligned text table of dicts."""
    if not rows:
        return ""
    columns = list(columns or rows[0].keys())
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += [
        "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    return "\n".join(lines)


def emit(result: dict, as_json: bool, columns: Sequence[str] | None = None) -> None:
    """Print a result as a one-row table, or as JSON for scripts."""
    if as_json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        print(table([result], columns))
