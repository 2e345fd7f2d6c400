"""``spill eval``: grade a model (optionally with a LoRA adapter) on rows with known answers.

Rows are ``{"id", "prompt"|"messages", "answer"}`` (or ``completion``/``chosen`` as the answer). A
row is correct when the greedy generation equals the answer, both stripped of outer whitespace;
otherwise exact. The gold answer is scored too (summed and per-token log-prob). A row with a
``rejected`` answer is a pair: tokenized as the preference tune sees it, does the answer's mean
token log-prob beat the rejected one's (``preference_accuracy``). Like run, ``--state`` commits
graded rows in segments; an adapter is spill's or PEFT's layout (``spill.jobs.adapter_files``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from spill.console import note
from spill.engines.base import GenerateParams
from spill.errors import DataError
from spill.jobs.adapter_files import Adapter, apply_adapter, load_adapter
from spill.jobs.inputs import PromptRow, read_jsonl, read_prompt_rows
from spill.jobs.loading import LoadedModel
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
from spill.jobs.rows.scoring import answer_ids
from spill.jobs.rows.scoring import total as summed
from spill.jobs.tune.pairs import Pair, encode_pair

ANSWER_MARGIN = 16  # extra tokens past the longest answer, so a model that keeps going is wrong


@dataclass(frozen=True, kw_only=True)
class EvalOptions:
    """What decides a graded row; ``max_new_tokens``'s default is the ``eval`` conf group's."""

    max_new_tokens: int | None  # None: longest answer + ANSWER_MARGIN
    chat: bool = False
    adapter: Path | None = None
    labels: tuple[str, ...] = ()  # a classification's label set: per-label results (no row changes)

    def settings(self, adapter: Adapter | None) -> dict:
        """Pinned in a state location's identity."""
        return {
            "max_new_tokens": self.max_new_tokens,  # None: derived from the answers, pinned by input
            "chat": self.chat,
            "adapter": adapter.sha256 if adapter else None,
        }


@dataclass(frozen=True)
class EvalRow:
    id: str | int
    row: PromptRow
    answer: str
    input: str  # what a person reads as the row: its ``input`` key, else the prompt's text
    rejected: str | None = None  # a preference row's worse answer


def read_eval_rows(path: Path) -> list[EvalRow]:
    prompts = read_prompt_rows(path)
    out = []
    for row, (lineno, obj) in zip(prompts, read_jsonl(path), strict=True):
        answer = obj.get("answer", obj.get("completion", obj.get("chosen")))
        if not isinstance(answer, str):
            raise DataError(
                f"{path}:{lineno}: row has no 'answer' (or 'completion', 'chosen') string to "
                "grade against"
            )
        rejected = obj.get("rejected")
        if rejected is not None and not isinstance(rejected, str):
            raise DataError(f"{path}:{lineno}: 'rejected' must be a string (the worse answer)")
        text = obj.get("input")
        if not isinstance(text, str):
            text = row.prompt if row.prompt is not None else row.messages[-1]["content"]
        out.append(EvalRow(row.id, row, answer, text, rejected))
    return out


# --- the job ----------------------------------------------------------------------------------


# Independently of the generation, the engine scores the gold answer's tokens given the prompt
# (``spill.jobs.rows.scoring``, as ``spill predict`` scores each label). A row's log-probs are the
# same bits in any batch (each row scored at its own length), while a greedy answer can change with
# ``--batch`` where two tokens' logits tie within rounding. An adapter is read as ``spill run
# --adapter`` reads it.
def _grader(
    loaded: LoadedModel,
    rows: list[EvalRow],
    opts: EvalOptions,
    input_path: Path,
    adapter: Adapter | None,
):
    tok = loaded.tokenizer
    apply_adapter(loaded, adapter)
    gold = {r.id: answer_ids(tok, r.answer) for r in rows}
    pairs = {r.id: _pair(tok, r, input_path) for r in rows if r.rejected is not None}
    new = _max_new(opts, rows, tok)
    longest = max([new, *(len(g) for g in gold.values())])  # generated, or the gold scored
    prompts = encode_rows(
        tok, [r.row for r in rows], opts.chat, input_path, loaded.context, longest
    )
    params = GenerateParams(new, 0.0, 1.0, tuple(tok.eos_ids))

    def compute(batch: list[EvalRow]) -> list[dict]:
        ids = [prompts[r.id] for r in batch]
        outs = loaded.runner.generate(ids, params, [0] * len(batch))
        scores = loaded.runner.score(ids, [gold[r.id] for r in batch])
        two = [(r.id, s, pairs[r.id].prompt) for r in batch if r.id in pairs
               for s in (pairs[r.id].chosen, pairs[r.id].rejected)]  # fmt: skip
        got = loaded.runner.score([s[:n] for _, s, n in two], [s[n:] for _, s, n in two])
        chosen = {i: lp for (i, _, _), lp in zip(two[::2], got[::2], strict=True)}
        rejected = {i: lp for (i, _, _), lp in zip(two[1::2], got[1::2], strict=True)}
        records = []
        for row, gen, lp in zip(batch, outs, scores, strict=True):
            text = tok.decode(gen.tokens)
            total = summed(lp)
            records.append(
                {
                    "id": row.id,
                    "input": row.input,
                    "output": text,
                    "answer": row.answer,
                    "correct": text.strip() == row.answer.strip(),
                    "gold_logprob": total if math.isfinite(total) else None,
                    "gold_logprob_mean": total / len(lp)
                    if len(lp) and math.isfinite(total)
                    else None,
                    "gold_tokens": len(lp),
                    "finish": gen.finish,
                    "tokens": len(gen.tokens),
                }
            )
            if row.id in rejected:  # as the tune saw the pair; per token, so length alone
                mine, theirs = (summed(x) / len(x) for x in (chosen[row.id], rejected[row.id]))
                records[-1]["pair_logprob_per_token"] = [_finite(mine), _finite(theirs)]
                records[-1]["prefers_answer"] = bool(mine > theirs)
        return records

    # a row at its longest: generated (prompt + new) or scored (prompt + gold answer)
    def longest(row: EvalRow) -> int:
        two = pairs.get(row.id)
        most = max(len(two.chosen), len(two.rejected)) if two else 0
        return max(len(prompts[row.id]) + max(new, len(gold[row.id])), most)

    return Work(compute, longest)


