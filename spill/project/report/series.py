"""A build's loss series, and the one-line sparkline ``spill status`` prints for them.

The train losses are the tune stage's newest committed checkpoint's ``losses`` (index i is step
i+1's loss; None where a step's loss was not finite) and the validation losses its ``valid``
(``[step, loss]`` pairs; absent when validation is off). Both are read from that checkpoint's
``state.json`` alone (``spill.payloads.newest``), so a finished build's status stays free of
numpy; a killed and resumed run shows the same series, since only committed steps are there.
"""

from __future__ import annotations

import math
from typing import Any

from spill.payloads.newest import newest_commit
from spill.project.build.stages import TUNE, Stage
from spill.store.location import Location

BARS = "▁▂▃▄▅▆▇█"
REWARDS = ("rewards/accuracies", "rewards/margins")  # a preference tune's, as the report draws
WIDTH = 40  # characters of a sparkline: longer series are averaged in buckets


def _number(x: Any) -> float | None:
    ok = isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
    return float(x) if ok else None


def losses(where: Location, stage: Stage = TUNE) -> dict[str, Any] | None:
    """``{"step": N, "train": [...], "valid": [[step, loss], ...]}`` of the tune stage's newest
    committed checkpoint at the state location ``where`` (``valid`` only when it has one; a
    preference tune's ``rewards``: each of ``REWARDS`` by step), or None without a checkpoint."""
    found = newest_commit(stage.place(where))
    if found is None:
        return None
    step, state = found
    raw = state.get("losses")
    out: dict[str, Any] = {
        "step": step,
        "train": [_number(x) for x in raw] if isinstance(raw, list) else [],
    }
    metrics = state.get("metrics")  # a preference tune's, one entry a step
    if isinstance(metrics, list) and metrics:
        out["rewards"] = {
            k: [_number(m.get(k)) if isinstance(m, dict) else None for m in metrics]
            for k in REWARDS
        }
    valid = state.get("valid")
    if isinstance(valid, list) and valid:
        pairs = [p for p in valid if isinstance(p, list | tuple) and len(p) == 2]
        out["valid"] = [[int(s), _number(v)] for s, v in pairs if isinstance(s, int)]
    return out


def sparkline(values: list[float | None], width: int = WIDTH) -> str:
    """``▇▅▃▂▁``: ``values`` in at most ``width`` bars (bucket means), scaled from their least
    to their greatest; a bucket with no finite value is a space."""
    if not values:
        return ""
    n = min(width, len(values))
    buckets: list[float | None] = []
    for i in range(n):
        part = [
            v for v in values[i * len(values) // n : (i + 1) * len(values) // n] if v is not None
        ]
        buckets.append(sum(part) / len(part) if part else None)
    known = [b for b in buckets if b is not None]
    if not known:
        return " " * n
    lo, hi = min(known), max(known)
    span = (hi - lo) or 1.0
    top = len(BARS) - 1
    return "".join(" " if b is None else BARS[round((b - lo) / span * top)] for b in buckets)


def _ends(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    return f"{known[0]:.4g} → {known[-1]:.4g}" if known else "no finite loss"


def lines(series: dict[str, Any] | None, name: str = TUNE.name) -> list[str]:
    """The lines under the table: ``tune loss  ▇▅▃▂▁  2.31 → 0.41 (300 steps)`` and, with
    validation, ``tune valid ...`` (its points in step order)."""
    if not series or not series.get("train"):
        return []
    train = series["train"]
    out = [f"{name} loss   {sparkline(train)}  {_ends(train)} ({len(train)} steps)"]
    if valid := series.get("valid"):
        points = [v for _, v in sorted(valid)]
        out.append(f"{name} valid  {sparkline(points)}  {_ends(points)} ({len(points)} points)")
    return out
