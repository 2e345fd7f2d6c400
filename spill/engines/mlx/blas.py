"""Which BLAS MLX's CPU matmuls run on, and a faster one where this machine has it (``preload``,
``describe`` for the pre-run line, ``set_threads``).

``SPILL_MLX_BLAS`` picks: a path to a ``libopenblas.so.0`` (or any CBLAS library), ``bundled`` to
keep MLX's own, or unset to try Debian/Ubuntu's ``libopenblas.so.0`` (``apt-get install
libopenblas0-pthread``). macOS wheels use Accelerate and are left alone. This module must not import
``mlx``; ``spill.engines.mlx`` imports it first.
"""

from __future__ import annotations

import ctypes
import os
import sys

ENV = "SPILL_MLX_BLAS"
CANDIDATES = ("libopenblas.so.0", "libopenblas.so")  # by soname: the dynamic linker's search

_state: dict = {"lib": None, "path": None, "note": None, "done": False}


def _mlx_core_loaded() -> bool:
    return "mlx.core" in sys.modules


def _open(path: str):
    try:
        return ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return None


def _config(lib) -> str:
    """``OpenBLAS 0.3.21 Haswell`` from the library itself, else its path's name."""
    try:
        lib.openblas_get_config.restype = ctypes.c_char_p
        lib.openblas_get_corename.restype = ctypes.c_char_p
        words = lib.openblas_get_config().decode().split()
        core = lib.openblas_get_corename().decode()
        return f"{' '.join(words[:2])} {core}"
    except (AttributeError, OSError):
        return os.path.basename(_state["path"] or "external BLAS")


# The Linux ``mlx[cpu]`` wheel bundles the reference (netlib) BLAS: a float32 1024^3 matmul takes
# ~300-600 ms on a 2-core x86 machine, against ~10-20 ms on OpenBLAS. ``libmlx.so`` takes
# ``cblas_sgemm`` from the global symbol scope first, so an OpenBLAS loaded with ``RTLD_GLOBAL``
# *before* ``mlx.core`` is imported serves every MLX matmul (the same effect as ``LD_PRELOAD``,
# without an environment variable). Loaded after, it changes nothing: the bundled one is bound.
def preload() -> None:
    """Load an optimized CBLAS into the global scope once, before ``mlx.core`` exists."""
    if _state["done"]:
        return
    _state["done"] = True
    if sys.platform != "linux":
        _state["note"] = "Accelerate" if sys.platform == "darwin" else "bundled BLAS"
        return
    choice = os.environ.get(ENV, "").strip()
    if choice == "bundled":
        _state["note"] = f"bundled reference BLAS ({ENV}=bundled)"
        return
    if _mlx_core_loaded():
        _state["note"] = _already_loaded()
        return
    for path in (choice,) if choice else CANDIDATES:
        lib = _open(path)
        if lib is not None and hasattr(lib, "cblas_sgemm"):
            _state["lib"], _state["path"] = lib, path
            return
    if choice:
        _state["note"] = f"bundled reference BLAS ({ENV}={choice} could not be loaded)"
    else:
        _state["note"] = "bundled reference BLAS, slow: apt-get install libopenblas0-pthread"


def _already_loaded() -> str:
    """mlx.core came first: an OpenBLAS serves MLX only if it was preloaded by the process."""
    if "openblas" in os.environ.get("LD_PRELOAD", ""):
        for path in CANDIDATES:
            lib = _open(path)
            if lib is not None:
                _state["lib"], _state["path"] = lib, path
                return _config(lib) + " (LD_PRELOAD)"
    return "bundled reference BLAS (mlx.core was imported before spill could load OpenBLAS)"


def describe() -> str:
    """A few words for the pre-run line: ``OpenBLAS 0.3.21 Haswell`` or why it is the bundled one."""
    if _state["note"] is not None:
        return _state["note"]
    return _config(_state["lib"]) if _state["lib"] is not None else "bundled BLAS"


def set_threads(one: bool) -> None:
    """OpenBLAS on one thread (tiny models are faster so), or back to its own count; no-op on
    other BLASes."""
    lib = _state["lib"]
    if lib is None or not hasattr(lib, "openblas_set_num_threads"):
        return
    if "threads" not in _state:
        _state["threads"] = lib.openblas_get_num_threads()
    lib.openblas_set_num_threads(ctypes.c_int(1 if one else _state["threads"]))
