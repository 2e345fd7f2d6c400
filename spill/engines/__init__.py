"""Engine resolution: pick the engine once, by name; nothing else branches on the engine.

Importing this package imports neither torch nor mlx; ``resolve`` imports the chosen one.
"""

from __future__ import annotations

import importlib
import importlib.util
import platform
import sys

from spill.engines.base import Engine
from spill.errors import EngineError

ENGINES = {"torch": "spill.engines.torch", "mlx": "spill.engines.mlx"}
NEEDS = {"torch": "torch", "mlx": "mlx"}
INSTALL = {"torch": "pip install torch", "mlx": 'pip install "streamweights[mlx]"'}


def _present(name: str) -> bool:
    return (
        importlib.util.find_spec(NEEDS[name]) is not None
        and importlib.util.find_spec(ENGINES[name]) is not None
    )


def auto_engine() -> str:
    """MLX on Apple silicon when it is installed, torch everywhere else."""
    if sys.platform == "darwin" and platform.machine() == "arm64" and _present("mlx"):
        return "mlx"
    return "torch"


def resolve(name: str | None = "auto") -> Engine:
    name = auto_engine() if name in (None, "auto") else name
    if name not in ENGINES:
        raise EngineError(f"unknown engine {name!r}; use --engine torch, mlx or auto")
    if not _present(name):
        raise EngineError(
            f"the {name} engine is not installed here; {INSTALL[name]}, or use --engine auto"
        )
    return importlib.import_module(ENGINES[name]).ENGINE
