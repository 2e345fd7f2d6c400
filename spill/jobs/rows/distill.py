"""``spill distill``: a teacher answers the inputs and the answers become training rows.

A row job like run (same sampling, seeds, ``--state`` segments). Each input row becomes one line of
``--out``, ready for ``spill tune`` (``training_row``): ``{"id", "prompt"}`` -> ``{"id", "prompt",
"completion"}``; ``{"id", "messages"}`` -> ``{"id", "messages": [..., {"role": "assistant",
...}]}``; ``{"id", "prompt"}`` with ``--chat`` -> the messages form with the prompt as the user
turn, so the student learns the answer in the chat format the teacher saw. Answers cut off at
``--max-new-tokens`` are kept and counted in the summary (``truncated``).
"""

from __future__ import annotations

from pathlib import Path

from spill.console import note
from spill.jobs.group import current as current_group
from spill.jobs.inputs import PromptRow, read_prompt_rows
from spill.jobs.rows.generate import GenerateOptions, check_options, generator
from spill.jobs.rows.job import (
    RowJob,
    RowOptions,
    execute,
    job_inputs,
    refuse_overlap,
    write_jsonl,
)


def training_row(row: PromptRow, answer: str, chat: bool) -> dict:
    if row.messages is not None:
        return {"id": row.id, "messages": [*row.messages, {"role": "assistant", "content": answer}]}
    if chat:
        turns = [{"role": "user", "content": row.prompt}, {"role": "assistant", "content": answer}]
        return {"id": row.id, "messages": turns}
    return {"id": row.id, "prompt": row.prompt, "completion": answer}


def distill(
    teacher: str, input_path: Path, out_path: Path, opts: GenerateOptions, job: RowOptions
) -> dict:
    check_options(opts, job)
    input_path, out_path = Path(input_path), Path(out_path)
    refuse_overlap(job_inputs(input_path, teacher), out_path, job.state)
    rows = read_prompt_rows(input_path)
    by_id = {r.id: r for r in rows}
    counter = {"tokens": 0}

    def finish(records: list[dict]) -> None:
        write_jsonl(
            out_path, [training_row(by_id[r["id"]], r["output"], opts.chat) for r in records]
        )

    done = execute(
        RowJob("distill", teacher, input_path, rows, opts.settings(), job),
        lambda loaded: generator(loaded, rows, opts, input_path, counter),
        finish,
    )
    truncated = sum(r["finish"] == "length" for r in done.records)
    summary = done.summary(job) | {
        "truncated": truncated,
        "generated_tokens": current_group().total(counter["tokens"]),
        "teacher": teacher,
    }
    if not done.complete:
        return summary
    summary["out"] = str(out_path)
    note(f"wrote {len(done.records)} training rows to {out_path}")
    if truncated:
        note(f"{truncated} answers stopped at --max-new-tokens {opts.max_new_tokens}; raise it?")
    return summary
