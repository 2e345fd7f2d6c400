"""The charts of ``spill report`` as inline SVG strings, drawn here with no library: a line chart
(loss by step, a score by a swept value) and a timeline of ranges (who computed which steps or
rows of each stage).

Every mark carries a class (``series``, ``point``, ``range``) and a ``data-`` name, and a
``<title>`` a browser shows on hover, so a test (or a reader of the DOM) can find each run's line.
A series breaks where a value is missing (a step whose loss was not finite); a log scale is used
where positive values span more than two decades (a loss from 10 to 0.001 stays readable).
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field

PALETTE = (
    "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e",
    "#17becf", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
)  # fmt: skip
WIDTH = 760
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 28, 40  # margins of the plot area
LEGEND_ROW = 18


def esc(x: object) -> str:
    return html.escape(str(x), quote=True)


def fmt(v: float) -> str:
    return f"{v:.4g}"


@dataclass
class Series:
    name: str
    points: list[tuple[float, float | None]]  # (x, y); y None: a gap
    color: str = PALETTE[0]
    dash: bool = False
    markers: bool = False  # a circle at each point (few points: scores, validation losses)
    group: str = ""  # data-run: the run it belongs to
    tips: list[str] = field(default_factory=list)  # per point, for its <title>


def color(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """Round values from ``lo`` to ``hi``, about ``n`` of them (1, 2 or 5 times a power of 10)."""
    if not hi > lo:
        lo, hi = lo - 0.5, hi + 0.5
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


class _Scale:
    """Data to pixels on one axis; ``log``: by log10 of the value."""

    def __init__(self, lo: float, hi: float, a: float, b: float, log: bool = False):
        self.log = log
        f = math.log10 if log else float
        self.lo, self.hi = f(lo), f(hi)
        if self.hi == self.lo:
            self.lo, self.hi = self.lo - 0.5, self.hi + 0.5
        self.a, self.b = a, b

    def __call__(self, v: float) -> float:
        t = math.log10(v) if self.log else v
        return self.a + (t - self.lo) / (self.hi - self.lo) * (self.b - self.a)

    def ticks(self) -> list[float]:
        if not self.log:
            return ticks(self.lo, self.hi)
        decades = [10.0**k for k in range(math.ceil(self.lo), math.floor(self.hi) + 1)]
        return decades if len(decades) >= 2 else ticks(10**self.lo, 10**self.hi)


def _legend(names: list[tuple[str, str, bool]], y0: float, width: int) -> tuple[str, int]:
    """Swatches and names, as many a row as fit; (svg, height)."""
    out, x, y, per = [], LEFT, y0, 0
    for name, c, dash in names:
        w = 34 + 7 * min(len(name), 90)
        if x + w > width and per:
            x, y, per = LEFT, y + LEGEND_ROW, 0
        style = ' stroke-dasharray="5 3"' if dash else ""
        out.append(
            f'<g class="legend-item"><line x1="{x}" y1="{y}" x2="{x + 24}" y2="{y}" '
            f'stroke="{c}" stroke-width="3"{style}/><text x="{x + 30}" y="{y + 4}">'
            f"{esc(name[:90])}</text></g>"
        )
        x, per = x + w, per + 1
    return "".join(out), (int(y - y0) + LEGEND_ROW if names else 0)


def line_chart(
    series: list[Series],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    categories: list[str] | None = None,  # x values 0..n-1 are these names
    ylim: tuple[float, float] | None = None,  # at least this y range (accuracy: 0 to 1)
    chart: str = "",  # data-chart: what it shows
    width: int = WIDTH,
    height: int = 300,
) -> str:
    """One chart: each series a path (broken at gaps) and, with ``markers``, a circle a point."""
    xs = [x for s in series for x, y in s.points if y is not None]
    ys = [y for s in series for x, y in s.points if y is not None]
    if not ys:
        return f'<p class="empty">{esc(title)}: nothing to draw yet</p>'
    log = ylim is None and min(ys) > 0 and max(ys) / min(ys) > 100
    pad = 0.5 if categories else 0.0
    sx = _Scale(min(xs) - pad, max(xs) + pad, LEFT, width - RIGHT)
    lo, hi = (min(ys), max(ys)) if log else (min(ys + [0.0]), max(ys))
    if ylim:
        lo, hi = min(lo, ylim[0]), max(hi, ylim[1])
    sy = _Scale(lo, hi, height - BOTTOM, TOP, log=log)
    parts = [f'<text class="title" x="{LEFT}" y="16">{esc(title)}</text>']
    for t in sy.ticks():
        y = sy(t)
        parts.append(
            f'<line class="grid" x1="{LEFT}" y1="{y:.1f}" x2="{width - RIGHT}" y2="{y:.1f}"/>'
            f'<text class="tick" x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{fmt(t)}</text>'
        )
    xt = list(range(len(categories))) if categories else sx.ticks()
    for i, t in enumerate(xt):
        x = sx(t)
        label = categories[i] if categories else fmt(t)
        parts.append(
            f'<text class="tick" x="{x:.1f}" y="{height - BOTTOM + 16}" text-anchor="middle">'
            f"{esc(label[:24])}</text>"
        )
    parts.append(
        f'<line class="axis" x1="{LEFT}" y1="{height - BOTTOM}" x2="{width - RIGHT}" '
        f'y2="{height - BOTTOM}"/><line class="axis" x1="{LEFT}" y1="{TOP}" x2="{LEFT}" '
        f'y2="{height - BOTTOM}"/>'
        f'<text class="label" x="{(LEFT + width - RIGHT) / 2}" y="{height - 6}" '
        f'text-anchor="middle">{esc(xlabel)}</text>'
        f'<text class="label" x="14" y="{(TOP + height - BOTTOM) / 2}" text-anchor="middle" '
        f'transform="rotate(-90 14 {(TOP + height - BOTTOM) / 2})">'
        f"{esc(ylabel)}{' (log scale)' if log else ''}</text>"
    )
    for s in series:
        d, pen = [], "M"
        for x, y in s.points:
            if y is None:
                pen = "M"
                continue
            d.append(f"{pen}{sx(x):.1f},{sy(y):.1f}")
            pen = "L"
        dash = ' stroke-dasharray="5 3"' if s.dash else ""
        parts.append(
            f'<path class="series" data-series="{esc(s.name)}" data-run="{esc(s.group)}" '
            f'd="{" ".join(d)}" fill="none" stroke="{s.color}" stroke-width="2"{dash}/>'
        )
        if s.markers:
            for i, (x, y) in enumerate(s.points):
                if y is None:
                    continue
                tip = s.tips[i] if i < len(s.tips) else f"{s.name}: {fmt(x)}, {fmt(y)}"
                parts.append(
                    f'<circle class="point" data-series="{esc(s.name)}" cx="{sx(x):.1f}" '
                    f'cy="{sy(y):.1f}" r="4" fill="{s.color}"><title>{esc(tip)}</title></circle>'
                )
    legend, extra = _legend([(s.name, s.color, s.dash) for s in series], height + 8, width)
    total = height + extra + 8
    return (
        f'<svg class="chart" data-chart="{esc(chart)}" xmlns="http://www.w3.org/2000/svg" '
        f'width="{width}" height="{total}" viewBox="0 0 {width} {total}" role="img" '
        f'aria-label="{esc(title)}">{"".join(parts)}{legend}</svg>'
    )


def timeline(rows: list[dict], colors: dict[str, str], *, width: int = WIDTH) -> str:
    """A bar per row (``label``, ``total``, ``unit``, ``ranges`` of ``from``/``to``/``label``),
    each range filled with its producer's color; what no producer has computed yet stays grey."""
    if not rows:
        return '<p class="empty">no stage has run yet</p>'
    name_w, bar_h, gap = 240, 18, 8
    x0, x1 = name_w, width - RIGHT
    parts = []
    for i, row in enumerate(rows):
        y = TOP + i * (bar_h + gap)
        total = max(int(row["total"] or 0), 1)
        parts.append(
            f'<text class="tick" x="{name_w - 8}" y="{y + 13}" text-anchor="end">'
            f"{esc(row['label'][:34])}</text>"
            f'<rect class="todo" x="{x0}" y="{y}" width="{x1 - x0}" height="{bar_h}"/>'
        )
        for r in row["ranges"]:
            a = x0 + (x1 - x0) * min(r["from"], total) / total
            b = x0 + (x1 - x0) * min(r["to"], total) / total
            tip = f"{row['label']}: {row['unit']}s {r['from']}-{r['to']} on {r['label']}"
            parts.append(
                f'<rect class="range" data-producer="{esc(r["label"])}" x="{a:.1f}" y="{y}" '
                f'width="{max(b - a, 1):.1f}" height="{bar_h}" fill="{colors[r["label"]]}">'
                f"<title>{esc(tip)}</title></rect>"
            )
            if b - a > 40:
                parts.append(
                    f'<text class="inbar" x="{(a + b) / 2:.1f}" y="{y + 13}" '
                    f'text-anchor="middle">{r["from"]}-{r["to"]}</text>'
                )
    height = TOP + len(rows) * (bar_h + gap)
    legend, extra = _legend([(k, c, False) for k, c in colors.items()], height + 10, width)
    total_h = height + extra + 12
    title = '<text class="title" x="8" y="16">who computed which steps and rows</text>'
    return (
        f'<svg class="chart" data-chart="timeline" xmlns="http://www.w3.org/2000/svg" '
        f'width="{width}" height="{total_h}" viewBox="0 0 {width} {total_h}" role="img" '
        f'aria-label="timeline">{title}{"".join(parts)}{legend}</svg>'
    )
