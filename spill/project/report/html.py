"""The page of ``spill report``: one self-contained HTML file drawn from ``report.gather``'s dict.

Its style sheet is inline and its charts are inline SVG (``report_svg``); it has no script, no
font or image to fetch and no link that loads anything, so it opens the same from a laptop, an
air-gapped cluster or a mail attachment. Sections: each build's stage table, the loss of every
run overlaid (validation dashed, where there is one), each score against each swept parameter,
who computed which steps and rows, and the models with their fingerprints.
"""

from __future__ import annotations

from typing import Any

from spill import __version__
from spill.project.report.series import REWARDS
from spill.project.report.svg import Series, color, esc, line_chart, timeline

STYLE = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px auto;
max-width:1000px;padding:0 16px;color:#1b1f24;background:#fff}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid
#d0d7de;padding-bottom:4px}h3{font-size:14px;margin:16px 0 6px}
.meta{color:#57606a;margin:0 0 4px}code{font:12px ui-monospace,Menlo,Consolas,monospace}
table{border-collapse:collapse;margin:6px 0 10px}th,td{border:1px solid #d0d7de;
padding:3px 8px;text-align:left;vertical-align:top}th{background:#f6f8fa}
td.done{color:#1a7f37}td.stopped,td.running{color:#9a6700}td.out{color:#cf222e}
.note{color:#9a6700}.empty{color:#57606a;font-style:italic}
svg.chart{display:block;margin:8px 0 14px;background:#fff}
svg text{font:11px system-ui,sans-serif;fill:#1b1f24}svg text.title{font-size:13px;
font-weight:600}svg .grid{stroke:#eaeef2}svg .axis{stroke:#57606a}svg .todo{fill:#eaeef2}
svg text.inbar{fill:#fff;font-size:10px}
"""


def _table(rows: list[dict[str, Any]], cls: str = "", raw: tuple[str, ...] = ()) -> str:
    """An HTML table of ``rows`` (their keys the header); ``raw``: columns already HTML."""
    if not rows:
        return '<p class="empty">nothing yet</p>'
    keys = list(rows[0])
    head = "".join(f"<th>{esc(k)}</th>" for k in keys)
    body = []
    for r in rows:
        cells = []
        for k in keys:
            state = str(r[k]).split(" ")[0] if k == "status" else ""
            klass = f' class="{esc(state)}"' if state else ""
            cells.append(f"<td{klass}>{r[k] if k in raw else esc(r[k])}</td>")
        body.append(f"<tr>{''.join(cells)}</tr>")
    return f'<table class="{cls}"><tr>{head}</tr>{"".join(body)}</table>'


def _stages(report: dict[str, Any]) -> str:
    out = []
    for run in report["runs"]:
        given = esc(", ".join(run["overrides"]) or "no overrides")
        out.append(f"<h3>{esc(run['label'])} <span class='meta'>({given})</span></h3>")
        out.append(f"<p class='meta'>state <code>{esc(run['state'])}</code></p>")
        out.append(_table(run["table"], "stages"))
        out += [f"<p class='note'>note: {esc(n)}</p>" for n in run["notes"]]
    return "".join(out)


def loss_chart(runs: list[dict[str, Any]]) -> str:
    """Every run's train loss by step, its validation loss (dashed, a point each) beside it."""
    series = []
    for i, run in enumerate(runs):
        found = run.get("losses") or {}
        train = found.get("train") or []
        prefix = f"{run['label']} " if len(runs) > 1 else ""
        if train:
            points = [(step + 1.0, y) for step, y in enumerate(train)]
            series.append(Series(f"{prefix}train", points, color(i), group=run["name"]))
        if valid := found.get("valid"):
            points = [(float(s), y) for s, y in sorted(valid)]
            series.append(
                Series(f"{prefix}validation", points, color(i), True, True, group=run["name"])
            )
    if not series:
        return '<p class="empty">no tune stage has committed a checkpoint yet</p>'
    return line_chart(series, title="loss", xlabel="step", ylabel="loss", chart="loss")


def reward_charts(runs: list[dict[str, Any]]) -> str:
    """A preference tune's reward accuracy and margin by step (TRL's names); nothing otherwise."""
    out = []
    for name in REWARDS:
        series = []
        for i, run in enumerate(runs):
            values = ((run.get("losses") or {}).get("rewards") or {}).get(name) or []
            prefix = f"{run['label']} " if len(runs) > 1 else ""
            if values:
                points = [(step + 1.0, y) for step, y in enumerate(values)]
                series.append(Series(f"{prefix}{name}", points, color(i), group=run["name"]))
        if series:
            ylim = (0.0, 1.0) if name.endswith("accuracies") else None
            out.append(
                line_chart(
                    series,
                    title=name,
                    xlabel="step",
                    ylabel=name,
                    ylim=ylim,
                    chart=f"tune:{name}",
                )  # fmt: skip
            )
    return "".join(out)


def score_charts(report: dict[str, Any]) -> str:
    """For a sweep: each score of each eval stage against each swept parameter."""
    out = []
    for key, points in report["swept"].items():
        numbers = all(isinstance(p["value"], float) for p in points)
        order = sorted(range(len(points)), key=lambda i: points[i]["value"] if numbers else i)
        cats = None if numbers else [str(points[i]["value"]) for i in order]
        stages = list(dict.fromkeys(s for p in points for s in p["scores"]))  # in build order
        labels = list(dict.fromkeys(k for p in points for v in p["scores"].values() for k in v))
        for label in labels:
            series = []
            for j, stage in enumerate(stages):
                pts, tips = [], []
                for n, i in enumerate(order):
                    p = points[i]
                    y = (p["scores"].get(stage) or {}).get(label)
                    pts.append((p["value"] if numbers else float(n), y))
                    tips.append(f"{p['run']}: {stage} {label} {y}")
                series.append(Series(stage, pts, color(j), markers=True, tips=tips))
            ylim = (0.0, 1.0) if label == "accuracy" else None
            chart = line_chart(
                series, title=f"{label} against {key}", xlabel=key, ylabel=label,
                categories=cats, ylim=ylim, chart=f"score:{label}:{key}",
            )  # fmt: skip
            out.append(chart)
    return "".join(out)


def _scores_table(runs: list[dict[str, Any]]) -> str:
    rows = []
    for run in runs:
        for stage, scores in run["scores"].items():
            shown = {k: "" if v is None else f"{v:.4g}" for k, v in scores.items()}
            rows.append({"run": run["label"], "stage": stage, **shown})
    return _table(rows, "scores")


def _timeline(runs: list[dict[str, Any]]) -> str:
    colors: dict[str, str] = {}
    rows = []
    for run in runs:
        for entry in run["timeline"]:
            for r in entry["ranges"]:
                colors.setdefault(r["label"], color(len(colors)))
            name = f"{run['label']} · {entry['stage']}" if len(runs) > 1 else entry["stage"]
            rows.append({**entry, "label": f"{name} ({entry['total']} {entry['unit']}s)"})
    return timeline(rows, colors)


def _models(runs: list[dict[str, Any]]) -> str:
    rows = []
    for run in runs:
        for m in run["models"]:
            fp = m["fingerprint"] or ""
            tip = esc(f"{fp} ({', '.join(m['files'])})")
            short = f"<code title='{tip}'>{esc(fp[:19])}</code>" if fp else ""
            sfp = m["stage_fingerprint"] or ""
            rows.append(
                {
                    "run": run["label"],
                    "stage": m["stage"],
                    "model": m["model"] or "",
                    "pinned to": m["pinned"] or "(no job state)",
                    "model fingerprint": short,
                    "quantized": m["quantization"] or m["quantize"] or "float",
                    "stage fingerprint": f"<code title='{esc(sfp)}'>{esc(sfp[:19])}</code>",
                }
            )
    return _table(rows, "models", raw=("model fingerprint", "stage fingerprint"))


def _data(report: dict[str, Any]) -> str:
    data = next((r["data"] for r in report["runs"] if r.get("data")), None) or {}
    if not data:
        return ""
    sha = str(data.get("sha256", ""))
    valid = f"{esc(data['valid'])} to validate, " if data.get("valid") else ""
    return (
        f"<p class='meta'>data <code>{esc(data.get('file', ''))}</code>: {esc(data.get('rows'))} "
        f"rows ({esc(data.get('train'))} to train on, {valid}{esc(data.get('test'))} held "
        "out), "
        f"{esc(data.get('task'))}, <code title='{esc(sha)}'>{esc(sha[:19])}</code></p>"
    )


def page(report: dict[str, Any]) -> str:
    """The whole page, as text."""
    runs = report["runs"]
    sweep = (
        score_charts(report)
        if report["swept"]
        else '<p class="empty">not a sweep: no parameter was swept (spill build -m)</p>'
    )
    body = [
        f"<h1>spill report: {esc(report['project'])}</h1>",
        f"<p class='meta'>project <code>{esc(report['folder'])}</code> · state "
        f"<code>{esc(report['state'])}</code> · {len(runs)} build{'s' * (len(runs) != 1)} · "
        f"made {esc(report['generated'])}</p>",
        _data(report),
        "<h2 id='stages'>Stages</h2>",
        _stages(report),
        "<h2 id='loss'>Loss</h2>",
        loss_chart(runs),
        reward_charts(runs),
        "<h2 id='scores'>Scores</h2>",
        _scores_table(runs),
        sweep,
        "<h2 id='timeline'>Where it ran</h2>",
        _timeline(runs),
        "<h2 id='models'>Models</h2>",
        _models(runs),
        f"<p class='meta'>spill {esc(__version__)} · one file: no scripts, nothing fetched</p>",
    ]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>spill report: {esc(report['project'])}</title><style>{STYLE}</style></head>"
        f"<body>{''.join(body)}</body></html>\n"
    )
