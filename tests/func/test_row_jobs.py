"""Row jobs (run, eval, distill) with ``--state``: real processes, real SIGTERM and SIGKILL.

Every comparison is greedy in float32 against an uninterrupted run of the same command, and
every resume is checked row by row: the committed segments hold each input id exactly once.
``OMP_NUM_THREADS=1`` keeps torch's thread pool from fighting other processes on small CI
machines (on two busy cores an unpinned tiny run is ~100x slower).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from spill.models.sources.tiny import write_tiny
from spill.store.location import location
from tests.conftest import assert_not_imported, cli_code, run_spill

ENV = {"OMP_NUM_THREADS": "1"}
GEN = ["--max-new-tokens", "16", "--dtype", "float32", "--batch", "2"]
ROWS = 100


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _spill(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_spill(*args, env={**ENV, **(env or {})}, timeout=120)


def _committed_ids(state: str) -> list:
    """Row ids of every committed segment (the run's ``rows`` pointer names it), in push order
    (repeats kept, to be counted)."""
    from spill.control.place import Place
    from spill.payloads.rows import commit_markers

    return [rid for marker in commit_markers(Place(location(state))) for rid in marker["row_ids"]]


def _segment(state: Path, n: int, name: str = "COMMIT") -> list[Path]:
    """``name`` in every payload folder of segment ``n`` on disk (any generation)."""
    return sorted(state.glob(f"payloads/rows-g*-s{n}-*/{name}"))


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A model slow enough to signal mid-run, its input, and an uninterrupted reference run."""
    root = tmp_path_factory.mktemp("rowjob")
    model = write_tiny(root / "model", family="llama", seed=3, hidden=256)
    src = _jsonl(
        root / "in.jsonl", [{"id": f"r{i}", "prompt": f"row {i} says"} for i in range(ROWS)]
    )
    ref = root / "ref.jsonl"
    proc = run_spill(
        "run", str(model), str(src), "--out", str(ref), *GEN, env={**ENV, "SPILL_HOME": str(root)}
    )
    assert proc.returncode == 0, proc.stderr
    return {"model": str(model), "input": str(src), "ref": ref.read_text()}


def _check_complete(state: str, out: Path, ref: str) -> None:
    assert out.read_text() == ref  # same bytes as the uninterrupted run
    ids = _committed_ids(state)
    assert sorted(ids) == sorted(f"r{i}" for i in range(ROWS))  # each row exactly once


def test_sigterm_commits_the_rows_done_and_rerun_finishes(tmp_path, job):
    state, out = tmp_path / "state", tmp_path / "out.jsonl"
    args = ["run", job["model"], job["input"], "--out", str(out), *GEN, "--state", str(state)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "spill", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **ENV},
    )
    deadline = time.monotonic() + 60
    while not _segment(state, 0) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    t = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    took = time.monotonic() - t
    print(f"\nspill run --state: SIGTERM to exit {took:.2f} s")
    assert proc.returncode == 75, err
    line = [x for x in err.splitlines() if "preempted" in x]
    assert len(line) == 1, err
    done = int(line[0].split("committed: ")[1].split(" of ")[0])
    assert 25 <= done < ROWS
    assert not out.exists()

    from spill.control.place import Place
    from spill.payloads.rows import commit_markers, restore

    got = restore(Place(location(state)))
    ref = [json.loads(x) for x in job["ref"].splitlines()]
    assert got.done == [r["id"] for r in ref[:done]]  # a prefix, in input order
    assert got.rows == ref[:done]
    commit = commit_markers(Place(location(state)))[0]
    assert {"engine", "device", "hardware", "os", "numerics"} <= set(commit["producer"])
    assert commit["producer"]["numerics"] == "float32"

    again = _spill(*args, "--json")
    assert again.returncode == 0, again.stderr
    assert f"{done} of {ROWS} rows committed" in again.stderr
    summary = json.loads(again.stdout)
    assert (summary["restored"], summary["ran"]) == (done, ROWS - done)
    _check_complete(str(state), out, job["ref"])


