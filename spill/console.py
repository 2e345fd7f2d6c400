"""What a person sees: the pre-run line, progress (a bar on a terminal, plain lines elsewhere),
final tables. Scripts read ``--json``.

Progress and notices go to stderr, results and tables to stdout, so ``spill ... > file`` keeps
only results.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence

_quiet = False  # a process that does not speak for its job (a rank other than 0)


def quiet() -> None:
    """From now on this process prints no notes, progress or results (errors still go out)."""
    global _quiet
    _quiet = True


def speaking() -> bool:
    """Whether this process prints for its job (``quiet`` was not called)."""
    return not _quiet


def note(message: str) -> None:
    if not _quiet:
        print(message, file=sys.stderr, flush=True)


PROGRESS_EVERY = 30.0  # seconds between two plain progress lines (SPILL_PROGRESS_EVERY)


def progress(total: int, desc: str, unit: str = "row", initial: int = 0):
    """Progress on stderr: a tqdm bar on a terminal; elsewhere (nohup, CI, Slurm, ``| tee``) a
    plain line at a steady pace (``Lines``). ``initial``: what was done before this process
    (a resumed job). ``SPILL_PROGRESS``: ``bar`` (or ``1``) a bar anyway, ``lines`` lines
    anyway, ``0`` nothing."""
    how = os.environ.get("SPILL_PROGRESS", "").strip().lower()
    if how in ("0", "off", "none") or _quiet:
        return Lines(total, desc, unit, float("inf"), initial)
    if how in ("1", "bar") or not how and sys.stderr.isatty():
        bar = _bar()
        return bar(
            total=total, desc=desc, unit=unit, initial=initial, file=sys.stderr, dynamic_ncols=True
        )
    every = float(os.environ.get("SPILL_PROGRESS_EVERY") or PROGRESS_EVERY)
    return Lines(total, desc, unit, every, initial)


def _bar():
    """tqdm with ``checkpoint``, a no-op there: the bar already shows where the work is."""
    from tqdm import tqdm

    class Bar(tqdm):
        def checkpoint(self, what: str) -> None:
            pass

    return Bar


class Lines:
    """The part of tqdm's interface spill uses (``update``, ``set_postfix``, ``unit_scale``, a
    context manager) printing one plain line when ``every`` seconds passed since the last one,
    at a checkpoint (``checkpoint``) once the work has run that long, and at the end if it
    printed any: ``tune: step 12/80 (15%), loss 1.2345, 2.10 s/step, ETA 2m23s``. Work shorter
    than ``every`` prints nothing."""

    def __init__(self, total: int, desc: str, unit: str, every: float, initial: int = 0) -> None:
        self.total, self.desc, self.unit, self.every = total, desc, unit, every
        self.n = self.first = initial
        self.unit_scale = False
        self.postfix: dict[str, object] = {}
        self.clock = time.monotonic
        self.start = self.last = self.clock()
        self.printed = False
        self.shown = initial

    def __enter__(self) -> Lines:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.clock() - self.last >= self.every:
            self._line()

    def set_postfix(self, **values: object) -> None:
        self.postfix = values

    def checkpoint(self, what: str) -> None:
        if self.clock() - self.start >= self.every:
            self._line(what)

    def close(self) -> None:
        if self.printed and self.n != self.shown:  # what the last line said is still true
            self._line("done" if self.n >= self.total else "")

    def _count(self, n: float) -> str:
        if self.unit_scale and self.unit == "B":
            return f"{n / 1e6:.1f}"
        return f"{n:.0f}"

    def _line(self, what: str = "") -> None:
        now = self.clock()
        self.last, self.printed, self.shown = now, True, self.n
        done, seconds = self.n - self.first, now - self.start
        unit = "MB" if self.unit_scale and self.unit == "B" else self.unit
        parts = [f"{self.desc}: {unit} {self._count(self.n)}/{self._count(self.total)}"]
        if self.total:
            parts[0] += f" ({100 * self.n / self.total:.0f}%)"
        parts += [f"{k.replace('_', '/')} {v}" for k, v in self.postfix.items()]  # tok_s: tok/s
        if done > 0 and seconds > 0:
            if self.unit_scale and self.unit == "B":
                parts.append(f"{done / 1e6 / seconds:.0f} MB/s")
            else:
                parts.append(f"{seconds / done:.2f} s/{self.unit}")
            left = (self.total - self.n) * seconds / done
            if left > 0:
                parts.append(f"ETA {_duration(left)}")
        if what:
            parts.append(what)
        note(", ".join(parts))


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


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
    if _quiet:
        return
    if as_json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        print(table([result], columns))
