"""Where spill keeps things: ``SPILL_HOME`` on this machine (default ``~/.spill``), and a
project's build state (default ``<project>/.spill``, ``STATE_DIR``)."""

from __future__ import annotations

import os
from pathlib import Path

STATE_DIR = ".spill"  # a project's state location, unless --state names another


def spill_home() -> Path:
    return Path(os.environ.get("SPILL_HOME") or Path.home() / ".spill").expanduser()


def models_dir() -> Path:
    return spill_home() / "models"


def machine_cache() -> Path:
    """Per-machine measurements (for example whether bf16 matmul is fast here): one folder per
    machine, shared by every SPILL_HOME on it (``SPILL_MACHINE_CACHE``, else the user's cache
    folder, ``$XDG_CACHE_HOME/spill/machine`` or ``~/.cache/spill/machine``)."""
    if os.environ.get("SPILL_MACHINE_CACHE"):
        return Path(os.environ["SPILL_MACHINE_CACHE"]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "spill" / "machine"
