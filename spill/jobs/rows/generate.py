"""``spill run``: batch generation over a JSONL file of prompts (``generate``).

Rows are generated in input order, ``batch`` at a time (by default as many as the memory budget
fits: ``spill.jobs.rows.job``). With ``--state`` the job is a portable row job: results are
committed in segments and a rerun continues where the last one stopped. The output is written under
a temporary name and renamed at the end: a failed run leaves no half-written ``--out``.
``--adapter`` generates with a LoRA adapter (spill's or PEFT's layout, read as ``spill eval`` reads
it); its hash joins the job's pinned settings.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spill.console import note
from spill.engines.base import GenerateParams
from spill.errors import DataError
from spill.jobs.adapter_files import Adapter, apply_adapter, load_adapter
from spill.jobs.group import current as current_group
from spill.jobs.inputs import PromptRow, read_prompt_rows
from spill.jobs.loading import LoadedModel
from spill.jobs.rows.job import (
    RowJob,
    RowOptions,
    Work,
    execute,
    job_inputs,
    refuse_overlap,
    write_jsonl,
)


@dataclass(frozen=True, kw_only=True)
class GenerateOptions:
    """What decides a generated row (``spill run`` and ``spill distill``); the defaults of
    max_new_tokens and temperature are the ``teacher`` conf group's (``conf/``)."""

    max_new_tokens: int
    temperature: float
    seed: int
    top_p: float = 1.0  # in no conf group: this is its one default (``spill run --top-p``)
    chat: bool = False  # apply the chat template to plain prompts too
    adapter: Path | None = None  # a LoRA adapter folder (spill or PEFT layout); run only

    def settings(self, adapter: Adapter | None = None) -> dict:
        """What decides a row's answer, pinned in a state location's identity."""
        out = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "chat": self.chat,
        }
        if adapter is not None:  # absent, not None, so states made before --adapter still match
            out["adapter"] = adapter.sha256
        return out


# A row's sampling seed is derived from the run seed and the row id, so a sampled answer draws the
# same random numbers whatever its batch or neighbours; the logits it samples from are padded with
# the batch, so a token whose probability ties another's within rounding can change with ``--batch``
# (a resumed job keeps its batches: ``spill.jobs.rows.job``).
def row_seed(seed: int, row_id) -> int:
    digest = hashlib.sha256(f"{seed}:{row_id!r}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def encode_row(tokenizer, row: PromptRow, chat: bool, most: int) -> tuple[list[int], bool]:
    """A row's last ``most`` tokens, and whether it had more (``Tokenizer.encode_last``)."""
    if row.messages is not None or chat:
        messages = row.messages or [{"role": "user", "content": row.prompt}]
        return tokenizer.encode_last(tokenizer.apply_chat_template(messages), most, False)
    return tokenizer.encode_last(row.prompt, most)


def encode_rows(tokenizer, rows, chat: bool, input_path: Path, context: int, new: int) -> dict:
    """Token ids per row id; an empty prompt fails in one line naming the row.

    A row holds at most the model's ``context`` tokens, ``new`` of them generated or scored
    after its prompt, so a longer prompt keeps its last ``context - new`` tokens (one note
    names the rows cut): the end holds the question and the chat template's turn for the
    answer, and one over-long row does not stop the job (``spill tune`` likewise keeps a
    row's first ``--seq-len`` tokens). Only the tail that can hold them is encoded, so a row
    of any length costs memory in proportion to the context, never more."""
    room = context - new
    if room < 1:
        raise DataError(
            f"{input_path}: {new} new tokens (--max-new-tokens, or the longest answer scored) "
            f"leave no room for a prompt in the model's context of {context} tokens; lower it"
        )
    out, cut = {}, []
    for row in rows:
        ids, long = encode_row(tokenizer, row, chat, room)
        if not ids:
            raise DataError(f"{input_path}: row {row.id!r} has an empty prompt; give it some text")
        if long:
            cut.append(row.id)
        out[row.id] = np.asarray(ids, dtype=np.int64)
    if cut:
        ids = ", ".join(repr(i) for i in cut[:5]) + (
            f" and {len(cut) - 5} more" if len(cut) > 5 else ""
        )
        note(
            f"{input_path}: {len(cut)} row(s) longer than the model's context ({context} tokens, "
            f"{new} of them new) keep their last {room} prompt tokens: {ids}"
        )
    return out


def generator(
    loaded: LoadedModel,
    rows,
    opts: GenerateOptions,
    input_path: Path,
    counter: dict,
    adapter: Adapter | None = None,
):
    """The ``Work`` of run and distill: ``compute(batch)`` gives ``{"id", "output", "finish",
    "tokens"}`` per row; a row's length is its prompt plus ``max_new_tokens``."""
    tok = loaded.tokenizer
    apply_adapter(loaded, adapter)
    encoded = encode_rows(tok, rows, opts.chat, input_path, loaded.context, opts.max_new_tokens)
    params = GenerateParams(opts.max_new_tokens, opts.temperature, opts.top_p, tuple(tok.eos_ids))

    def compute(batch: list[PromptRow]) -> list[dict]:
        seeds = [row_seed(opts.seed, r.id) for r in batch]
        outs = loaded.runner.generate([encoded[r.id] for r in batch], params, seeds)
        records = []
        for row, gen in zip(batch, outs, strict=True):
            counter["tokens"] += len(gen.tokens)
            records.append(
                {
                    "id": row.id,
                    "output": tok.decode(gen.tokens),
                    "finish": gen.finish,
                    "tokens": len(gen.tokens),
                }
            )
        return records

    return Work(compute, lambda row: len(encoded[row.id]) + opts.max_new_tokens)


def check_options(opts: GenerateOptions, job: RowOptions) -> None:
    if (job.batch is not None and job.batch < 1) or opts.max_new_tokens < 1:
        raise DataError("--batch and --max-new-tokens must be at least 1")


def generate(
    model: str, input_path: Path, out_path: Path, opts: GenerateOptions, job: RowOptions
) -> dict:
    check_options(opts, job)
    input_path, out_path = Path(input_path), Path(out_path)
    refuse_overlap(job_inputs(input_path, model, opts.adapter), out_path, job.state)
    rows = read_prompt_rows(input_path)
    adapter = load_adapter(opts.adapter) if opts.adapter else None
    counter = {"tokens": 0}
    done = execute(
        RowJob("run", model, input_path, rows, opts.settings(adapter), job),
        lambda loaded: generator(loaded, rows, opts, input_path, counter, adapter),
        lambda records: write_jsonl(out_path, records),
    )
    generated = current_group().total(counter["tokens"])  # every process's rows
    summary = done.summary(job) | {
        "generated_tokens": generated,
        "tokens_per_s": round(generated / max(done.seconds, 1e-9), 1),
        "adapter": str(opts.adapter) if opts.adapter else None,
    }
    if done.complete:  # else nothing was written: the job stopped early, committed
        summary["out"] = str(out_path)
        note(f"wrote {len(done.records)} rows to {out_path}")
    return summary
