"""Where spill keeps things on this machine: ``SPILL_HOME`` (default ``~/.spill``)."""

from __future__ import annotations

import os
from pathlib import Path


def spill_home() -> Path:
    return Path(os.environ.get("SPILL_HOME") or Path.home() / ".spill").expanduser()


def models_dir() -> Path:
    return spill_home() / "models"


def machine_cache() -> Path:
    """Per-machine measurements (for example whether bf16 matmul is fast here)."""
    return spill_home() / "machine"
