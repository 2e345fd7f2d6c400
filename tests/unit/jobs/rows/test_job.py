"""The row-job driver's outcome: one summary shape for run, distill and eval, complete or not."""

from __future__ import annotations

import json

from spill.jobs.authority import Writer
from spill.jobs.rows.distill import distill
from spill.jobs.rows.generate import GenerateOptions, generate
from spill.jobs.rows.job import RowOptions
from spill.settings import EngineSettings
from spill.store.location import location

GEN = GenerateOptions(max_new_tokens=3, temperature=0.0, seed=0)


def _rows(path, n=5):
    path.write_text("".join(json.dumps({"id": i, "prompt": f"row {i}"}) + "\n" for i in range(n)))
    return path


def _job(tmp_path, stop_after=None) -> RowOptions:
    engine = EngineSettings(name="torch", dtype="float32")
    writer = Writer(location(tmp_path / "state"))
    return RowOptions(batch=2, engine=engine, writer=writer, stop_after=stop_after)


def test_a_run_stopped_early_reports_what_it_did_and_writes_nothing(tmp_path, tiny_models, capsys):
    src, out = _rows(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    s = generate(str(tiny_models["llama"]), src, out, GEN, _job(tmp_path, stop_after=3))
    err = capsys.readouterr().err
    assert "stopped after 3 of 5 rows" in err and "wrote" not in err
    assert not out.exists() and "out" not in s
    assert (s["rows"], s["total"], s["complete"], s["ran"], s["restored"]) == (3, 5, False, 3, 0)

    s = generate(str(tiny_models["llama"]), src, out, GEN, _job(tmp_path))
    assert f"wrote 5 rows to {out}" in capsys.readouterr().err
    assert (s["rows"], s["ran"], s["restored"], s["out"]) == (5, 2, 3, str(out))
    assert "complete" not in s and "total" not in s
    assert len(out.read_text().splitlines()) == 5


def test_run_and_distill_summaries_share_the_common_keys(tmp_path, tiny_models):
    src = _rows(tmp_path / "in.jsonl", 2)
    job = RowOptions(batch=2, engine=EngineSettings(name="torch", dtype="float32"))
    r = generate(str(tiny_models["qwen2"]), src, tmp_path / "r.jsonl", GEN, job)
    d = distill(str(tiny_models["qwen2"]), src, tmp_path / "d.jsonl", GEN, job)
    common = {"rows", "seconds", "engine", "numerics", "out", "generated_tokens"}
    assert common <= r.keys() and common <= d.keys()
    assert r["rows"] == d["rows"] == 2 and r["generated_tokens"] == d["generated_tokens"]


def test_a_continued_job_cuts_its_batches_where_an_uninterrupted_one_does(
    tmp_path, tiny_models, monkeypatch
):
    """Row i is in batch i // batch, so a job stopped inside a batch (``stop_after`` 3 at batch
    2) continues with the rest of that batch alone, and one continued without a batch takes the
    batch its committed rows name: every row beside the neighbours it has uninterrupted."""
    from spill.engines.core.runner import StreamRunner

    sizes: list[int] = []
    real = StreamRunner.generate
    monkeypatch.setattr(
        StreamRunner,
        "generate",
        lambda self, prompts, *a, **k: sizes.append(len(prompts)) or real(self, prompts, *a, **k),
    )
    src, model = _rows(tmp_path / "in.jsonl", 7), str(tiny_models["llama"])
    whole = tmp_path / "whole.jsonl"
    generate(model, src, whole, GEN, RowOptions(batch=2, engine=_job(tmp_path).engine))
    assert sizes == [2, 2, 2, 1]
    sizes.clear()
    generate(model, src, tmp_path / "out.jsonl", GEN, _job(tmp_path, stop_after=3))
    assert sizes == [2, 1]  # rows 0-1, then row 2 of the batch 2-3
    sizes.clear()
    job = RowOptions(
        batch=None, engine=_job(tmp_path).engine, writer=Writer(location(tmp_path / "state"))
    )
    generate(model, src, tmp_path / "out.jsonl", GEN, job)
    assert sizes == [1, 2, 1]  # row 3 ends the batch 2-3; then 4-5 and 6
    assert (tmp_path / "out.jsonl").read_bytes() == whole.read_bytes()
