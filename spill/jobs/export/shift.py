"""What ``spill export --format gguf --quantize`` costs the tune, in log-prob on rows it saw
(``measure``: export.json's ``gguf.quantization_shift``, said in one line).

The tune's shift is ``|b - a|``, the quantization's ``|c - b|`` (a: the base, b: the base with the
adapter, c: the merge as the file holds it), both in mean log-prob per trained token on the first
``ROWS`` rows the tune drew; their ratio is said, with a warning at ``WARN`` or more. Without those
rows (an adapter folder, a training file moved or changed), the rounding is measured in weight space
instead (``WeightShift``), and the line says why.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np

from spill.control.place import Place
from spill.engines import resolve
from spill.engines.base import LoadOptions, ModelSpec
from spill.errors import EngineError
from spill.jobs.authority import read_command
from spill.jobs.export.merge import Inputs
from spill.jobs.tune.data import data_fingerprint, epoch_order, load_examples
from spill.models.config import load_config
from spill.models.tokenizer import Tokenizer
from spill.payloads.checkpoint import latest_checkpoint
from spill.store.location import location

# A short tune changes the weights a little, and rounding the merged matrices to Q4 can undo most of
# it (issue 35: on SmolLM2 after 4 steps, q4_0 moved the gold answers' log-probs by 6.7 of the 7.9
# the tune moved them).
ROWS = 8  # enough rows to see the shift, few enough to score three times in seconds
# the scored copy is float32 on disk and is scored three times: past ~1B parameters that is more
# disk and minutes than an export should spend unasked, so bigger models get the weight measure
SCORED_BYTES = 4 * 1024**3
WARN = 0.5  # the rounding undoes half of what the tune moved, or more
_SHARD_BYTES = 256 * 1024**2  # the scratch folder's shards: memory stays near one shard
_ADVICE = "check the export on your rows, or export q8_0 or a float dtype"


def _candidates(state: Path, name: str, command: dict) -> list[Path]:
    """Where the training file may lie: as the tune's command (``command``) named it (from its
    folder), beside the state, in the current folder."""
    out = []
    cwd = Path(command.get("cwd") or ".")
    out += [cwd / a for a in command.get("argv", []) if Path(a).name == name]
    return [*out, state.parent / name, Path.cwd() / name]


# The training file is found by the name and sha256 that the tune's newest checkpoint records,
# beside the state, where the tune's command named it, or in the current folder.
def seen_rows(inputs: Inputs) -> tuple[str, list] | str:
    """``(training file name, examples)``: the first ``ROWS`` rows the tune drew, encoded as
    it encoded them; or why there are none (a line's end)."""
    cfg = inputs.config
    params = cfg.model_params() + cfg.vocab_size * cfg.hidden_size * (
        1 if cfg.tie_word_embeddings else 2
    )
    if 4 * params > SCORED_BYTES:
        return f"its float32 copy ({4 * params / 1e9:.1f} GB) is too big to score here"
    state = inputs.adapter_dir.parent
    if inputs.adapter_dir.name != "adapter" or not (state / "payloads").is_dir():
        return "the adapter is not in a tune's state, which names its training file"
    here = location(state)  # the adapter's tune state, found here
    ckpt = latest_checkpoint(Place(here))
    st = ckpt.state if ckpt is not None else {}
    hyper = st.get("hyperparameters") or {}
    name, want = st.get("train_file"), hyper.get("data")
    if not (name and want):
        return f"{state} records no training file"
    command = read_command(here) or {}
    found = [p for p in _candidates(state, name, command) if p.is_file()]
    path = next((p for p in found if data_fingerprint(p) == want), None)
    if path is None:
        where = (
            "has changed since"
            if found
            else "is not where its command named it, beside the state or here"
        )
        return f"the tune's training file {name} {where}"
    try:
        resolve(None)  # an export needs no engine; the measurement does
    except EngineError:
        return "no engine to score the rows is installed here (pip install torch)"
    examples = load_examples(path, Tokenizer(inputs.base_folder), hyper["seq_len"])
    drawn = min(ROWS, len(examples), hyper["steps"] * hyper["batch"])
    return name, [examples[i] for i in epoch_order(len(examples), st["seed"], 0)[:drawn]]


def _mean_logprob(runner, examples: list) -> tuple[float, int]:
    """Mean log-prob of the trained tokens (the tune's targets) over every row; their count."""
    lps = runner.score([e.ids[:1] for e in examples], [e.ids[1:] for e in examples])
    got = np.concatenate([lp[e.targets[1:]] for lp, e in zip(lps, examples, strict=True)])
    return float(got.astype(np.float64).mean()), int(got.size)


def _open(folder: Path):
    return resolve(None).open(ModelSpec(folder, load_config(folder)), LoadOptions(dtype="float32"))


def _as_stored(inputs: Inputs, scratch: Path, stored: dict) -> None:
    """An HF folder (float32) of the merge as the GGUF holds it: each tensor rounded to its
    stored type and read back."""
    from gguf.quants import dequantize  # lazy: gguf, only for a GGUF export
    from gguf.quants import quantize as ggml_quantize

    from spill.jobs.export.hf import config_json, write_config, write_folder

    def entries(name: str, w: np.ndarray) -> dict:
        qtype = stored[name]
        if qtype.name == "F32":
            back = w
        elif qtype.name == "F16":
            back = w.astype(np.float16).astype(np.float32)
        else:  # BF16 and the block types
            back = dequantize(ggml_quantize(w, qtype), qtype).astype(np.float32)
        return {name: ("F32", back)}

    write_folder(inputs, scratch, "f32", lambda line: None, _SHARD_BYTES, entries)
    write_config(scratch, config_json(inputs, "f32"))


# Scored on the engine in float32, three times: (a) the base, (b) the base with the adapter (the
# float merge, to float32 rounding), (c) the merge as the file holds it: every tensor in its stored
# type, read back (``gguf.quants``' dequantize is ggml's), in a temporary HF folder inside the
# export's own temporary folder, removed before the files are listed. Quantization blocks lie along
# rows, so rounding before or after llama.cpp's q/k row interleave is the same.
def logprob_shift(inputs: Inputs, dest: Path, stored: dict, name: str, examples: list) -> dict:
    """Score ``examples`` on the base, the tuned base and the merge as stored (see above)."""
    runner = _open(inputs.base_folder)
    try:
        base, tokens = _mean_logprob(runner, examples)
        runner.use_adapter(inputs.adapter.lora, inputs.adapter.params)
        tuned, _ = _mean_logprob(runner, examples)
    finally:
        runner.close()
    scratch = dest / f".shift-{os.getpid()}"  # inside the export's temporary folder
    try:
        scratch.mkdir()
        _as_stored(inputs, scratch, stored)
        runner = _open(scratch)
        try:
            quantized, _ = _mean_logprob(runner, examples)
        finally:
            runner.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    tune, rounding = abs(tuned - base), abs(quantized - tuned)
    return {
        "measure": "logprob",
        "train_file": name,
        "rows": len(examples),
        "tokens": tokens,
        "base": round(base, 6),
        "tuned": round(tuned, 6),
        "quantized": round(quantized, 6),
        "tune_shift": round(tune, 6),
        "quantization_shift": round(rounding, 6),
        "ratio": round(rounding / tune, 4) if tune > 0 else None,
    }


def _times(ratio: float) -> str:
    return f"{ratio:.2f}x" if ratio >= 0.1 else f"{ratio:.2g}x"


def line(quantize: str, r: dict) -> str:
    """The printed line for either measure."""
    if r["measure"] == "logprob":
        said = (
            f"{quantize} on {r['rows']} rows the tune saw ({r['train_file']}, {r['tokens']} "
            f"trained tokens): mean log-prob {r['base']:.4f} base, {r['tuned']:.4f} tuned "
            f"({r['tuned'] - r['base']:+.4f}), {r['quantized']:.4f} as written "
            f"({r['quantized'] - r['tuned']:+.4f})"
        )
        if r["ratio"] is None:
            return f"{said}; the tune did not move them"
        said += f": the rounding moves them {_times(r['ratio'])} as far as the tune did"
    else:
        said = (
            f"{quantize} moves the {r['matrices']} adapted matrices by {_times(r['ratio'])} the "
            f"tune's own change (Frobenius norms {r['quantization_norm']:.4g} against "
            f"{r['tune_norm']:.4g}; weight space, since {r['why']})"
        )
    return f"{said}; {_ADVICE}" if r["ratio"] >= WARN else said


class WeightShift:
    """The fallback: the Frobenius norm of (dequantized - float merge) over every adapted
    matrix stored in the block type, against that of the tune's own change
    (``scale * (A @ B).T``). A weight-space ratio, not a log-prob: the rounding is spread over
    every weight while the tune's change is low-rank, so a small ratio can still move answers."""

    def __init__(self, inputs: Inputs, why: str):
        self.params = inputs.adapter.params
        self.scale = np.float32(inputs.adapter.lora.scale)
        self.why = why
        self.tune2 = self.error2 = 0.0
        self.matrices = 0

    def add(self, name: str, w: np.ndarray, data: np.ndarray, qtype) -> None:
        from gguf.quants import dequantize  # lazy: gguf, only for a GGUF export

        stem = name.rsplit(".", 1)[0].removeprefix("model.")
        if not name.endswith(".weight") or f"{stem}.lora_a" not in self.params:
            return
        a, b = self.params[f"{stem}.lora_a"], self.params[f"{stem}.lora_b"]
        delta = self.scale * (a @ b)  # (in, out): the norm is the transpose's, and the
        error = dequantize(data, qtype) - w  # q/k permutation moves rows, not their norms
        self.tune2 += float(np.sum(np.square(delta, dtype=np.float64)))
        self.error2 += float(np.sum(np.square(error, dtype=np.float64)))
        self.matrices += 1

    def result(self) -> dict | None:
        if self.tune2 <= 0:
            return None
        return {
            "measure": "weights",
            "why": self.why,
            "matrices": self.matrices,
            "tune_norm": round(math.sqrt(self.tune2), 6),
            "quantization_norm": round(math.sqrt(self.error2), 6),
            "ratio": round(math.sqrt(self.error2 / self.tune2), 4),
        }


def measure(
    inputs: Inputs,
    dest: Path,
    quantize: str,
    stored: dict,
    rows: tuple[str, list] | str,
    weights: WeightShift | None,
    progress: Callable[[str], object],
) -> dict | None:
    """export.json's ``gguf.quantization_shift`` (said in one line), or None."""
    if isinstance(rows, tuple):
        result = logprob_shift(inputs, dest, stored, *rows)
    else:
        result = weights.result() if weights is not None else None
    if result is not None:
        progress(line(quantize, result))
    return result
