"""Turning a model name and engine options into a live runner, with the pre-run line."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from spill.console import note
from spill.engines import resolve
from spill.engines.base import LoadOptions, ModelSpec, Runner, TuneShape
from spill.models.cache import cached_fingerprint
from spill.models.config import load_config
from spill.models.integrity import check, weight_hashes
from spill.models.quant import Spec
from spill.models.resolve import quantized_copy, resolve_model
from spill.models.tokenizer import Tokenizer


@dataclass
class LoadedModel:
    """A model open on an engine (``spill.payloads.checkpoint.Loaded`` is a checkpoint read back)."""

    name: str
    folder: Path
    fingerprint: str
    tokenizer: Tokenizer
    runner: Runner
    context: int  # tokens a row may hold in all: the model's max_position_embeddings


def find_model(name: str, weights: str | None, quantize: Spec | None = None):
    """Resolve (and fetch or stage) a model, check its files against the sha256 recorded when
    they entered the cache (a changed file fails here, in one line naming it; only files whose
    stat changed are re-hashed) and fingerprint it, without opening an engine. ``quantize``:
    the float model's quantized copy instead (``<name>@q<bits>g<group>``, made on first use)."""
    resolved = resolve_model(name, weights, progress=note)
    if quantize is not None:
        resolved = quantized_copy(resolved, quantize, note)
    folder = Path(resolved.folder)
    files = weight_hashes(check(folder, name))
    return replace(resolved, files=files), cached_fingerprint(folder)


def open_model(
    name: str,
    resolved,
    fp: str,
    engine: str | None,
    options: LoadOptions,
    verb: str,
    tune: TuneShape | None = None,
    tokenizer: Tokenizer | None = None,
) -> LoadedModel:
    """Open a resolved model on an engine and print the pre-run line. ``tune``: the runner
    trains that, so no ``packed_matmul`` (the int4 kernel has no gradient; said in one line),
    and its needs come out of the memory budget before the ring's.
    ``tokenizer``: the folder's, when the caller loaded it already (one copy is ~40 MB)."""
    if tune is not None and options.packed_matmul:
        note(f"spill {verb}: --packed-matmul is for row jobs (no gradient); dequantized per use")
        options = replace(options, packed_matmul=False)
    folder = Path(resolved.folder)
    config = load_config(folder)
    tokenizer = tokenizer or Tokenizer(folder)  # fail before the engine opens
    runner = resolve(engine).open(ModelSpec(folder, config), options, tune)
    note(f"spill {verb} · model {name} ({fp[:19]}) · {runner.info.line()}")
    return LoadedModel(name, folder, fp, tokenizer, runner, config.max_position_embeddings)
