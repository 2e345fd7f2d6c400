"""What a server serves: a base model open on an engine and the adapters requests may name.

``open_served(target, ...)``: ``target`` is a model (alias, hub id, local folder) or a project
folder (it has spill.yaml), which serves its model (its quantized copy when the project tunes
on one) under the model's name and every adapter built under ``<project>/.spill/adapters/``
under its folder's name. ``adapters`` adds more by name. The pre-run line is printed as every
verb prints it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from spill.errors import UsageError
from spill.ground.paths import STATE_DIR
from spill.jobs.adapter_files import Adapter, load_adapter
from spill.jobs.loading import LoadedModel, find_model, open_model
from spill.models.config import load_config
from spill.models.quant import Spec, spec_of
from spill.project import sources
from spill.project.bundle.installed import model_folder
from spill.project.config import compose
from spill.settings import EngineSettings


@dataclass
class Served:
    loaded: LoadedModel
    name: str  # what ``model`` names for the base model
    adapters: tuple[str, ...]
    vocab: int  # token ids a prompt may hold: below the model's and the tokenizer's sizes

    @property
    def context(self) -> int:
        return self.loaded.context

    def adapter_of(self, model: str | None) -> str | None | bool:
        """The adapter a request's ``model`` picks (None: the base), or False: none here."""
        if model is None or model == self.name:
            return None
        return model if model in self.adapters else False


def project_adapters(root: Path) -> dict[str, Path]:
    """A project's built adapters, by folder name."""
    folder = root / STATE_DIR / "adapters"
    if not folder.is_dir():
        return {}
    return {p.name: p for p in sorted(folder.iterdir()) if p.is_dir()}


def _target(target: str, weights: str | None, quantize: Spec | None):
    """(model name, weights, quantization, adapters) of a model or a project folder."""
    root = Path(target)
    if not (root / sources.FILE).is_file():
        return target, weights, quantize, {}
    project = compose(root.resolve())
    name = project.model.name
    weights = weights or model_folder(project.root, name)
    return name, weights, quantize or spec_of(project.model), project_adapters(project.root)


def open_served(
    target: str,
    adapters: dict[str, Path],
    engine: EngineSettings,
    weights: str | None,
    quantize: Spec | None = None,
) -> Served:
    name, weights, quantize, found = _target(target, weights, quantize)
    for given in adapters:
        if given in found:
            raise UsageError(
                f"--adapter {given}=...: the project already serves an adapter {given}"
            )
    named = {**found, **adapters}
    if name in named:
        raise UsageError(f"adapter name {name!r} is the base model's; pick another")
    loaded_adapters: dict[str, Adapter] = {n: load_adapter(p) for n, p in named.items()}
    resolved, fp = find_model(name, weights, quantize)
    shown = name if quantize is None else resolved.name
    loaded = open_model(shown, resolved, fp, engine.name, engine, "serve")
    try:
        if loaded_adapters and not hasattr(loaded.runner, "add_adapter"):
            raise UsageError(f"the {loaded.runner.info.engine} engine cannot serve adapters yet")
        for n, a in loaded_adapters.items():
            loaded.runner.add_adapter(n, a.lora, a.params)
        vocab = min(load_config(loaded.folder).vocab_size, loaded.tokenizer.vocab_size)
        return Served(loaded, name, tuple(loaded_adapters), vocab)
    except BaseException:
        loaded.runner.close()
        raise
