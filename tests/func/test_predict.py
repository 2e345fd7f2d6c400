"""``spill predict`` through the real CLI on a built toy project: labels chosen as ``spill eval``
scores them, --text and --generate, a real SIGTERM and --stop-after with --state, bad input.

The toy project (a tiny llama, 300 tune steps) builds in seconds; it is built once per module.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spill.store.location import location
from tests.conftest import run_spill

ROOT = Path(__file__).resolve().parents[2]
TOY = ROOT / "projects" / "toy"
MODEL = "tiny:llama:2:2x64"  # the toy project's model.name
ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def validate(row: dict) -> None:
    """Against the repository's schema file (an editable install may map ``spill.schemas``
    to another checkout)."""
    import jsonschema

    schema = json.loads((ROOT / "schemas" / "predict-row.schema.json").read_text())
    jsonschema.validate(row, schema, cls=jsonschema.Draft202012Validator)


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> dict:
    where = tmp_path_factory.mktemp("predict")
    home = where / "home"
    project = where / "toy"
    shutil.copytree(TOY, project, ignore=shutil.ignore_patterns(".spill", "__pycache__"))
    env = {**ENV, "SPILL_HOME": str(home)}
    proc = run_spill("build", str(project), "--json", env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    # new inputs: the held-out rows' texts, with ids, as a user's CSV would give them
    held = _read(project / ".spill" / "files" / "test.jsonl")
    csv = where / "new.csv"
    lines = ["id,text"] + [f"n{r['id']},{r['input']}" for r in held]
    csv.write_text("\n".join(lines) + "\n")
    return {
        "project": project,
        "home": home,
        "env": env,
        "held": held,
        "csv": csv,
        "build": json.loads(proc.stdout),
    }


def spill(toy: dict, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return run_spill(*args, env=toy["env"], cwd=cwd, timeout=120)


def test_build_says_where_the_adapter_is_and_how_to_predict(toy):
    adapter = toy["project"] / ".spill" / "adapters" / "toy"
    assert toy["build"]["adapter"] == str(adapter)
    again = spill(toy, "build", str(toy["project"]))  # finished: the table, then the two lines
    assert again.returncode == 0, again.stderr
    tail = again.stdout.splitlines()[-3:]
    assert tail[0] == f"adapter: {adapter}/ (spill, PEFT and MLX-LM layouts)"
    assert tail[1] == (
        f'predict: spill predict {toy["project"]} INPUT.csv --out OUT.jsonl, or --text "..."'
    )
    assert tail[2] == f"report: spill report {toy['project']}"  # and how to see it all


def test_labels_are_those_eval_scores_highest(toy, tmp_path):
    """Every held-out row is graded by ``spill eval`` once per label (answer = that label):
    predict's label is the one whose gold log-prob is highest, with the same log-probs."""
    out = tmp_path / "pred.jsonl"
    proc = spill(toy, "predict", str(toy["project"]), str(toy["csv"]), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "spill predict · model tiny:llama:2:2x64" in proc.stderr  # the pre-run line
    header = proc.stdout.splitlines()[0].split()
    assert header == ["rows", "labels", "seconds", "engine", "numerics"]
    rows = _read(out)
    labels = toy["build"]["stages"]["eval"]["result"]["labels"]
    assert [r["id"] for r in rows] == [f"n{r['id']}" for r in toy["held"]]  # input order
    for r in rows:
        validate(r)
        assert set(r["logprobs"]) == set(labels)

    graded = tmp_path / "graded.jsonl"
    graded.write_text(
        "".join(
            json.dumps({"id": f"n{h['id']}|{label}", "prompt": h["prompt"], "answer": label}) + "\n"
            for h in toy["held"]
            for label in sorted(labels)
        )
    )
    adapter = toy["project"] / ".spill" / "adapters" / "toy"
    scored = tmp_path / "scored.jsonl"
    args = ["eval", MODEL, str(graded), "--adapter", str(adapter), "--out", str(scored)]
    proc = spill(toy, *args, "--dtype", "float32", "--max-new-tokens", "1")
    assert proc.returncode == 0, proc.stderr
    by_row: dict[str, dict[str, float]] = {}
    for e in _read(scored):
        rid, label = e["id"].split("|")
        by_row.setdefault(rid, {})[label] = e["gold_logprob"]
    for r in rows:
        theirs = by_row[r["id"]]
        assert r["label"] == max(sorted(theirs), key=lambda k: theirs[k])
        for label, lp in theirs.items():  # batches pad differently: equal to float32 noise
            assert abs(r["logprobs"][label] - lp) < 1e-4, (r["id"], label)
        z = sum(math.exp(v - max(r["logprobs"].values())) for v in r["logprobs"].values())
        assert abs(r["probability"] - 1 / z) < 1e-5
    # the tuned adapter solves the held-out rows, so predict agrees with their labels
    assert [r["label"] for r in rows] == [h["answer"] for h in toy["held"]]


def test_text_and_generate(toy, tmp_path):
    held = toy["held"][0]
    one = spill(toy, "predict", str(toy["project"]), "--text", held["input"])
    assert one.returncode == 0, one.stderr
    label, rest = one.stdout.strip().split("  ")
    assert label == held["answer"] and rest.startswith("(probability 0.")
    as_json = spill(toy, "predict", "--text", held["input"], "--json", cwd=toy["project"])
    assert as_json.returncode == 0, as_json.stderr  # DIR defaults to the current folder
    got = json.loads(as_json.stdout)
    assert got["label"] == held["answer"] and 0.5 < got["probability"] <= 1
    text = spill(toy, "predict", str(toy["project"]), "--text", held["input"], "--generate")
    assert text.returncode == 0, text.stderr
    assert text.stdout.strip() == held["answer"]  # greedy: the tuned model says the label

    out = tmp_path / "gen.jsonl"
    proc = spill(
        toy, "predict", str(toy["project"]), str(toy["csv"]), "--out", str(out), "--generate"
    )
    assert proc.returncode == 0, proc.stderr
    rows = _read(out)
    for r in rows:
        validate(r)
    assert [r["text"].strip() for r in rows] == [h["answer"] for h in toy["held"]]


def _many(toy: dict, path: Path, n: int) -> Path:
    data = (toy["project"] / "toy.csv").read_text().splitlines()[1 : n + 1]
    path.write_text("text\n" + "\n".join(line.rsplit(",", 1)[0] for line in data) + "\n")
    return path


def _committed_ids(state: Path) -> list:
    from spill.control.place import Place
    from spill.payloads.rows import commit_markers

    return [rid for m in commit_markers(Place(location(state))) for rid in m["row_ids"]]


def test_sigterm_keeps_the_committed_rows_and_the_rerun_finishes(toy, tmp_path):
    """A real SIGTERM while the second segment is being pushed (the drill pauses the process
    there with SIGSTOP): exit 75, 50 rows committed; the same command continues."""
    src = _many(toy, tmp_path / "many.csv", 60)
    ref, out, state = tmp_path / "ref.jsonl", tmp_path / "out.jsonl", tmp_path / "state"
    base = ["predict", str(toy["project"]), str(src), "--batch", "1"]
    proc = spill(toy, *base, "--out", str(ref))
    assert proc.returncode == 0, proc.stderr
    args = [*base, "--out", str(out), "--state", str(state)]
    child = subprocess.Popen(
        [sys.executable, "-m", "spill", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **toy["env"], "SPILL_DRILL": "seg-before-commit@2:stop"},
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # wait until the drill has stopped it
        with open(f"/proc/{child.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                break
        time.sleep(0.01)
    child.send_signal(signal.SIGTERM)
    child.send_signal(signal.SIGCONT)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 75, err
    assert [x for x in err.splitlines() if "preempted" in x], err
    assert not out.exists()
    assert _committed_ids(state) == list(range(1, 51))

    again = spill(toy, *args, "--json")
    assert again.returncode == 0, again.stderr
    assert "50 of 60 rows committed" in again.stderr
    summary = json.loads(again.stdout)
    assert (summary["restored"], summary["ran"], summary["rows"]) == (50, 10, 60)
    assert out.read_text() == ref.read_text()  # the same bytes as one uninterrupted run
    assert sorted(_committed_ids(state)) == list(range(1, 61))  # each row exactly once


def test_stop_after_then_continue(toy, tmp_path):
    src = _many(toy, tmp_path / "many.csv", 30)
    out, state = tmp_path / "out.jsonl", tmp_path / "state"
    args = ["predict", str(toy["project"]), str(src), "--out", str(out), "--state", str(state)]
    first = spill(toy, *args, "--stop-after", "12", "--json")
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["complete"] is False and not out.exists()
    rest = spill(toy, "resume", str(state), "--json")  # replays the recorded predict command
    assert rest.returncode == 0, rest.stderr
    got = json.loads(rest.stdout)
    assert (got["restored"], got["ran"]) == (12, 18)
    assert [r["id"] for r in _read(out)] == list(range(1, 31))


def test_bad_input_is_one_line(toy, tmp_path):
    def fails(code: int, message: str, *args: str, cwd: Path | None = None) -> None:
        proc = spill(toy, "predict", *args, cwd=cwd)
        assert proc.returncode == code, proc.stderr
        lines = [x for x in proc.stderr.splitlines() if x.startswith("spill: error:")]
        assert len(lines) == 1 and message in lines[0], proc.stderr

    fresh = tmp_path / "fresh"
    shutil.copytree(TOY, fresh, ignore=shutil.ignore_patterns(".spill", "__pycache__"))
    fails(1, "fresh is not built yet", str(fresh), str(toy["csv"]), "--out", "o.jsonl")
    fails(1, f"run `spill build {fresh}` first", str(fresh), "--text", "hello")
    p = str(toy["project"])
    gap = tmp_path / "gap.jsonl"
    gap.write_text('{"text": "red apple"}\n{"body": "no text here"}\n')
    fails(1, f"{gap}: line 2 has no text in 'text'", p, str(gap), "--out", str(tmp_path / "o"))
    other = tmp_path / "other.csv"
    other.write_text("body\nhello\n")
    fails(1, "no column 'text' (the project's data.input)", p, str(other), "--out", "o.jsonl")
    fails(2, "--out is required", p, str(toy["csv"]))
    fails(2, "--text answers one input", p, str(toy["csv"]), "--text", "x")
    fails(2, "--stop-after keeps the rows done only with --state", p, str(toy["csv"]),
          "--out", "o.jsonl", "--stop-after", "3")  # fmt: skip
    fails(1, "no spill.yaml", str(tmp_path), "--text", "x")


def test_a_row_longer_than_the_context_is_cut_and_the_others_are_answered(toy, tmp_path):
    """Issue 35 item 8: one stray row of 125 KB (near CSV's field limit; the model's context
    is 2048 tokens) keeps its last tokens, a note names it, and every row is answered, in
    bounded memory and time (the child's own peak RSS)."""
    from tests.func.test_input_bombs import measured

    rows = toy["csv"].read_text().splitlines()
    big = tmp_path / "big.csv"
    big.write_text("\n".join([*rows[:3], "huge," + "word " * 25_000, *rows[3:6]]) + "\n")
    out = tmp_path / "out.jsonl"
    ran = measured("predict", str(toy["project"]), str(big), "--out", str(out), home=toy["home"])
    assert ran.code == 0 and "Traceback" not in ran.err, ran.err
    assert "1 row(s) longer than the model's context (2048 tokens" in ran.err
    assert "prompt tokens: 'huge'" in ran.err
    got = _read(out)
    ids = [r.split(",")[0] for r in rows[1:6]]
    assert [r["id"] for r in got] == [*ids[:2], "huge", *ids[2:]]
    assert all(r["label"] in r["logprobs"] for r in got)
