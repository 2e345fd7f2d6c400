"""``spill report`` through the real CLI on real tiny builds, its page opened in a real headless
Chromium (``browser_kit``): a relayed build (tune stopped at step 4 on float32, the run moved with
``spill move``, resumed on bfloat16: two legs), and a sweep of two jobs. The page renders its
charts (the DOM after load), its screenshot is not blank, and it requests nothing but itself.
Also: ``spill status`` draws the loss as a sparkline, ``spill build`` ends by naming the report.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ENGINES, assert_not_imported, cli_code, run_spill
from tests.func.browser_kit import chromium, file_url, open_page, png_pixels

ROOT = Path(__file__).resolve().parents[2]
FAST = ["tune.steps=8", "tune.ckpt_every=4"]


def spill(*args) -> subprocess.CompletedProcess:
    proc = run_spill(*map(str, args))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def copy_toy(dst: Path) -> Path:
    shutil.copytree(ROOT / "projects" / "toy", dst, ignore=shutil.ignore_patterns(".spill"))
    return dst


@pytest.fixture(scope="module")
def relayed(tmp_path_factory) -> dict:
    """Leg a: the build stops at tune step 4 (float32); the run moves; leg b resumes it on
    bfloat16 and finishes."""
    where = tmp_path_factory.mktemp("relay")
    source = copy_toy(where / "toy")
    spill("build", source, *FAST, "--stop-after", "tune:4")
    spill("move", source, where / "moved")
    resumed = spill("resume", where / "moved", "--dtype", "bfloat16")
    return {"project": where / "moved", "resumed": resumed}


@pytest.fixture(scope="module")
def swept(tmp_path_factory) -> Path:
    toy = copy_toy(tmp_path_factory.mktemp("sweep") / "toy")
    proc = run_spill("build", str(toy), "-m", *FAST, "tune.lr=0.005,0.02")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1].startswith(f"report: spill report {toy}")
    return toy


@pytest.fixture(scope="module")
def browser() -> str:
    found = chromium()
    if found is None:
        pytest.skip("no chromium on PATH: `apt-get install chromium` (or set SPILL_TEST_CHROMIUM)")
    return found


def svg(dom: str, chart: str) -> str:
    """The ``<svg data-chart=chart>`` element of the rendered page."""
    found = re.search(rf'<svg[^>]*data-chart="{re.escape(chart)}".*?</svg>', dom, re.S)
    assert found, f"no {chart} chart in the page"
    return found.group(0)


def paths(chart: str) -> dict[str, int]:
    """Each line of a chart: its data-series name -> how many points it draws."""
    out = {}
    for name, d in re.findall(r'<path class="series" data-series="([^"]*)"[^>]*d="([^"]*)"', chart):
        out[name] = len(re.findall(r"[ML]", d))
    return out


def report(project: Path, *more: str) -> Path:
    proc = spill("report", project, *more)
    written = Path(proc.stdout.strip().splitlines()[-1])
    assert written.is_file() and written.suffix == ".html"
    return written


def assert_not_blank(png: bytes) -> None:
    width, height, pixels = png_pixels(png)
    colors = {p[:3] for p in pixels}
    inked = sum(p[:3] != b"\xff\xff\xff" for p in pixels) / len(pixels)
    assert width > 300 and height > 400 and len(colors) > 50 and inked > 0.03, (len(colors), inked)


def test_build_names_the_report_and_status_draws_the_loss(relayed):
    project = relayed["project"]
    assert relayed["resumed"].stdout.splitlines()[-1] == f"report: spill report {project}"
    text = spill("status", project).stdout
    line = next(x for x in text.splitlines() if x.startswith("tune loss"))
    assert re.fullmatch(r"tune loss   [▁▂▃▄▅▆▇█]{8}  \S+ → \S+ \(8 steps\)", line), line
    doc = json.loads(spill("status", project, "--json").stdout)
    assert {"stages", "data", "adapter", "run", "notes"} <= doc.keys()
    assert len(doc["losses"]["tune"]["train"]) == 8 and doc["losses"]["tune"]["step"] == 8
    assert "valid" not in doc["losses"]["tune"]  # validation off: no series


def test_report_of_a_relay_in_chromium(relayed, browser, tmp_path):
    project = relayed["project"]
    page_path = report(project)
    assert page_path == project / "report.html"
    text = page_path.read_text()
    assert "<script" not in text and not re.search(r"\s(src|href)=", text)
    page = open_page(browser, file_url(page_path))
    assert page.requests == [file_url(page_path)]  # nothing but the file itself
    assert paths(svg(page.dom, "loss")) == {"train": 8}
    timeline = svg(page.dom, "timeline")
    legs = re.findall(r'<rect class="range" data-producer="([^"]*)"[^>]*>\s*<title>tune', timeline)
    assert [leg.split(" on ")[0] for leg in legs] == ["torch float32", "torch bfloat16"]
    assert "steps 0-4 on torch float32" in timeline and "steps 4-8 on torch bfloat16" in timeline
    state = json.loads(spill("report", project, "--json", "-o", tmp_path / "r.html").stdout)
    fingerprint = state["runs"][0]["models"][0]["fingerprint"]
    assert fingerprint.startswith("sha256:") and fingerprint[:19] in page.dom
    assert_not_blank(page.png)

    # the recorder is not blind: a page that fetches shows each request
    (tmp_path / "fetches.html").write_text(
        '<img src="http://127.0.0.1:9/x.png"><link rel="stylesheet" href="https://a.invalid/c">'
    )
    control = open_page(browser, file_url(tmp_path / "fetches.html"), settle_s=0.2)
    assert "http://127.0.0.1:9/x.png" in control.requests and len(control.requests) == 3


def test_status_of_a_sweep_draws_each_jobs_loss(swept):
    text = spill("status", swept).stdout
    assert text.count("\n  tune loss   ") == 2 and "tune.lr=0.02:" in text
    doc = json.loads(spill("status", swept, "--json").stdout)
    assert [len(v["train"]) for v in doc["losses"].values()] == [8, 8]


def test_a_sweep_overlaid_in_chromium(swept, browser):
    page = open_page(browser, file_url(report(swept, "-o", swept / "sweep.html")))
    assert page.requests == [file_url(swept / "sweep.html")]
    assert paths(svg(page.dom, "loss")) == {"tune.lr=0.005 train": 8, "tune.lr=0.02 train": 8}
    accuracy = svg(page.dom, "score:accuracy:tune.lr")
    assert paths(accuracy) == {"eval:base": 2, "eval": 2}
    assert len(re.findall(r'<circle class="point"', accuracy)) == 4
    assert len(re.findall(r'<rect class="range"', svg(page.dom, "timeline"))) == 6
    assert_not_blank(page.png)


def test_report_reads_the_state_only(relayed, tmp_path):
    """No engine, numpy or Hydra; and (where a network namespace can be made) no network."""
    out = tmp_path / "light.html"
    state = relayed["project"] / ".spill"  # a state location named instead of its project
    code = cli_code("report", str(state), "-o", str(out))
    proc = assert_not_imported(code, (*ENGINES, "numpy", "hydra", "transformers"))
    assert proc.stdout.splitlines()[-1] == "rc 0" and out.is_file()
    assert f"project <code>{relayed['project']}</code>" in out.read_text()
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "-n", "true"]).returncode != 0:
        return  # no namespace here (not root): the import check above stands
    offline = tmp_path / "offline.html"
    cmd = [unshare, "-n", sys.executable, "-m", "spill", "report", str(relayed["project"])]
    proc = subprocess.run(
        [*cmd, "-o", str(offline)], capture_output=True, text=True, env=os.environ
    )
    assert proc.returncode == 0 and offline.is_file(), proc.stderr


def test_report_refusals(tmp_path, relayed):
    empty = copy_toy(tmp_path / "empty")
    proc = run_spill("report", str(empty))
    assert proc.returncode != 0 and "`spill build" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    proc = run_spill("report", str(relayed["project"]), "-o", str(tmp_path / "no" / "r.html"))
    assert proc.returncode != 0 and "give -o a writable file" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
