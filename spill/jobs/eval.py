"""``spill eval``: grade a model (optionally with a LoRA adapter) on rows with known answers.

Rows are ``{"id", "prompt"|"messages", "answer"}`` (``completion`` is accepted as the answer, so
a training file can be graded as is). For every row the model generates greedily and the row is
correct when the generated text equals the answer after stripping leading and trailing
whitespace on both sides; the comparison is otherwise exact (case, inner spaces, punctuation).
Independently of the generation, the engine scores the gold answer's tokens given the prompt
(the answer encoded without special tokens, no end-of-sequence token): their summed log-prob
and per-token mean. A row job like run: ``--state`` commits graded rows in segments.

``--max-new-tokens`` defaults to the longest answer in the file plus 16 tokens, fixed for the
whole file, so results do not depend on the batch. An adapter folder is spill's layout
(``params.safetensors`` + ``adapter.json``, or a tune checkpoint's ``state.json``) or PEFT's
(``adapter_model.safetensors`` + ``adapter_config.json``).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spill.console import note
from spill.engines.base import GenerateParams, LoadOptions
from spill.errors import DataError, SpillError
from spill.jobs.inputs import PromptRow, read_jsonl, read_prompt_rows
from spill.jobs.loading import Loaded
from spill.jobs.rows_job import RowJob, execute, write_jsonl
from spill.jobs.run import encode_rows
from spill.models.lora import MODULES, LoraConfig

ANSWER_MARGIN = 16  # extra tokens past the longest answer, so a model that keeps going is wrong


@dataclass(frozen=True)
class EvalOptions:
    max_new_tokens: int | None = None  # None: longest answer + ANSWER_MARGIN
    batch: int = 8
    chat: bool = False
    adapter: Path | None = None
    engine: str | None = "auto"
    weights: str | None = None
    load: LoadOptions = LoadOptions()
    state: str | None = None
    stop_after: int | None = None  # stop after this many rows in all (with state: continue later)


@dataclass(frozen=True)
class EvalRow:
    id: str | int
    row: PromptRow
    answer: str


def read_eval_rows(path: Path) -> list[EvalRow]:
    prompts = read_prompt_rows(path)
    out = []
    for row, (lineno, obj) in zip(prompts, read_jsonl(path), strict=True):
        answer = obj.get("answer", obj.get("completion"))
        if not isinstance(answer, str):
            raise DataError(
                f"{path}:{lineno}: row has no 'answer' (or 'completion') string to grade against"
            )
        out.append(EvalRow(row.id, row, answer))
    return out


# --- adapters ---------------------------------------------------------------------------------


def _lora_config(doc: dict, where: Path) -> LoraConfig:
    try:
        targets = doc["targets"]
        targets = LoraConfig.parse_targets(
            targets if isinstance(targets, str) else ",".join(targets)
        )
        return LoraConfig(
            rank=int(doc["rank"]),
            alpha=float(doc["alpha"]),
            dropout=float(doc.get("dropout", 0.0)),
            targets=targets,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise SpillError(
            f"{where}: not a LoRA configuration ({e}); expected rank, alpha and targets"
        ) from None


def _spill_adapter(folder: Path) -> tuple[LoraConfig, dict[str, np.ndarray]]:
    from safetensors.numpy import load_file

    for name, key in (("adapter.json", None), ("state.json", "adapter")):
        if (folder / name).is_file():
            doc = json.loads((folder / name).read_text())
            doc = doc.get(key, {}) if key else doc.get("lora", doc)
            return _lora_config(doc, folder / name), load_file(str(folder / "params.safetensors"))
    raise SpillError(f"{folder}: params.safetensors without adapter.json; add the LoRA config")


def _peft_adapter(folder: Path) -> tuple[LoraConfig, dict[str, np.ndarray]]:
    """PEFT names ``base_model.model.model.layers.<k>.<module>.lora_A.weight`` ``[r, in]``."""
    from safetensors.numpy import load_file

    cfg = json.loads((folder / "adapter_config.json").read_text())
    where = folder / "adapter_config.json"
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        raise SpillError(f"{where}: target_modules is a pattern; list the module names instead")
    targets = [t.rsplit(".", 1)[-1] for t in targets or []]
    lora = _lora_config(
        {
            "rank": cfg.get("r"),
            "alpha": cfg.get("lora_alpha"),
            "dropout": cfg.get("lora_dropout", 0.0),
            "targets": targets,
        },
        where,
    )
    if cfg.get("use_rslora") or cfg.get("use_dora"):
        raise SpillError(f"{where}: rsLoRA and DoRA adapters are not supported; use plain LoRA")
    params = {}
    for key, value in load_file(str(folder / "adapter_model.safetensors")).items():
        stem, sep, tail = key.rpartition(".lora_")
        if not sep or "layers." not in stem or tail not in ("A.weight", "B.weight"):
            raise SpillError(f"{folder}: unexpected tensor {key!r} in a PEFT LoRA adapter")
        stem = stem[stem.index("layers.") :]
        name = f"{stem}.lora_{'a' if tail[0] == 'A' else 'b'}"
        params[name] = np.ascontiguousarray(value.T.astype(np.float32))  # [r,in] -> [in,r]
    return lora, params


def load_adapter(folder: Path) -> tuple[LoraConfig, dict[str, np.ndarray], str]:
    """(config, float32 params in spill's names, sha256 over both) from either layout."""
    folder = Path(folder)
    if (folder / "params.safetensors").is_file():
        lora, params = _spill_adapter(folder)
    elif (folder / "adapter_model.safetensors").is_file() and (
        folder / "adapter_config.json"
    ).is_file():
        lora, params = _peft_adapter(folder)
    else:
        raise SpillError(
            f"{folder}: no adapter here; give a folder with params.safetensors + adapter.json "
            "(spill) or adapter_model.safetensors + adapter_config.json (PEFT)"
        )
    known = set(MODULES.values())
    for name in params:
        module = name.split(".", 2)[-1].rsplit(".", 1)[0]
        if module not in known:
            raise SpillError(f"{folder}: tensor {name!r} is not on a LoRA target spill knows")
    h = hashlib.sha256(json.dumps(lora.to_dict(), sort_keys=True).encode())
    for name in sorted(params):
        h.update(name.encode())
        h.update(np.ascontiguousarray(params[name], dtype=np.float32).tobytes())
    return lora, params, h.hexdigest()


# --- the job ----------------------------------------------------------------------------------


def _grader(loaded: Loaded, rows: list[EvalRow], opts: EvalOptions, input_path: Path, adapter):
    tok = loaded.tokenizer
    if adapter is not None:
        if not hasattr(loaded.runner, "use_adapter"):
            raise SpillError(f"the {loaded.runner.info.engine} engine cannot apply adapters yet")
        loaded.runner.use_adapter(adapter[0], adapter[1])
    prompts = encode_rows(tok, [r.row for r in rows], opts.chat, input_path)
    gold = {r.id: np.asarray(tok.encode(r.answer, False), dtype=np.int64) for r in rows}
    params = GenerateParams(_max_new(opts, rows, tok), 0.0, 1.0, tuple(tok.eos_ids))

    def compute(batch: list[EvalRow]) -> list[dict]:
        ids = [prompts[r.id] for r in batch]
        outs = loaded.runner.generate(ids, params, [0] * len(batch))
        scores = loaded.runner.score(ids, [gold[r.id] for r in batch])
        records = []
        for row, gen, lp in zip(batch, outs, scores, strict=True):
            text = tok.decode(gen.tokens)
            total = float(np.sum(lp, dtype=np.float64))
            records.append(
                {
                    "id": row.id,
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
        return records

    return compute


def _max_new(opts: EvalOptions, rows: list[EvalRow], tok) -> int:
    if opts.max_new_tokens is not None:
        return opts.max_new_tokens
    return max(len(tok.encode(r.answer, False)) for r in rows) + ANSWER_MARGIN


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(sum(values) / len(values), 6) if values else None


def evaluate(model: str, input_path: Path, out_path: Path | None, opts: EvalOptions) -> dict:
    if opts.batch < 1 or (opts.max_new_tokens is not None and opts.max_new_tokens < 1):
        raise DataError("--batch and --max-new-tokens must be at least 1")
    input_path = Path(input_path)
    rows = read_eval_rows(input_path)
    adapter = load_adapter(opts.adapter) if opts.adapter else None
    settings = {
        "max_new_tokens": opts.max_new_tokens,  # None: derived from the answers, pinned by input
        "chat": opts.chat,
        "adapter": adapter[2] if adapter else None,
    }
    job = RowJob(
        "eval",
        model,
        input_path,
        rows,
        settings,
        opts.state,
        opts.batch,
        opts.engine,
        opts.weights,
        opts.load,
        opts.stop_after,
    )
    done = execute(
        job,
        lambda loaded: _grader(loaded, rows, opts, input_path, adapter),
        lambda records: write_jsonl(out_path, records) if out_path else None,
    )
    records = done.records
    correct = sum(bool(r["correct"]) for r in records)
    summary = {
        "rows": len(records),
        "correct": correct,
        "accuracy": round(correct / len(records), 6) if records else None,
        "gold_logprob": _mean(r["gold_logprob"] for r in records),
        "gold_logprob_per_token": _mean(r["gold_logprob_mean"] for r in records),
        "adapter": str(opts.adapter) if opts.adapter else None,
        "seconds": round(done.seconds, 2),
        "engine": done.loaded.runner.info.engine,
        "numerics": done.loaded.runner.info.numerics,
    }
    if out_path and done.complete:
        summary["out"] = str(out_path)
        note(f"wrote {len(records)} graded rows to {out_path}")
    if not done.complete:
        summary.update(complete=False, total=len(rows))
    if opts.state:
        summary.update(state=opts.state, restored=done.restored, ran=done.ran)
    return summary