def _pair(tok, row: EvalRow, where: Path) -> Pair:
    """A preference row's two answers tokenized as ``spill tune --method dpo`` tokenizes them:
    each answer with what ends it (the end-of-sequence token, or the chat turn's end)."""
    prompt = {"messages": row.row.messages} if row.row.messages else {"prompt": row.row.prompt}
    return encode_pair(tok, {**prompt, "chosen": row.answer, "rejected": row.rejected}, str(where))


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


# ``--max-new-tokens`` defaults to the longest answer in the file plus 16 tokens, fixed for the
# whole file, so the generation budget does not depend on the batch.
def _max_new(opts: EvalOptions, rows: list[EvalRow], tok) -> int:
    if opts.max_new_tokens is not None:
        return opts.max_new_tokens
    return max(len(answer_ids(tok, r.answer)) for r in rows) + ANSWER_MARGIN


OTHER = "(other)"  # a generated answer that is none of the labels


def label_results(records: list[dict], labels: tuple[str, ...]) -> dict:
    """Per label: precision, recall and support; and the confusion matrix (gold -> generated
    label -> rows), a generated answer outside the label set counted as ``(other)``."""
    confusion = {gold: dict.fromkeys((*labels, OTHER), 0) for gold in labels}
    for r in records:
        gold, said = r["answer"].strip(), r["output"].strip()
        if gold in confusion:
            confusion[gold][said if said in confusion else OTHER] += 1
    per = {}
    for label in labels:
        hit = confusion[label][label]
        said = sum(row[label] for row in confusion.values())
        support = sum(confusion[label].values())
        per[label] = {
            "precision": round(hit / said, 6) if said else None,
            "recall": round(hit / support, 6) if support else None,
            "support": support,
        }
    return {"labels": per, "confusion": confusion}


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(sum(values) / len(values), 6) if values else None


def evaluate(
    model: str, input_path: Path, out_path: Path | None, opts: EvalOptions, job: RowOptions
) -> dict:
    if (job.batch is not None and job.batch < 1) or (
        opts.max_new_tokens is not None and opts.max_new_tokens < 1
    ):
        raise DataError("--batch and --max-new-tokens must be at least 1")
    input_path = Path(input_path)
    refuse_overlap(job_inputs(input_path, model, opts.adapter), out_path, job.state)
    rows = read_eval_rows(input_path)
    adapter = load_adapter(opts.adapter) if opts.adapter else None
    done = execute(
        RowJob("eval", model, input_path, rows, opts.settings(adapter), job),
        lambda loaded: _grader(loaded, rows, opts, input_path, adapter),
        lambda records: write_jsonl(out_path, records) if out_path else None,
    )
    records = done.records
    correct = sum(bool(r["correct"]) for r in records)
    summary = done.summary(job) | {
        "correct": correct,
        "accuracy": round(correct / len(records), 6) if records else None,
        "gold_logprob": _mean(r["gold_logprob"] for r in records),
        "gold_logprob_per_token": _mean(r["gold_logprob_mean"] for r in records),
        "adapter": str(opts.adapter) if opts.adapter else None,
    }
    if opts.labels and records:
        summary |= label_results(records, opts.labels)
    pairs = [r["prefers_answer"] for r in records if "prefers_answer" in r]
    if pairs:
        summary["preference_accuracy"] = round(sum(pairs) / len(pairs), 6)
        summary["pairs"] = len(pairs)
    if out_path and done.complete:
        summary["out"] = str(out_path)
        note(f"wrote {len(records)} graded rows to {out_path}")
    return summary
