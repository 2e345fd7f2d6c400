"""What each stage reads in one build: ``specs(project, prepared)`` -> one ``StageSpec`` each,
as each stage's ``spec`` says (``spill.project.build.stages``).

Pure and engine-free. Inputs are keyed by the config path a user edits (``tune.lr``),
``data:<file>`` for a derived file's hash and ``stage:<name>`` for the fingerprint of a stage
whose output is read. What cannot change a result stays out: ``tune.ckpt_every``,
``eval.batch``, ``teacher.batch``, the engine group, comments.
"""

from __future__ import annotations

from pathlib import Path

from spill.errors import ModelError, ModelNotFound
from spill.models.cache import imported
from spill.models.names import (
    ALIASES,
    looks_like_alias,
    looks_like_hub_id,
    parse_tiny,
    resolve_alias,
    split_quant,
)
from spill.project.build.stages import STAGES
from spill.project.build.stages.spec import StageSpec, fingerprint  # noqa: F401  (this module's API)
from spill.project.config import Project
from spill.project.data import Prepared


def specs(project: Project, prepared: Prepared) -> list[StageSpec]:
    """One spec per stage of ``STAGES``, in order; each stage says its own inputs."""
    done: dict[str, StageSpec] = {}
    for stage in STAGES:
        done[stage.name] = stage.spec(project, prepared, done)
    return list(done.values())


def check_model_name(name: str, key: str) -> None:
    """Refuse a model name that can name nothing, without loading or fetching anything.

    The same order as ``spill.models.resolve.resolve_model``: a URI is staged (checked when it
    is); ``tiny:`` must parse; a local folder must exist (relative to here, as the jobs read it);
    a name ``spill models import`` gave names its cache folder; an alias must be known; a hub id
    is accepted as spelled (the hub cannot be asked offline).
    """
    text = name.strip()
    if not text:
        raise ModelNotFound(f"{key} is empty; name an alias, a hub id or a local model folder")
    if "://" in text:
        return
    if imported(text) is not None:  # the name `spill models import` gave (`<stem>@<type>`)
        return
    if not Path(text).expanduser().is_dir():
        text = split_quant(text)[0]  # a quantized copy (@q4_1, @q4g64) is checked by its base
    try:
        if parse_tiny(text) is not None:
            return
        path = Path(text).expanduser()
        if path.is_dir():
            return
        if path.is_file():
            raise ModelError(
                f"{key}: {text} is a file, not a model folder; give an HF-layout folder"
            )
        if text.startswith(("/", ".", "~")) or "\\" in text or text.count("/") > 1:
            raise ModelNotFound(
                f"{key}: {text}: no such folder; give an HF-layout model folder, an alias or a hub id"
            )
        if looks_like_alias(text):
            resolve_alias(text)
            return
    except ModelError as e:
        message = str(e)
        raise type(e)(message if message.startswith(key) else f"{key}: {message}") from None
    if not looks_like_hub_id(text):
        raise ModelNotFound(
            f"{key}: no model named {text!r}: not a folder here, an alias ({', '.join(ALIASES)}) "
            "or a hub id (org/name)"
        )
