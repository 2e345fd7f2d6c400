"""Run any command inside a memory limit that counts the page cache, and say what it cost
(issue 38, docs/reports/016-bigger-than-memory.md).

    python bench/memory_limit.py --limit 700MB [--files F ...] [--passes P] [--flops N]
        [--outside] [--json OUT] -- spill run smollm2:135m@f32 --prompt hi

The command runs in a fresh child of this process's memory cgroup (cgroup v1: ``memory``
controller, ``memory.limit_in_bytes``; v2: ``memory.max``), entered before ``exec`` so that
nothing it allocates or reads is charged elsewhere; the child cgroup is removed afterwards.
Reported:

* peak usage: the cgroup's own high-water mark (v1 ``memory.max_usage_in_bytes``, v2
  ``memory.peak``: anonymous memory plus the page cache the job caused, which is what the limit
  holds), and the peaks of cache and anonymous memory sampled from ``memory.stat`` every 20 ms
  (v1 ``total_cache``/``total_rss``, v2 ``file``/``anon``); OOM kills (v1 ``oom_control``);
* bytes read from disk: ``read_bytes`` of ``/proc/<pid>/io`` sampled while the job lives, and
  at its end ``wait4``'s ``ru_inblock`` (the same counter in 512-byte units, reaped children
  included), whichever is larger;
* the disk's sequential rate, measured in the same run: ``--files`` (the model's files; else a
  file of ``--disk-bytes`` written for it) read in 8 MiB chunks with their cached pages dropped
  first (``posix_fadvise(DONTNEED)``), and dropped again so that the job starts cold;
* this machine's matmul rate in `--dtype` (torch, 2048^3, best of 5), the job's numerics; with
  ``--shapes MxKxN,...`` the rate over the job's own GEMMs, which the compute bound then uses;
* the ratio of the job's wall time to max(read bound, compute bound): the read bound is
  ``--passes`` reads of ``--files`` at the measured disk rate, the compute bound ``--flops`` at
  the measured matmul rate (the caller knows the job's work: 2 x params per decoded token,
  about 8 x params per trained token when the forward is recomputed).

With ``--outside`` the same command runs again right after, in a fresh child cgroup with no limit
of its own (the model's cache dropped again first), on the same disk and matmul figures: the
two sides of an inside/outside comparison measured back to back, with the ratio of their times.
Nothing here asserts a time; tests/func/test_memory_limit.py checks that the figures add up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

CHUNK = 8 << 20
SAMPLE_S = 0.02


class Cgroup:
    """A fresh child of this process's memory cgroup, ``limit`` bytes (None: no limit)."""

    def __init__(self, name: str, limit: int | None):
        self.v1, parent = find_own()
        self.path = parent / name
        self.path.mkdir()
        if limit is not None:
            self._write("memory.limit_in_bytes" if self.v1 else "memory.max", str(limit))
        self.limit = limit

    def _write(self, name: str, text: str) -> None:
        (self.path / name).write_text(text)

    def _read(self, name: str) -> str:
        return (self.path / name).read_text()

    def enter(self) -> None:
        """Move the calling process in (a ``preexec_fn``: runs in the child before ``exec``)."""
        self._write("cgroup.procs", str(os.getpid()))

    def stat(self) -> tuple[int, int]:
        """(page cache, anonymous) bytes charged now."""
        keys = ("total_cache", "total_rss") if self.v1 else ("file", "anon")
        found = dict.fromkeys(keys, 0)
        for line in self._read("memory.stat").splitlines():
            key, _, value = line.partition(" ")
            if key in found:
                found[key] = int(value)
        return found[keys[0]], found[keys[1]]

    def peak(self) -> int:
        return int(self._read("memory.max_usage_in_bytes" if self.v1 else "memory.peak"))

    def oom_kills(self) -> int:
        name, key = ("memory.oom_control", "oom_kill") if self.v1 else ("memory.events", "oom_kill")
        for line in self._read(name).splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
        return 0

    def remove(self) -> None:
        for _ in range(50):  # the kernel lets go of an exited task's cgroup a moment later
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def find_own() -> tuple[bool, Path]:
    """(v1, folder) of this process's memory cgroup; raises OSError where none is writable."""
    v1 = v2 = None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            v1 = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
        elif controllers == "":
            v2 = Path("/sys/fs/cgroup") / path.lstrip("/")
    if v1 is not None and (v1 / "memory.limit_in_bytes").exists():
        folder, is_v1 = v1, True
    elif v2 is not None and "memory" in _text(v2 / "cgroup.subtree_control").split():
        folder, is_v1 = v2, False
    else:
        raise OSError("no cgroup memory controller here (v1 memory, or v2 with memory enabled)")
    if not os.access(folder, os.W_OK):
        raise OSError(f"{folder} is not writable (run as root, or in a delegated cgroup)")
    return is_v1, folder


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def drop_cache(path: Path) -> None:
    """Ask the kernel to forget ``path``'s cached pages (clean pages only: written files are
    fsync'd first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_rate(files: list[Path]) -> tuple[float, int]:
    """(bytes/s, bytes) of a cold sequential read of ``files``, their cache dropped before and
    after."""
    buf = bytearray(CHUNK)
    total, start = 0, time.perf_counter()
    for path in files:
        drop_cache(path)
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
        drop_cache(path)
    return total / (time.perf_counter() - start), total


def scratch_file(folder: Path, nbytes: int) -> Path:
    path = folder / "disk-rate.bin"
    with open(path, "wb") as f:
        block = os.urandom(CHUNK)
        for _ in range(max(1, nbytes // CHUNK)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    return path


def matmul_rate(n: int = 2048, rounds: int = 5, dtype: str = "float32") -> float:
    """FLOP/s of one n^3 GEMM in ``dtype`` on this machine (torch, its default threads), best of
    ``rounds``."""
    import torch

    a, b = torch.randn(n, n).to(getattr(torch, dtype)), torch.randn(n, n).to(getattr(torch, dtype))
    a @ b  # warm-up: thread pool, page faults
    best = min(_timed(lambda: a @ b) for _ in range(rounds))
    return 2 * n**3 / best


# The 2048^3 GEMM is the machine's best case; a job's own GEMMs can run slower (a skinny M of 512
# tokens against a 2560-wide layer, a rank-16 adapter), so ``--shapes`` measures the rate over the
# job's shapes instead: the bound it gives is what those matmuls alone would take.
def shapes_rate(
    shapes: list[tuple[int, int, int]], rounds: int = 5, dtype: str = "float32"
) -> float:
    """FLOP/s over GEMMs of ``(m, k, n)`` each (``(m, k) @ (k, n)``, torch, its default threads):
    their FLOPs over the sum of each one's best of ``rounds``, so each counts by its work."""
    import torch

    flops = seconds = 0.0
    for m, k, n in shapes:
        a = torch.randn(m, k).to(getattr(torch, dtype))
        b = torch.randn(k, n).to(getattr(torch, dtype))
        a @ b  # warm-up
        seconds += min(_timed(lambda a=a, b=b: a @ b) for _ in range(rounds))
        flops += 2 * m * k * n
    return flops / seconds


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """``512x2560x6912,512x6912x2560`` -> [(512, 2560, 6912), (512, 6912, 2560)]."""
    out = []
    for part in text.split(","):
        m, k, n = (int(x) for x in part.strip().lower().split("x"))
        out.append((m, k, n))
    return out


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _io_read(pid: int) -> int:
    for line in _text(Path(f"/proc/{pid}/io")).splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def run_limited(cmd: list[str], limit: int | None, env: dict | None = None) -> dict:
    """Run ``cmd`` in a fresh child cgroup of ``limit`` bytes; its figures (see the module
    docstring), output included."""
    group = Cgroup(f"spill-bench-{os.getpid()}-{time.monotonic_ns()}", limit)
    try:
        seen = {"cache": 0, "anon": 0, "usage": 0, "read": 0}
        start = time.perf_counter()
        with tempfile.TemporaryFile() as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=group.enter
            )
            done = threading.Event()

            def sample():
                while not done.wait(SAMPLE_S):
                    cache, anon = group.stat()
                    seen["cache"] = max(seen["cache"], cache)
                    seen["anon"] = max(seen["anon"], anon)
                    seen["usage"] = max(seen["usage"], cache + anon)
                    seen["read"] = max(seen["read"], _io_read(proc.pid))

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            _, status, usage = os.wait4(proc.pid, 0)
            wall = time.perf_counter() - start
            done.set()
            sampler.join()
            proc.returncode = os.waitstatus_to_exitcode(status)
            out.seek(0)
            output = out.read().decode(errors="replace")
        return {
            "command": cmd,
            "limit_bytes": limit,
            "cgroup": "v1" if group.v1 else "v2",
            "rc": proc.returncode if proc.returncode >= 0 else 128 - proc.returncode,
            "wall_s": wall,
            "peak_bytes": group.peak(),
            "peak_cache_bytes": seen["cache"],
            "peak_anon_bytes": seen["anon"],
            "peak_sampled_bytes": seen["usage"],
            "oom_kills": group.oom_kills(),
            "read_bytes": max(seen["read"], usage.ru_inblock * 512),
            "max_rss_bytes": usage.ru_maxrss * 1024,
            "output": output,
        }
    finally:
        group.remove()


