"""Facts about this machine that need no engine: the CPU's model name (``cpu_model``, ``cpu_key``),
the memory this process may use (``physical_memory``, and the limit of the cgroup it lives in,
``memory_limit``), and the small JSON cache of per-machine measurements under ``machine_cache()``
(``cached_measurement``). The cache matches schema ``machine`` on read and on write; a damaged one
(not JSON, wrong types, a hand edit) is measured again and replaced, and a cache folder that cannot
be written only means measuring again next time.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import platform
import subprocess
import sys
from collections.abc import Callable

from spill.ground.paths import machine_cache
from spill.ground.validate import SchemaInvalid, parse_json, validate, validate_once

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


@functools.cache
def cpu_flags() -> str:
    """The CPU's instruction-set flags as the OS lists them (``/proc/cpuinfo``'s ``flags``,
    macOS's ``machdep.cpu.features``), sorted; ``""`` where neither says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            out = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.features", "machdep.cpu.leaf7_features"],
                capture_output=True,
                text=True,
                timeout=5,
            )
            return " ".join(sorted(out.stdout.lower().split()))
        except (OSError, subprocess.SubprocessError):
            pass
    return ""


# The job layer records the CPU in provenance, and each engine's ``numerics`` keys its cached bf16
# measurement by it (model name and flags, ``cpu_key``).
def cpu_key() -> str:
    """What a per-machine measurement is keyed by: the CPU's model and a digest of its flags
    (two VMs of one model name may differ in what the hypervisor passes through)."""
    digest = hashlib.sha256(cpu_flags().encode()).hexdigest()[:12]
    return f"{cpu_model()} | flags {digest}"


def physical_memory() -> int:
    """Bytes of RAM this machine has."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        import psutil

        return int(psutil.virtual_memory().total)


def memory_limit(proc: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes the cgroup this process lives in may hold (anonymous memory and page cache alike):
    the smallest limit on its path (cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes``), as
    a Slurm job's ``--mem`` or a container's memory limit sets it; None where none is set or
    none can be read (macOS, a cgroup not mounted)."""
    try:
        lines = open(proc).read().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            folder, name = os.path.join(root, "memory"), "memory.limit_in_bytes"
        elif controllers == "":
            folder, name = root, "memory.max"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for n in range(len(parts), -1, -1):  # a parent's limit binds its children
            try:
                text = open(os.path.join(folder, *parts[:n], name)).read().strip()
            except OSError:
                continue
            if text.isdigit() and int(text) < 1 << 60:  # v1 writes "no limit" as ~2**63
                limits.append(int(text))
    return min(limits) if limits else None


def anonymous_memory(status: str = "/proc/self/status") -> int | None:
    """Bytes of anonymous memory this process holds now (``RssAnon``); None where the kernel
    does not say (macOS)."""
    try:
        for line in open(status):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


# The cache is per machine, not per ``SPILL_HOME`` (``paths.machine_cache``), so every home on one
# machine computes in the same numerics.
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
