"""Turning a model name and engine options into a live runner, with the pre-run line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from spill.console import note
from spill.engines.base import LoadOptions, ModelSpec, Runner
from spill.models.config import load_config
from spill.models.tokenizer import Tokenizer


@dataclass
class Loaded:
    name: str
    folder: Path
    fingerprint: str
    tokenizer: Tokenizer
    runner: Runner


def load_model(
    name: str, weights: str | None, engine: str | None, options: LoadOptions, verb: str
) -> Loaded:
    from spill.engines import resolve
    from spill.models.cache import cached_fingerprint
    from spill.models.resolve import resolve_model

    resolved = resolve_model(name, weights, progress=note)
    folder = Path(resolved.folder)
    config = load_config(folder)
    tokenizer = Tokenizer(folder)
    fp = cached_fingerprint(folder)
    runner = resolve(engine).open(ModelSpec(folder, config), options)
    note(f"spill {verb} · model {name} ({fp[:19]}) · {runner.info.line()}")
    return Loaded(name, folder, fp, tokenizer, runner)
