"""Facts about this machine that need no engine: the CPU's model name, and the small JSON cache
of per-machine measurements under ``machine_cache()``.

Engine-free (no torch or mlx): the job layer records the CPU in provenance, and each engine's
``numerics`` keys its cached bf16 measurement by it.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable

from spill.paths import machine_cache


@functools.cache
def cpu_model() -> str:
    """The CPU's marketing name (``/proc/cpuinfo`` on Linux, ``sysctl`` on macOS)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            out = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"],
                capture_output=True,
                text=True,
                timeout=5,
            )
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine() or "unknown cpu"


def cached_measurement(name: str, key: str, measure: Callable[[], dict]) -> dict:
    """``machine_cache()/name`` maps keys to measurements: return ``key``'s, measuring and
    storing it (atomic replace) when absent. An unreadable cache counts as empty."""
    path = machine_cache() / name
    try:
        known = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        known = {}
    if key in known:
        return known[key]
    found = measure()
    known[key] = found
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(known, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return found