def test_sigkill_before_a_segment_commit_loses_and_repeats_nothing(tmp_path, job):
    state, out = tmp_path / "state", tmp_path / "out.jsonl"
    args = ["run", job["model"], job["input"], "--out", str(out), *GEN, "--state", str(state)]
    killed = _spill(*args, env={"SPILL_DRILL": "seg-before-commit@2"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert _segment(state, 1, "rows.jsonl") and not _segment(state, 1)  # written, never committed
    assert _committed_ids(str(state)) == [f"r{i}" for i in range(25)]

    resumed = _spill(*args)
    assert resumed.returncode == 0, resumed.stderr
    assert "25 of 100 rows committed" in resumed.stderr
    _check_complete(str(state), out, job["ref"])


def test_resume_on_s3(tmp_path, job, s3_bucket):
    state, out = f"s3://{s3_bucket}/jobs/run", tmp_path / "out.jsonl"
    args = ["run", job["model"], job["input"], "--out", str(out), *GEN, "--state", state]
    killed = _spill(*args, env={"SPILL_DRILL": "seg-before-commit@3"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert _committed_ids(state) == [f"r{i}" for i in range(50)]
    resumed = _spill(*args)
    assert resumed.returncode == 0, resumed.stderr
    _check_complete(state, out, job["ref"])


def _graded_rows(n: int) -> list[dict]:
    """Eval rows of uneven lengths, so a batch pads its rows to different widths."""
    rng = np.random.default_rng(5)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
    return [
        {
            "id": f"g{i}",
            "prompt": " ".join(rng.choice(words, size=int(rng.integers(1, 30)))),
            "answer": " ".join(rng.choice(words, size=int(rng.integers(1, 6)))),
        }
        for i in range(n)
    ]


def test_eval_log_probs_ignore_the_batch_and_a_sigkill_resumes_to_the_same_bytes(tmp_path, job):
    """A row's gold log-probs are the same floats at --batch 7 and 64 (each row is scored
    alone). A job SIGKILLed mid-run (its last commit, 25 rows a segment, inside a batch) and
    continued without --batch takes the batch its committed rows name and cuts its batches where
    the uninterrupted job did, so the continued file is the --batch 7 file byte for byte."""
    src = _jsonl(tmp_path / "graded.jsonl", _graded_rows(60))
    gen = ["--max-new-tokens", "8", "--dtype", "float32"]
    outs = {}
    for batch in ("7", "64"):
        outs[batch] = tmp_path / f"b{batch}.jsonl"
        proc = _spill(
            "eval", job["model"], str(src), "--out", str(outs[batch]), *gen, "--batch", batch
        )
        assert proc.returncode == 0, proc.stderr
    seven, sixty_four = _read(outs["7"]), _read(outs["64"])
    for key in ("gold_logprob", "gold_logprob_mean", "gold_tokens"):
        assert [r[key] for r in seven] == [r[key] for r in sixty_four], key

    state, out = tmp_path / "state", tmp_path / "resumed.jsonl"
    args = ["eval", job["model"], str(src), "--out", str(out), *gen, "--state", str(state)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "spill", *args, "--batch", "7"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, **ENV},
    )
    deadline = time.monotonic() + 60
    while proc.poll() is None and time.monotonic() < deadline:
        if _segment(state, 0) and _committed_ids(str(state)):
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)  # somewhere inside a batch after the first commit
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, err
    done = len(_committed_ids(str(state)))
    assert 0 < done < 60  # segments hold 25 rows: the commit ends inside a batch of 7
    again = _spill(*args)  # no --batch: the committed rows' batch, not the memory budget's
    assert again.returncode == 0, again.stderr
    assert "batch 7 (as the rows committed before" in again.stderr
    assert out.read_bytes() == outs["7"].read_bytes()


def test_other_input_or_settings_are_refused_in_one_line(tmp_path, tiny_models):
    model = str(tiny_models["qwen2"])
    src = _jsonl(tmp_path / "a.jsonl", [{"id": 1, "prompt": "one"}, {"id": 2, "prompt": "two"}])
    other = _jsonl(tmp_path / "b.jsonl", [{"id": 1, "prompt": "one"}, {"id": 2, "prompt": "2"}])
    state, out = str(tmp_path / "state"), str(tmp_path / "out.jsonl")
    base = ["--max-new-tokens", "3", "--dtype", "float32", "--state", state, "--out", out]
    assert _spill("run", model, str(src), *base).returncode == 0
    for cmd, key in (
        (["run", model, str(other), *base], "input.sha256"),
        (["run", model, str(src), *base, "--max-new-tokens", "4"], "settings.max_new_tokens"),
        (["distill", model, str(src), *base], "job is 'run' there and 'distill' here"),
    ):
        proc = _spill(*cmd)
        assert proc.returncode == 1, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("spill: error: ") and key in lines[0]


def test_memory_state_location(tmp_path, tiny_models):
    src = _jsonl(tmp_path / "a.jsonl", [{"id": i, "prompt": f"p {i}"} for i in range(3)])
    out = tmp_path / "out.jsonl"
    proc = _spill(
        "run", str(tiny_models["llama"]), str(src), "--out", str(out), "--max-new-tokens", "3",
        "--dtype", "float32", "--state", "memory://spill-test/job", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["ran"] == 3 and len(_read(out)) == 3


# --- eval and distill -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def greedy(tmp_path_factory):
    """Prompts and what the tiny qwen2 model greedily answers to them (6 tokens)."""
    root = tmp_path_factory.mktemp("greedy")
    model = write_tiny(root / "model", family="qwen2", seed=7)
    rows = [{"id": i, "prompt": p} for i, p in enumerate(["one", "two three", "four", "five six"])]
    rows.append({"id": "m", "messages": [{"role": "user", "content": "hello there"}]})
    src = _jsonl(root / "in.jsonl", rows)
    out = root / "out.jsonl"
    proc = run_spill(
        "run", str(model), str(src), "--out", str(out), "--max-new-tokens", "6",
        "--dtype", "float32", env={**ENV, "SPILL_HOME": str(root)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    answers = {r["id"]: r["output"] for r in _read(out)}
    return {"model": str(model), "rows": rows, "answers": answers}


_n = itertools.count()


def _eval(greedy, tmp_path, rows, *extra) -> tuple[dict, list[dict]]:
    n = next(_n)
    src, out = _jsonl(tmp_path / f"test{n}.jsonl", rows), tmp_path / f"graded{n}.jsonl"
    proc = _spill(
        "eval", greedy["model"], str(src), "--out", str(out), "--max-new-tokens", "6",
        "--dtype", "float32", "--json", *extra,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), _read(out)


def test_eval_accuracy_on_known_answers(tmp_path, greedy):
    right = [{**r, "answer": f" {greedy['answers'][r['id']]}\n"} for r in greedy["rows"]]
    right[0] = {**greedy["rows"][0], "completion": greedy["answers"][0]}  # the other key
    wrong = [
        {**r, "answer": "Definitely Not " + greedy["answers"][r["id"]]} for r in greedy["rows"]
    ]
    state = str(tmp_path / "state")
    summary, graded = _eval(greedy, tmp_path, right, "--state", state)
    assert summary["accuracy"] == 1.0 and summary["correct"] == len(right)
    assert all(r["correct"] for r in graded)
    assert all(r["gold_logprob"] < 0 and r["gold_tokens"] > 0 for r in graded)
    assert summary["gold_logprob"] == pytest.approx(np.mean([r["gold_logprob"] for r in graded]))
    assert _committed_ids(state) == [r["id"] for r in right]

    summary, graded = _eval(greedy, tmp_path, wrong)
    assert summary["accuracy"] == 0.0 and not any(r["correct"] for r in graded)
    table = _spill(
        "eval", greedy["model"], str(_jsonl(tmp_path / "right.jsonl", right)), "--max-new-tokens", "6",
        "--dtype", "float32",
    )  # fmt: skip
    assert table.returncode == 0 and "accuracy" in table.stdout and "1.0" in table.stdout


def test_eval_with_an_adapter_in_spill_and_peft_layouts(tmp_path, greedy):
    from safetensors.numpy import save_file

    from spill.models.config import load_config
    from spill.models.lora import LoraConfig, export_peft, init_params

    cfg = load_config(Path(greedy["model"]))
    lora = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj"))
    params = init_params(cfg, lora, seed=1)
    rng = np.random.default_rng(0)
    for name in params:
        if name.endswith("lora_b"):  # nonzero B, so the adapter changes the model
            params[name] = rng.normal(0, 0.5, params[name].shape).astype(np.float32)
    ours = tmp_path / "spill-adapter"
    ours.mkdir()
    save_file(params, str(ours / "params.safetensors"))
    (ours / "adapter.json").write_text(json.dumps(lora.to_dict()))
    peft = export_peft(params, lora, "tiny", tmp_path / "peft-adapter")

    rows = [{**r, "answer": greedy["answers"][r["id"]]} for r in greedy["rows"]]
    base, base_rows = _eval(greedy, tmp_path, rows)
    a, a_rows = _eval(greedy, tmp_path, rows, "--adapter", str(ours))
    b, b_rows = _eval(greedy, tmp_path, rows, "--adapter", str(peft))
    assert base["accuracy"] == 1.0
    assert [r["gold_logprob"] for r in a_rows] == [r["gold_logprob"] for r in b_rows]
    assert [r["output"] for r in a_rows] == [r["output"] for r in b_rows]
    assert [r["gold_logprob"] for r in a_rows] != [r["gold_logprob"] for r in base_rows]


def test_distill_writes_training_rows_and_resumes(tmp_path, greedy):
    src = _jsonl(tmp_path / "in.jsonl", greedy["rows"])
    state, out = str(tmp_path / "state"), tmp_path / "train.jsonl"
    args = ["distill", greedy["model"], str(src), "--out", str(out), "--max-new-tokens", "6"]
    args += ["--dtype", "float32", "--state", state]
    proc = _spill(*args)
    assert proc.returncode == 0, proc.stderr
    rows = _read(out)
    answers = greedy["answers"]
    for row, got in zip(greedy["rows"], rows, strict=True):
        if "messages" in row:
            assert got["messages"] == [
                *row["messages"],
                {"role": "assistant", "content": answers["m"]},
            ]
        else:
            assert got == {
                "id": row["id"],
                "prompt": row["prompt"],
                "completion": answers[row["id"]],
            }
    again = _spill(*args, "--json")  # everything committed: nothing runs, same file
    assert again.returncode == 0 and json.loads(again.stdout)["ran"] == 0
    assert _read(out) == rows

    from spill.jobs.tune.data import load_examples
    from spill.models.tokenizer import Tokenizer

    assert len(load_examples(out, Tokenizer(Path(greedy["model"])), 64)) == len(rows)


@pytest.mark.parametrize("sub", ["eval", "distill"])
def test_help_imports_no_engine(sub):
    assert_not_imported(cli_code(sub, "--help"))
