"""A project made of preference pairs: ``spill init DATA.csv --input COL --chosen COL --rejected
COL`` writes a DPO project, and ``spill build`` runs eval:base -> tune (dpo) -> eval, each eval
grading preference accuracy (the chosen answer's mean token log-prob above the rejected one's,
both tokenized as the tune sees them) beside today's scores.

The data: a keyword (north or south) hidden among filler words decides which of "up" and "down"
is the better answer. The tiny model (4 layers, hidden 64) starts at chance and DPO lifts it.
"""

from __future__ import annotations

import csv
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

FILLER = "the a of to and in is it for on with as at by this from".split()


def write_pairs(path: Path, n: int = 160) -> Path:
    rng = random.Random(1)
    rows = []
    for _ in range(n):
        key = rng.choice(["north", "south"])
        good, bad = ("up", "down") if key == "north" else ("down", "up")
        rows.append({"text": " ".join([*rng.sample(FILLER, 3), key]), "good": good, "bad": bad})
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["text", "good", "bad"])
        w.writeheader()
        w.writerows(rows)
    return path


def spill(*args: str, home: Path, ok: bool = True) -> subprocess.CompletedProcess:
    env = os.environ | {"SPILL_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    got = subprocess.run(
        [sys.executable, "-m", "spill", *args], env=env, capture_output=True, text=True
    )
    if ok:
        assert got.returncode == 0, got.stderr[-3000:]
    return got


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefs")
    home = root / "home"
    data = write_pairs(root / "kw.csv")
    project = root / "kw"
    made = spill(
        *("init", str(data), "--input", "text", "--chosen", "good", "--rejected", "bad"),
        *("--project", str(project), "--model", "tiny:llama:1"),
        home=home,
    )
    overrides = ["tune.steps=200", "tune.lr=0.01", "tune.beta=1.0", "tune.targets=all"]
    overrides += ["tune.micro_batch=8", "engine.dtype=float32"]
    done = spill("build", str(project), *overrides, "--json", home=home)
    return {"project": project, "home": home, "init": made, "build": json.loads(done.stdout)}


def test_init_writes_a_dpo_project(built):
    text = (built["project"] / "spill.yaml").read_text()
    assert "rejected: bad" in text and "method: dpo" in text and "output: good" in text
    assert "preference pairs, tuned by DPO" in built["init"].stderr


def test_the_build_grades_preference_before_and_after(built):
    stages = built["build"]["stages"]
    base, tuned = stages["eval:base"]["result"], stages["eval"]["result"]
    assert base["pairs"] == tuned["pairs"] == 32
    assert base["preference_accuracy"] <= 0.6  # chance, for a random model
    assert tuned["preference_accuracy"] >= base["preference_accuracy"] + 0.2
    tune = stages["tune"]["result"]
    assert tune["rewards/accuracies"] == 1.0 and tune["rewards/margins"] > 0
    rows = [json.loads(line) for line in (built["project"] / ".spill/files/eval.jsonl").open()]
    assert all("prefers_answer" in r and len(r["pair_logprob_per_token"]) == 2 for r in rows)


def test_a_rebuild_is_up_to_date(built):
    overrides = ["tune.steps=200", "tune.lr=0.01", "tune.beta=1.0", "tune.targets=all"]
    overrides += ["tune.micro_batch=8", "engine.dtype=float32"]
    again = spill("build", str(built["project"]), *overrides, "--json", home=built["home"])
    plan = json.loads(again.stdout)["plan"]
    assert {p["action"] for p in plan} <= {"done", "skip"}, plan  # nothing runs again


def test_refusals_are_one_line(tmp_path):
    home, data = tmp_path / "home", write_pairs(tmp_path / "kw.csv")
    bad = spill(
        *("init", str(data), "--input", "text", "--chosen", "good"),
        *("--project", str(tmp_path / "p1")),
        home=home,
        ok=False,
    )
    assert bad.returncode == 2 and "give --rejected COL too" in bad.stderr
    same = tmp_path / "same.csv"
    same.write_text("text,good,bad\nhello,up,up\nhi,down,up\n")
    twice = spill(
        *("init", str(same), "--input", "text", "--chosen", "good", "--rejected", "bad"),
        *("--project", str(tmp_path / "p2")),
        home=home,
        ok=False,
    )
    assert "needs two different answers" in twice.stderr
    assert len(twice.stderr.strip().splitlines()) == 1


def test_the_report_draws_the_rewards_and_scores_preference(built, tmp_path):
    out = tmp_path / "report.html"
    spill("report", str(built["project"]), "-o", str(out), home=built["home"])
    page = out.read_text()
    assert "rewards/accuracies" in page and "rewards/margins" in page and "prefers chosen" in page
