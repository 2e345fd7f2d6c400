"""lm-evaluation-harness, a client nobody here wrote, against a real ``spill serve``: a
multiple-choice task from a local YAML and JSON file (no hub), scored through the server's
``echo`` + ``logprobs``, gives each choice the log-likelihood ``spill eval`` gives the same row
(within 1e-5), and a generation task through ``local-chat-completions`` gives ``spill run``'s
greedy answers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_spill
from tests.func.test_serve import start

pytest.importorskip("lm_eval")

ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
DOCS = [
    {"question": "the cat sat on the", "choices": ["mat", "moon", "cat"], "gold": 0},
    {"question": "one two three", "choices": ["four", "five"], "gold": 0},
    {"question": "a b c", "choices": ["d", "e f", "z"], "gold": 2},
]
CHOICE_TASK = """task: spill_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
metric_list:
  - metric: acc
"""
GEN_TASK = """task: spill_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: " x"
generation_kwargs:
  until: []
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from spill.models.sources.tiny import write_tiny

    root = tmp_path_factory.mktemp("lm_eval")
    model = write_tiny(root / "model", family="llama", seed=5)
    env = {**os.environ, **ENV, "SPILL_HOME": str(root)}
    proc, port, lines = start([str(model), "--dtype", "float32"], env)
    tasks = root / "tasks"
    tasks.mkdir()
    data = root / "docs.json"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tasks / "choice.yaml").write_text(CHOICE_TASK.format(data=data))
    (tasks / "gen.yaml").write_text(GEN_TASK.format(data=data))
    yield {"root": root, "model": model, "port": port, "env": env, "tasks": tasks, "log": lines}
    proc.kill()
    proc.wait()


def lm_eval(served, kind: str, task: str) -> list[dict]:
    """Run lm_eval's CLI on ``task`` against the server; its logged samples."""
    out = served["root"] / f"out-{task}"
    path = "completions" if kind == "local-completions" else "chat/completions"
    args = [
        f"model={served['model']}",
        f"base_url=http://127.0.0.1:{served['port']}/v1/{path}",
        "tokenized_requests=False",
        "tokenizer_backend=huggingface",
        f"tokenizer={served['model']}",
        "num_concurrent=4",
    ]
    cmd = [sys.executable, "-m", "lm_eval", "--model", kind, "--model_args", ",".join(args)]
    cmd += ["--include_path", str(served["tasks"]), "--tasks", task, "--log_samples"]
    cmd += ["--output_path", str(out)]
    if kind == "local-chat-completions":
        cmd += ["--apply_chat_template"]
    env = {**served["env"], "OPENAI_API_KEY": "none"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (samples,) = out.rglob(f"samples_{task}_*.jsonl")
    return [json.loads(line) for line in samples.read_text().splitlines()]


def spill_eval(served, rows: list[dict], tmp: Path) -> list[dict]:
    src, out = tmp / "rows.jsonl", tmp / "eval.jsonl"
    src.write_text("".join(json.dumps({"id": i, **r}) + "\n" for i, r in enumerate(rows)))
    args = ["eval", str(served["model"]), str(src), "--out", str(out), "--dtype", "float32"]
    done = run_spill(*args, env=served["env"])
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_loglikelihoods_through_the_server_equal_spill_eval(served, tmp_path):
    """Each (context, continuation) lm-eval asked about, as a ``spill eval`` row."""
    samples = sorted(
        lm_eval(served, "local-completions", "spill_choice"), key=lambda s: s["doc_id"]
    )
    asked = [args for s in samples for args in s["arguments"].values()]
    assert len(asked) == sum(len(d["choices"]) for d in DOCS)
    rows = [{"prompt": a["arg_0"], "answer": a["arg_1"]} for a in asked]
    expected = [r["gold_logprob"] for r in spill_eval(served, rows, tmp_path)]
    got = [float(resp[0][0]) for s in samples for resp in s["resps"]]
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert abs(g - e) <= 1e-5
    assert all(s["acc"] in (0.0, 1.0) for s in samples)


def test_generation_through_the_chat_endpoint_equals_spill_run(served, tmp_path):
    samples = sorted(
        lm_eval(served, "local-chat-completions", "spill_gen"), key=lambda s: s["doc_id"]
    )
    src, out = tmp_path / "rows.jsonl", tmp_path / "out.jsonl"
    rows = [
        {"id": i, "messages": [{"role": "user", "content": d["question"]}]}
        for i, d in enumerate(DOCS)
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["run", str(served["model"]), str(src), "--out", str(out), "--max-new-tokens", "8"]
    done = run_spill(*args, "--dtype", "float32", "--batch", "1", env=served["env"])
    assert done.returncode == 0, done.stderr
    expected = [json.loads(line)["output"] for line in out.read_text().splitlines()]
    assert [s["resps"][0][0] for s in samples] == expected