def measure(
    cmd: list[str],
    limit: int | None,
    files: list[Path],
    passes: float = 1.0,
    flops: float = 0.0,
    disk_bytes: int = 512 << 20,
    env: dict | None = None,
    dtype: str = "float32",
    shapes: list[tuple[int, int, int]] | None = None,
) -> dict:
    """The whole report for one command: disk and matmul rates measured now, then the job; with
    ``shapes`` the compute bound takes the rate over those GEMMs (``shapes_rate``)."""
    with tempfile.TemporaryDirectory() as tmp:
        probe = files or [scratch_file(Path(tmp), disk_bytes)]
        rate, probed = disk_rate(probe)
    square = matmul_rate(dtype=dtype)
    at_shapes = shapes_rate(shapes, dtype=dtype) if shapes else None
    gemm = at_shapes or square
    model_bytes = sum(p.stat().st_size for p in files)
    for path in files:
        drop_cache(path)  # the job starts cold
    found = run_limited(cmd, limit, env)
    read_bound = passes * model_bytes / rate
    compute_bound = flops / gemm
    bound = max(read_bound, compute_bound)
    return found | {
        "model_bytes": model_bytes,
        "passes": passes,
        "flops": flops,
        "disk_bytes_per_s": rate,
        "disk_probe_bytes": probed,
        "matmul_flops_per_s": gemm,
        "matmul_square_flops_per_s": square,
        "matmul_shapes": [list(x) for x in shapes] if shapes else None,
        "matmul_dtype": dtype,
        "read_bound_s": read_bound,
        "compute_bound_s": compute_bound,
        "bound_ratio": found["wall_s"] / bound if bound > 0 else None,
    }


