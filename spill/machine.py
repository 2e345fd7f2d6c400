"""Facts about this machine that need no engine: the CPU's model name, and the small JSON cache
of per-machine measurements under ``machine_cache()``.

Engine-free (no torch or mlx): the job layer records the CPU in provenance, and each engine's
``numerics`` keys its cached bf16 measurement by it. The cache matches schema ``machine`` on
read and on write; a damaged one (not JSON, wrong types, a hand edit) is measured again and
replaced, and a cache folder that cannot be written only means measuring again next time.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import platform
import subprocess
import sys
from collections.abc import Callable

from spill.paths import machine_cache
from spill.validate import SchemaInvalid, parse_json, validate, validate_once

SCHEMA = "machine"

log = logging.getLogger(__name__)


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
    storing it (atomic replace) when absent. A cache that is unreadable or does not match its
    schema counts as empty."""
    path = machine_cache() / name
    known = _read(path)
    if key in known:
        return known[key]
    found = measure()
    validate({key: found}, SCHEMA, where=f"the measurement for {path}")
    known[key] = found
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(known, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        log.info("could not cache the measurement in %s (%s); measuring again next time", path, e)
        with contextlib.suppress(OSError):
            tmp.unlink()
    return found


def _read(path) -> dict:
    try:
        raw = path.read_bytes()
    except OSError:
        return {}
    try:
        known = parse_json(raw)
        validate_once(raw, known, SCHEMA, where=str(path))
    except (ValueError, SchemaInvalid) as e:
        log.warning("ignoring the damaged measurement cache %s (%s); measuring again", path, e)
        return {}
    return known
