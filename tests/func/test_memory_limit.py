"""bench/memory_limit.py: a real ``spill run`` in a fresh memory cgroup of its own, and the
figures it reports add up (peak within the limit, the sampled cache and anonymous memory within
the peak, a cold streamed run reading at least the model's bytes from disk, the bound ratio
being the wall time over the larger bound); a limit too small for the process ends in the
kernel's OOM kill, counted. Then what spill promises there (issue 38): ``--memory M`` holds
the peak under M + ``RUNTIME``, a cgroup's limit is the default budget, and a budget too small
for the smallest plan is refused in one line naming the smallest that fits. Skipped where no
cgroup memory controller is writable.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import memory_limit as ml
from spill.engines.core.budget import RUNTIME
from spill.models.sources.tiny import write_tiny

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


def test_the_compute_bound_at_the_jobs_shapes(monkeypatch, tmp_path):
    """``--shapes``: the compute bound takes the rate measured over the job's GEMMs, the 2048^3
    rate is kept beside it, and the summary says which (no cgroup needed: the job is faked)."""
    assert ml.parse_shapes("512x2560x6912, 64X8x16") == [(512, 2560, 6912), (64, 8, 16)]
    assert ml.shapes_rate([(32, 64, 48), (16, 16, 16)], rounds=2) > 0
    model = tmp_path / "m.safetensors"
    model.write_bytes(b"\0" * 4096)
    monkeypatch.setattr(ml, "disk_rate", lambda files: (4096.0, 4096))
    monkeypatch.setattr(ml, "matmul_rate", lambda dtype: 4e9)
    monkeypatch.setattr(ml, "shapes_rate", lambda shapes, dtype: 1e9 * len(shapes))
    fake = {"wall_s": 8.0, "limit_bytes": None, "rc": 0, "cgroup": "v1", "oom_kills": 0}
    fake |= dict.fromkeys(("peak_bytes", "peak_cache_bytes", "peak_anon_bytes", "read_bytes"), 1)
    monkeypatch.setattr(ml, "run_limited", lambda cmd, limit, env: dict(fake))
    r = ml.measure(["true"], None, [model], passes=2, flops=4e9, shapes=[(1, 2, 3), (4, 5, 6)])
    assert r["matmul_flops_per_s"] == 2e9 and r["matmul_square_flops_per_s"] == 4e9
    assert r["compute_bound_s"] == pytest.approx(2.0) and r["read_bound_s"] == pytest.approx(2.0)
    assert r["bound_ratio"] == pytest.approx(4.0)
    assert "2 GFLOP/s at the job's shapes (2048^3: 4)" in ml.summary(r)
    plain = ml.measure(["true"], None, [model], passes=2, flops=4e9)
    assert plain["matmul_flops_per_s"] == 4e9 and plain["matmul_shapes"] is None


def test_limit_below_the_process_is_killed(job):
    cmd, files = job
    r = ml.run_limited(cmd, 48 * MIB)
    assert r["rc"] == 137, r["output"]
    assert r["oom_kills"] >= 1
    assert r["peak_bytes"] <= 48 * MIB


@pytest.fixture(scope="module")
def big(tmp_path_factory, cgroup_ok):
    """A model (168 MiB in 32 layers) larger than the budgets below, and a row job on it."""
    root = tmp_path_factory.mktemp("big")
    model = write_tiny(root / "model", seed=5, layers=32, hidden=512)
    rows = root / "in.jsonl"
    rows.write_text("".join(json.dumps({"id": f"r{i}", "prompt": "hi"}) + "\n" for i in range(2)))
    cmd = [sys.executable, "-m", "spill", "run", str(model), str(rows), "--out"]
    cmd += [str(root / "out.jsonl"), "--max-new-tokens", "2"]
    # a local folder is hashed on first use (a read the cache keeps, once): not measured here
    subprocess.run([*cmd, "--memory", "1G"], check=True, capture_output=True)
    return cmd, sorted(model.glob("*.safetensors"))


def test_memory_is_a_promise(big):
    """In a cgroup with no limit of its own, ``--memory M`` holds the peak (anonymous memory
    plus the page cache the run causes) under M + RUNTIME; without it, the cache keeps the
    model it read and the peak passes that mark."""
    cmd, files = big
    model = sum(f.stat().st_size for f in files)
    promised = ml.measure([*cmd, "--memory", "32MiB"], None, files, disk_bytes=MIB)
    assert promised["rc"] == 0, promised["output"]
    assert "memory 32 MiB (--memory)" in promised["output"]
    assert promised["read_bytes"] >= model
    assert promised["peak_bytes"] <= 32 * MIB + RUNTIME
    free = ml.measure(cmd, None, files, disk_bytes=MIB)
    assert free["rc"] == 0, free["output"]
    assert free["peak_cache_bytes"] >= model
    assert free["peak_bytes"] > 32 * MIB + RUNTIME


def test_the_cgroup_limit_is_the_default_budget(big):
    """No ``--memory``: the cgroup's limit, less RUNTIME, sizes the ring, and the pre-run
    line says so; the run finishes inside the limit."""
    cmd, files = big
    limit = RUNTIME + 48 * MIB
    r = ml.measure(cmd, limit, files, disk_bytes=MIB)
    assert r["rc"] == 0, r["output"]
    assert f"memory 48 MiB (cgroup limit {limit // MIB} MiB less" in r["output"]
    assert "streaming, ring" in r["output"]
    assert r["oom_kills"] == 0 and r["peak_bytes"] <= limit


def test_too_small_is_refused_before_the_start(big):
    cmd, _ = big
    r = ml.run_limited([*cmd, "--memory", "4MiB"], None)
    assert r["rc"] == 1
    lines = [x for x in r["output"].splitlines() if x.startswith("spill: error:")]
    assert len(lines) == 1, r["output"]
    assert "--memory 4 MiB cannot hold" in lines[0]
    said = re.search(r"use --memory (\d+)MiB or more \(or --ring 1\)", lines[0])
    assert said, lines[0]
    # the smallest M it names is the smallest that starts: one MiB less is refused
    need = int(said[1])
    less = subprocess.run([*cmd, "--memory", f"{need - 1}MiB"], capture_output=True, text=True)
    assert less.returncode == 1 and f"use --memory {need}MiB" in less.stderr, less.stderr
    enough = subprocess.run([*cmd, "--memory", f"{need}MiB"], capture_output=True, text=True)
    assert enough.returncode == 0, enough.stderr


def test_a_tune_with_memory_finishes_inside_memory_plus_runtime(big, tmp_path):
    """A streamed tune with ``--memory M`` (room for the resident parts, a ring of 2, the
    trainer's state and the kept layer inputs: ~73 MiB of this model's 96) finishes inside a
    cgroup of M + RUNTIME, nothing OOM-killed (with RUNTIME 256 MiB it was killed)."""
    cmd, _ = big
    rows = tmp_path / "train.jsonl"
    words = "the quick brown fox jumps over a lazy dog while tickets pile up".split()
    text = [" ".join(words[(i + j) % len(words)] for j in range(60)) for i in range(8)]
    rows.write_text("".join(json.dumps({"text": t}) + "\n" for t in text))
    tune = [sys.executable, "-m", "spill", "tune", cmd[4], str(rows), "--name", "t", "--steps"]
    tune += ["2", "--batch", "4", "--micro-batch", "4", "--seq-len", "64", "--ring", "2"]
    tune += ["--targets", "all", "--state", str(tmp_path / "s"), "--memory", "96MiB"]
    r = ml.run_limited(tune, 96 * MIB + RUNTIME)
    assert r["rc"] == 0 and r["oom_kills"] == 0, r["output"]
    assert "memory 96 MiB (--memory)" in r["output"]
    assert r["peak_bytes"] <= 96 * MIB + RUNTIME


def test_a_build_inside_a_limit_finishes_with_each_stages_m_less_what_earlier_ones_left(
    cgroup_ok, tmp_path
):
    """The toy project's build with ``engine.memory`` inside a cgroup of M + RUNTIME: every
    stage finishes with nothing OOM-killed and the peak within the limit; each job's pre-run line
    gives M less what earlier stages left beyond RUNTIME's slack, where they left any (the first
    job never: nothing ran before it)."""
    from tests.func.test_build import copy_toy

    project = copy_toy(tmp_path / "toy")
    memory = 96 * MIB
    cmd = [sys.executable, "-m", "spill", "build", str(project), "--state", str(tmp_path / "s")]
    cmd += ["tune.steps=20", f"engine.memory={memory}"]
    r = ml.run_limited(cmd, memory + RUNTIME)
    assert r["rc"] == 0 and r["oom_kills"] == 0, r["output"]
    assert r["peak_bytes"] <= memory + RUNTIME
    lines = [
        line
        for line in r["output"].splitlines()
        if re.match(r"spill (eval|tune) · ", line) and " MiB (--memory" in line
    ]
    assert len(lines) == 3, r["output"]
    assert "memory 96 MiB (--memory)" in lines[0]
    for line in lines[1:]:
        held = r"(, less (\d+) MiB held from earlier stages)?"
        said = re.search(r"memory (\d+) MiB \(--memory" + held + r"\)", line)
        assert said and int(said[1]) == 96 - int(said[3] or 0), line
