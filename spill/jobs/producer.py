"""What produced a piece of job state: engine, device, hardware, OS, numerics, library versions.

Row segments record it in every commit and tune checkpoints per range of steps, so a job that
moved between machines says which rows or steps each one made. Engine-free: the engine's own
facts come from its ``EngineInfo``; the rest is read from the OS (``/proc``, ``sysctl``) and
from installed package metadata, never by importing torch or mlx.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from pathlib import Path
from typing import Any

from spill import __version__
from spill.engines import NEEDS
from spill.ground.machine import cpu_model

# The distribution whose version pins an engine's numerics (same versions: bit-exact resume).
ENGINE_DISTRIBUTIONS = NEEDS


def _nvidia_models() -> list[str]:
    """GPU model names from the NVIDIA driver's /proc files, in PCI bus order."""
    root = Path("/proc/driver/nvidia/gpus")
    names = []
    try:
        for bus in sorted(root.iterdir()):
            for line in (bus / "information").read_text().splitlines():
                if line.startswith("Model:"):
                    names.append(line.split(":", 1)[1].strip())
    except OSError:
        pass
    return names


def hardware(device: str) -> str:
    """A readable name for the hardware behind ``device`` (``cpu``, ``cuda:1``, ``gpu``)."""
    if device.startswith("cuda"):
        gpus = _nvidia_models()
        index = int(device.partition(":")[2] or 0)
        # CUDA's default order is fastest-first, so with mixed GPUs this may name a sibling
        name = gpus[index] if index < len(gpus) else (gpus[0] if gpus else "NVIDIA GPU")
        return f"{name} (cuda)"
    cores = os.cpu_count() or 0
    return f"{cpu_model()} ({platform.machine()}, {cores} cores)"


def os_name() -> str:
    if sys.platform == "darwin":
        return f"macOS {platform.mac_ver()[0] or platform.release()} ({platform.machine()})"
    if sys.platform.startswith("linux"):
        libc, ver = platform.libc_ver()
        tail = f", {libc} {ver}" if libc else ""
        return f"Linux {platform.release()} ({platform.machine()}{tail})"
    return f"{platform.system()} {platform.release()} ({platform.machine()})"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def describe(info: Any) -> dict[str, Any]:
    """The producer record for a runner's ``EngineInfo`` (engine, device, numerics)."""
    libraries = {"spill": __version__, "python": platform.python_version()}
    for dist in ("numpy", ENGINE_DISTRIBUTIONS.get(info.engine)):
        if dist and (v := _version(dist)):
            libraries[dist] = v
    return {
        "engine": info.engine,
        "device": info.device,
        "hardware": getattr(info, "hardware", None) or hardware(info.device),
        "os": os_name(),
        "numerics": info.numerics,
        "machine": platform.node() or "unknown",
        "libraries": libraries,
    }


def extend(previous: list[dict], me: dict, start: int, end: int) -> list[dict]:
    """Extend the last range when this run is the same producer, else open a new one. A range
    computed by more than one process says how many (``procs``; one when absent)."""
    keys = ("engine", "hardware", "os", "numerics")
    rec = {k: me[k] for k in keys} | {
        "machine": me.get("machine"),
        "libraries": me.get("libraries"),
    }
    if me.get("procs", 1) > 1:
        rec["procs"] = me["procs"]
    out = [dict(p) for p in previous]
    if (
        out
        and all(out[-1].get(k) == rec[k] for k in (*keys, "machine", "libraries"))
        and out[-1].get("procs", 1) == rec.get("procs", 1)
        and out[-1]["to_step"] == start
    ):
        out[-1]["to_step"] = end
    elif end > start:
        out.append({"from_step": start, "to_step": end, **rec})
    return out
