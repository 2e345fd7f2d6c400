"""``spill run``: batch generation over a JSONL file of prompts.

Rows are generated in input order, ``batch`` at a time. A row's sampling seed is derived from
the run seed and the row id, so a sampled answer does not depend on batch size or neighbours.
The output is written under a temporary name and renamed at the end: a failed run leaves no
half-written ``--out``.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spill.console import note, progress
from spill.engines.base import GenerateParams, LoadOptions
from spill.errors import DataError
from spill.jobs.inputs import PromptRow, read_prompt_rows
from spill.jobs.loading import load_model


@dataclass(frozen=True)
class RunOptions:
    max_new_tokens: int = 128
    batch: int = 8
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    chat: bool = False  # apply the chat template to plain prompts too
    engine: str | None = "auto"
    weights: str | None = None
    load: LoadOptions = LoadOptions()


def row_seed(seed: int, row_id) -> int:
    digest = hashlib.sha256(f"{seed}:{row_id!r}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def encode_row(tokenizer, row: PromptRow, chat: bool) -> list[int]:
    if row.messages is not None:
        return tokenizer.encode_chat(row.messages)
    if chat:
        return tokenizer.encode_chat([{"role": "user", "content": row.prompt}])
    return tokenizer.encode(row.prompt)


def run(model: str, input_path: Path, out_path: Path, opts: RunOptions) -> dict:
    if opts.batch < 1 or opts.max_new_tokens < 1:
        raise DataError("--batch and --max-new-tokens must be at least 1")
    rows = read_prompt_rows(input_path)
    loaded = load_model(model, opts.weights, opts.engine, opts.load, "run")
    tok = loaded.tokenizer
    encoded = []
    for row in rows:
        ids = encode_row(tok, row, opts.chat)
        if not ids:
            raise DataError(f"{input_path}: row {row.id!r} has an empty prompt; give it some text")
        encoded.append(np.asarray(ids, dtype=np.int64))
    params = GenerateParams(opts.max_new_tokens, opts.temperature, opts.top_p, tuple(tok.eos_ids))
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.{os.getpid()}.tmp")
    generated = 0
    start = time.perf_counter()
    try:
        with open(tmp, "w", encoding="utf-8") as f, progress(len(rows), "run") as bar:
            for lo in range(0, len(rows), opts.batch):
                batch = rows[lo : lo + opts.batch]
                seeds = [row_seed(opts.seed, r.id) for r in batch]
                outs = loaded.runner.generate(encoded[lo : lo + opts.batch], params, seeds)
                for row, gen in zip(batch, outs, strict=True):
                    generated += len(gen.tokens)
                    line = {
                        "id": row.id,
                        "output": tok.decode(gen.tokens),
                        "finish": gen.finish,
                        "tokens": len(gen.tokens),
                    }
                    f.write(json.dumps(line, ensure_ascii=False) + "\n")
                bar.update(len(batch))
                bar.set_postfix(tok_s=f"{generated / max(time.perf_counter() - start, 1e-9):.1f}")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
        loaded.runner.close()
    seconds = time.perf_counter() - start
    summary = {
        "rows": len(rows),
        "generated_tokens": generated,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(generated / max(seconds, 1e-9), 1),
        "out": str(out_path),
        "engine": loaded.runner.info.engine,
        "numerics": loaded.runner.info.numerics,
    }
    note(f"wrote {len(rows)} rows to {out_path}")
    return summary
