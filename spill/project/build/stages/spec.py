"""``StageSpec``: what a stage is in one build (its inputs and size), and their fingerprint."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spill.project.build.stages.base import Stage


def fingerprint(inputs: Mapping[str, Any]) -> str:
    text = json.dumps(inputs, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class StageSpec:
    """What a stage is in this build: its inputs and size."""

    name: str
    inputs: Mapping[str, Any]  # key path -> value: everything that decides the stage's result
    total: int  # steps or rows
    enabled: bool = True
    why_off: str = ""  # reason when not enabled

    @property
    def stage(self) -> Stage:
        from spill.project.build.stages import get

        return get(self.name)

    @property
    def needs(self) -> tuple[str, ...]:
        return self.stage.needs

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.inputs)
