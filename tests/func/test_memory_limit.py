"""bench/memory_limit.py: a real ``spill run`` in a fresh memory cgroup of its own, and the
figures it reports add up (peak within the limit, the sampled cache and anonymous memory within
the peak, a cold streamed run reading at least the model's bytes from disk, the bound ratio
being the wall time over the larger bound); a limit too small for the process ends in the
kernel's OOM kill, counted. Skipped where no cgroup memory controller is writable.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench import memory_limit as ml
from spill.models.tiny import write_tiny

MIB = 1 << 20


@pytest.fixture(scope="module")
def cgroup_ok():
    try:
        ml.find_own()
    except OSError as e:
        pytest.skip(f"needs a writable cgroup memory controller: {e}")


@pytest.fixture(scope="module")
def job(tmp_path_factory, cgroup_ok):
    root = tmp_path_factory.mktemp("limit")
    model = write_tiny(root / "model", seed=3, layers=6, hidden=256)
    rows = root / "in.jsonl"
    rows.write_text("".join(json.dumps({"id": f"r{i}", "prompt": "hi"}) + "\n" for i in range(2)))
    cmd = [sys.executable, "-m", "spill", "run", str(model), str(rows), "--out"]
    files = sorted(model.glob("*.safetensors"))
    return cmd + [str(root / "out.jsonl"), "--ring", "2", "--max-new-tokens", "3"], files


def _children(parent: Path) -> set[str]:
    return {p.name for p in parent.iterdir() if p.is_dir()}


def test_figures_add_up(job):
    cmd, files = job
    _, parent = ml.find_own()
    before = _children(parent)
    r = ml.measure(cmd, 1024 * MIB, files, passes=4, flops=1e9, disk_bytes=8 * MIB)
    assert r["rc"] == 0, r["output"]
    assert r["oom_kills"] == 0
    assert 0 < r["peak_bytes"] <= 1024 * MIB
    slack = MIB  # the kernel charges in batches ahead of the pages counted in memory.stat
    assert r["peak_cache_bytes"] + r["peak_anon_bytes"] >= r["peak_sampled_bytes"]
    assert 0 < r["peak_sampled_bytes"] <= r["peak_bytes"] + slack
    # the files' cache was dropped before the job: streaming them reads them from disk
    assert r["model_bytes"] == sum(f.stat().st_size for f in files) > 4 * MIB
    assert r["read_bytes"] >= r["model_bytes"]
    assert r["disk_bytes_per_s"] > 0 and r["matmul_flops_per_s"] > 0
    assert r["read_bound_s"] == pytest.approx(4 * r["model_bytes"] / r["disk_bytes_per_s"])
    assert r["compute_bound_s"] == pytest.approx(1e9 / r["matmul_flops_per_s"])
    bound = max(r["read_bound_s"], r["compute_bound_s"])
    assert r["bound_ratio"] == pytest.approx(r["wall_s"] / bound)
    assert _children(parent) == before  # the child cgroup is gone


def test_limit_below_the_process_is_killed(job):
    cmd, files = job
    r = ml.run_limited(cmd, 48 * MIB)
    assert r["rc"] == 137, r["output"]
    assert r["oom_kills"] >= 1
    assert r["peak_bytes"] <= 48 * MIB
