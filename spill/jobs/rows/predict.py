"""``spill predict``'s job (``predict``, ``predict_one``): a tuned model's answer for each new row,
a row job like eval. Rows arrive already in the project's prompt shape (``spill.project.predict``
renders them). With ``labels`` (a classification) a row's answer is the label with the highest
log-prob after its prompt, scored exactly as eval scores a gold answer, and its probability is the
softmax of the labels' totals: ``{"id", "input", "label", "probability", "logprobs"}``. Without
labels (free text, ``--generate``) the model answers greedily: ``{"id", "input", "text", "finish",
"tokens"}``. ``--state`` commits rows in segments as every row job does; ``predict_one`` answers one
row in this process (``--text``), nothing committed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spill.console import note
from spill.engines.base import GenerateParams
from spill.errors import DataError
from spill.jobs.adapter_files import Adapter, apply_adapter, load_adapter
from spill.jobs.inputs import PromptRow
from spill.jobs.loading import LoadedModel, find_model, open_model
from spill.jobs.rows.generate import encode_rows
from spill.jobs.rows.job import (
    RowJob,
    RowOptions,
    Work,
    execute,
    job_inputs,
    refuse_overlap,
    write_jsonl,
)
from spill.jobs.rows.scoring import answer_ids, choose_labels


@dataclass(frozen=True)
class PredictRow:
    id: str | int
    row: PromptRow  # the prompt the model reads
    input: str  # the input as the user gave it


@dataclass(frozen=True, kw_only=True)
class PredictOptions:
    labels: tuple[str, ...]  # choose among these; (): generate free text
    max_new_tokens: int  # generating: the most tokens an answer has
    adapter: Path | None = None
    prompt: dict[str, Any] | None = None  # what shaped the prompts (template, chat): pinned

    def settings(self, adapter: Adapter | None) -> dict:
        """Pinned in a state location's identity."""
        out: dict[str, Any] = {"labels": list(self.labels), "prompt": self.prompt}
        if not self.labels:
            out["max_new_tokens"] = self.max_new_tokens
        out["adapter"] = adapter.sha256 if adapter else None
        return out


# Labels are scored as ``spill.jobs.rows.scoring`` scores eval's gold answers.
def _predictor(loaded: LoadedModel, rows, opts: PredictOptions, where, adapter) -> Work:
    tok = loaded.tokenizer
    apply_adapter(loaded, adapter)
    label_ids = [answer_ids(tok, label) for label in opts.labels]
    longest = max((len(x) for x in label_ids), default=0)
    new = longest if opts.labels else opts.max_new_tokens  # scored, or generated
    prompts = encode_rows(tok, [r.row for r in rows], False, where, loaded.context, new)
    if opts.labels:

        def classify(batch: list[PredictRow]) -> list[dict]:
            got = choose_labels(
                loaded.runner, [prompts[r.id] for r in batch], opts.labels, label_ids
            )
            return [
                {
                    "id": r.id,
                    "input": r.input,
                    "label": c.label,
                    "probability": round(c.probability, 6),
                    "logprobs": c.logprobs,
                }
                for r, c in zip(batch, got, strict=True)
            ]

        # a row is scored once per label: its memory is that of len(labels) sequences
        n = len(opts.labels)
        return Work(classify, lambda r: n * (len(prompts[r.id]) + longest))

    params = GenerateParams(opts.max_new_tokens, 0.0, 1.0, tuple(tok.eos_ids))

    def generate(batch: list[PredictRow]) -> list[dict]:
        outs = loaded.runner.generate([prompts[r.id] for r in batch], params, [0] * len(batch))
        return [
            {
                "id": r.id,
                "input": r.input,
                "text": tok.decode(g.tokens),
                "finish": g.finish,
                "tokens": len(g.tokens),
            }
            for r, g in zip(batch, outs, strict=True)
        ]

    return Work(generate, lambda r: len(prompts[r.id]) + opts.max_new_tokens)


def _check(opts: PredictOptions, job: RowOptions | None) -> None:
    if (job and job.batch is not None and job.batch < 1) or opts.max_new_tokens < 1:
        raise DataError("--batch and --max-new-tokens must be at least 1")


def predict(
    model: str,
    input_path: Path,
    rows: list[PredictRow],
    out_path: Path,
    opts: PredictOptions,
    job: RowOptions,
) -> dict:
    """Answer every row of ``input_path`` (``rows``: them, rendered) into ``out_path``."""
    _check(opts, job)
    input_path, out_path = Path(input_path), Path(out_path)
    refuse_overlap(job_inputs(input_path, model, opts.adapter), out_path, job.state)
    adapter = load_adapter(opts.adapter) if opts.adapter else None
    done = execute(
        RowJob("predict", model, input_path, rows, opts.settings(adapter), job),
        lambda loaded: _predictor(loaded, rows, opts, input_path, adapter),
        lambda records: write_jsonl(out_path, records),
    )
    summary = done.summary(job) | {"adapter": str(opts.adapter) if opts.adapter else None}
    if opts.labels:
        counts = dict.fromkeys(opts.labels, 0)
        for r in done.records:
            counts[r["label"]] += 1
        summary["labels"] = counts
    else:
        summary["generated_tokens"] = sum(r["tokens"] for r in done.records)
    if done.complete:
        summary["out"] = str(out_path)
        note(f"wrote {len(done.records)} rows to {out_path}")
    return summary


def predict_one(
    model: str, row: PredictRow, opts: PredictOptions, job: RowOptions
) -> dict[str, Any]:
    """One row's answer, computed here and now (``spill predict --text``)."""
    _check(opts, None)
    adapter = load_adapter(opts.adapter) if opts.adapter else None
    resolved, fp = find_model(model, job.weights, job.quantize)
    name = model if job.quantize is None else resolved.name
    loaded = open_model(name, resolved, fp, job.engine.name, job.engine, "predict")
    try:
        (record,) = _predictor(loaded, [row], opts, "--text", adapter).compute([row])
    finally:
        loaded.runner.close()
    return record
