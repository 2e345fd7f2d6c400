"""A row job's batch: chosen from the memory budget (streamed or resident), overridden by --batch,
said on the line after the pre-run line, and never changing a result beyond float noise.

Greedy outputs are equal at batch 1, 8 and the auto batch; the gold answers' log-probs differ
only by float32 rounding (a row padded to another width runs other matrix shapes). Measured on
these rows (torch CPU, float32, ring 2): at most 2.0e-5 on the llama's summed log-probs (which
reach -190, so 1.1e-7 relative) and 2.9e-6 on the qwen2's; the tolerance is 1e-6 relative plus
1e-5 absolute, about 10x the worst relative difference seen.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from spill.jobs.eval import EvalOptions, evaluate
from spill.jobs.generate import GenerateOptions, generate
from spill.jobs.rows_job import RowOptions
from spill.settings import EngineSettings

RTOL, ATOL = 1e-6, 1e-5  # on a row's summed gold log-prob (see the module doc)
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
        a, b = (np.array([r["gold_logprob"] for r in x]) for x in (got, auto))
        assert np.all(np.abs(a - b) <= ATOL + RTOL * np.abs(b)), np.abs(a - b).max()


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