def outside(found: dict, files: list[Path], env: dict | None = None) -> dict:
    """``found`` (a ``measure`` inside a limit) with the same command run right after outside any
    limit of its own, cold again, on the same disk and matmul figures: ``{"inside": ...,
    "outside": ..., "time_ratio": inside wall / outside wall}``."""
    for path in files:
        drop_cache(path)
    free = run_limited(found["command"], None, env)
    rates = {k: v for k, v in found.items() if k not in free}
    bound = max(found["read_bound_s"], found["compute_bound_s"])
    free |= rates | {"bound_ratio": free["wall_s"] / bound if bound > 0 else None}
    return {"inside": found, "outside": free, "time_ratio": found["wall_s"] / free["wall_s"]}


def summary(r: dict) -> str:
    mb = 1 << 20  # MiB, the unit --limit and --memory count in
    limit = f"{r['limit_bytes'] / mb:.0f} MiB" if r["limit_bytes"] else "no limit"
    ratio = f"{r['bound_ratio']:.2f}x" if r["bound_ratio"] else "n/a"
    at = ""
    if r.get("matmul_shapes"):
        at = f" at the job's shapes (2048^3: {r['matmul_square_flops_per_s'] / 1e9:.0f})"
    return (
        f"rc {r['rc']} in {r['wall_s']:.1f} s ({limit}, cgroup {r['cgroup']}, "
        f"{r['oom_kills']} OOM kills)\n"
        f"peak {r['peak_bytes'] / mb:.0f} MiB (sampled: cache {r['peak_cache_bytes'] / mb:.0f} MiB, "
        f"anon {r['peak_anon_bytes'] / mb:.0f} MiB); read {r['read_bytes'] / mb:.0f} MiB from disk "
        f"(model {r['model_bytes'] / mb:.0f} MiB x {r['passes']:g})\n"
        f"disk {r['disk_bytes_per_s'] / 1e9:.2f} GB/s, {r['matmul_dtype']} matmul "
        f"{r['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s{at}; read bound {r['read_bound_s']:.1f} s, compute bound "
        f"{r['compute_bound_s']:.1f} s; time / max(bounds) {ratio}"
    )


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from spill.ground.sizes import parse_size

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", help="the cgroup's limit, e.g. 700MB (default: none of its own)")
    p.add_argument("--files", nargs="*", type=Path, default=[], help="the model's files")
    p.add_argument("--passes", type=float, default=1.0, help="reads of --files the job needs")
    p.add_argument("--flops", type=float, default=0.0, help="the job's float operations")
    p.add_argument("--disk-bytes", default="512MiB", help="probe size without --files")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="the matmul rate's dtype: the job's numerics (its pre-run line says which)",
    )
    p.add_argument(
        "--shapes",
        type=parse_shapes,
        help="the job's GEMMs as MxKxN[,MxKxN...]: the compute bound's rate is measured over "
        "them (default: 2048^3, the machine's best case)",
    )
    p.add_argument(
        "--outside",
        action="store_true",
        help="then run the command again outside any limit, back to back, and compare times",
    )
    p.add_argument("--json", type=Path, help="write the figures here")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command")
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("give the command after --")
    limit = parse_size(args.limit) if args.limit else None
    found = measure(
        cmd,
        limit,
        args.files,
        args.passes,
        args.flops,
        parse_size(args.disk_bytes),
        dtype=args.dtype,
        shapes=args.shapes,
    )
    print(found["output"], end="")
    print(summary(found))
    rc = found["rc"]
    if args.outside:
        found = outside(found, args.files)
        free = found["outside"]
        print(free["output"], end="")
        print("outside any limit: " + summary(free))
        print(f"time inside / outside: {found['time_ratio']:.2f}x")
        rc = rc or free["rc"]
    if args.json:
        args.json.write_text(json.dumps(found, indent=2) + "\n")
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
