"""``StageSpec``: what a stage is in one build (its inputs and size), and their fingerprint."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def fingerprint(inputs: Mapping[str, Any]) -> str:
    text = json.dumps(inputs, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class StageSpec:
    """What a stage is in this build: its inputs and size."""

    name: str
    inputs: Mapping[str, Any]  # key path -> value: everything that decides the stage's result
    total: int  # steps or rows
    needs: tuple[str, ...] = ()  # the earlier stages whose output it reads
    enabled: bool = True
    why_off: str = ""  # reason when not enabled

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.inputs)
