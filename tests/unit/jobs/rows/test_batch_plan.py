"""A row job's batch: chosen from the memory budget (streamed or resident), overridden by --batch,
said on the line after the pre-run line, and never changing a row's log-probs.

Each row is scored alone at its own length (``StreamRunner.score``), so the gold answers'
log-probs are the same floats at batch 1, 8 and the auto batch (padded together they moved by up
to 2.0e-5 on the llama's summed log-probs). Greedy outputs are equal too on these rows: the
padded decode moves logits only by float32 rounding, which changes no argmax here.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from spill.jobs.rows.eval import EvalOptions, evaluate
from spill.jobs.rows.generate import GenerateOptions, generate
from spill.jobs.rows.job import RowOptions
from spill.settings import EngineSettings

ROWS = 20


def _eval_rows(path):
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
    with path.open("w") as f:
        for i in range(ROWS):
            prompt = " ".join(rng.choice(words, size=int(rng.integers(1, 12))))
            answer = " ".join(rng.choice(words, size=int(rng.integers(1, 4))))
            f.write(json.dumps({"id": f"r{i}", "prompt": prompt, "answer": answer}) + "\n")
    return path


def _graded(folder, src, tmp_path, batch, load):
    out = tmp_path / f"graded-{batch}.jsonl"
    job = RowOptions(batch=batch, engine=load)
    evaluate(str(folder), src, out, EvalOptions(max_new_tokens=6), job)
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_results_do_not_depend_on_the_batch(family, tiny_models, tmp_path, capsys):
    folder, src = tiny_models[family], _eval_rows(tmp_path / "in.jsonl")
    load = EngineSettings(name="torch", ring=2, dtype="float32")
    auto = _graded(folder, src, tmp_path, None, load)
    err = capsys.readouterr().err
    assert f"batch {ROWS} from the memory budget" in err and "all the rows" in err
    for batch in (1, 8):
        got = _graded(folder, src, tmp_path, batch, load)
        assert f"batch {batch} (--batch)" in capsys.readouterr().err
        assert [r["output"] for r in got] == [r["output"] for r in auto]
        assert [r["tokens"] for r in got] == [r["tokens"] for r in auto]
        assert [r["gold_logprob"] for r in got] == [r["gold_logprob"] for r in auto]
        assert [r["gold_logprob_mean"] for r in got] == [r["gold_logprob_mean"] for r in auto]


def test_a_resident_model_batches_from_the_budget_too(tiny_models, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": f"row {i}"}) + "\n" for i in range(9)))
    job = RowOptions(
        batch=None, engine=EngineSettings(name="torch", resident=True, dtype="float32")
    )
    gen = GenerateOptions(max_new_tokens=2, temperature=0.0, seed=0)
    s = generate(str(tiny_models["llama"]), src, tmp_path / "out.jsonl", gen, job)
    assert s["rows"] == 9
    assert "batch 9 from the memory budget" in capsys.readouterr().err


def test_an_explicit_batch_names_where_it_came_from(tiny_models, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": f"row {i}"}) + "\n" for i in range(3)))
    load = EngineSettings(name="torch", ring=2, dtype="float32")
    job = RowOptions(batch=2, engine=load, batch_from="teacher.batch")
    gen = GenerateOptions(max_new_tokens=2, temperature=0.0, seed=0)
    generate(str(tiny_models["llama"]), src, tmp_path / "out.jsonl", gen, job)
    assert "batch 2 (teacher.batch)" in capsys.readouterr().err
