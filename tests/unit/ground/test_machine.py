"""The per-machine measurement cache: measured once, and a damaged cache is measured again."""

from __future__ import annotations

import json

import pytest

from spill.ground.machine import cached_measurement
from spill.ground.paths import machine_cache

GOOD = {"shape": [64, 1024, 1024], "float32_s": 0.002, "bfloat16_s": 0.2, "ratio": 100.0}


def counted(result=GOOD):
    calls = []

    def measure():
        calls.append(1)
        return dict(result)

    return measure, calls


def test_measured_once_then_read():
    measure, calls = counted()
    assert cached_measurement("m.json", "cpu a", measure) == GOOD
    assert cached_measurement("m.json", "cpu a", measure) == GOOD
    assert len(calls) == 1
    assert json.loads((machine_cache() / "m.json").read_text()) == {"cpu a": GOOD}


@pytest.mark.parametrize(
    "damage",
    [
        b"{",
        b"\xff\xfe",
        b"[]",
        json.dumps({"cpu a": {**GOOD, "ratio": "fast"}}).encode(),
        json.dumps({"cpu a": {**GOOD, "ratio": 0}}).encode(),
        json.dumps({"cpu a": {k: v for k, v in GOOD.items() if k != "ratio"}}).encode(),
        json.dumps({"cpu a": 42}).encode(),
    ],
    ids=["truncated", "not-utf8", "a-list", "wrong-type", "zero", "missing-key", "not-object"],
)
def test_a_damaged_cache_is_measured_again_and_replaced(damage):
    path = machine_cache() / "m.json"
    path.parent.mkdir(parents=True)
    path.write_bytes(damage)
    measure, calls = counted()
    assert cached_measurement("m.json", "cpu a", measure) == GOOD
    assert len(calls) == 1
    assert json.loads(path.read_text()) == {"cpu a": GOOD}


def test_a_bad_measurement_is_not_cached():
    measure, _ = counted({"ratio": "nan"})
    with pytest.raises(Exception, match="machine schema"):
        cached_measurement("m.json", "cpu a", measure)
    assert not (machine_cache() / "m.json").exists()


def test_an_unwritable_cache_still_answers(spill_home, monkeypatch):
    (spill_home / "blocked").write_text("a file where the cache folder would be")
    monkeypatch.setenv("SPILL_MACHINE_CACHE", str(spill_home / "blocked" / "machine"))
    measure, calls = counted()
    assert cached_measurement("m.json", "cpu a", measure) == GOOD
    assert cached_measurement("m.json", "cpu a", measure) == GOOD
    assert len(calls) == 2


def test_every_home_on_a_machine_shares_one_cache(tmp_path, monkeypatch):
    """The cache is the machine's (the user's cache folder), not a SPILL_HOME's: a fresh home
    reads what another home measured, so both compute in the same numerics."""
    monkeypatch.delenv("SPILL_MACHINE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    measure, calls = counted()
    for home in ("a", "b"):
        monkeypatch.setenv("SPILL_HOME", str(tmp_path / home))
        assert cached_measurement("m.json", "cpu a", measure) == GOOD
    assert len(calls) == 1 and (tmp_path / "xdg" / "spill" / "machine" / "m.json").is_file()


def test_the_key_names_the_cpu_and_its_flags():
    from spill.ground.machine import cpu_flags, cpu_key, cpu_model

    key = cpu_key()
    assert key.startswith(cpu_model() + " | flags ") and len(key.rsplit(" ", 1)[1]) == 12
    if cpu_flags():  # Linux: the kernel lists them
        assert cpu_flags() == " ".join(sorted(cpu_flags().split()))


def _cgroups(tmp_path, lines: str, files: dict[str, str]):
    tmp_path.mkdir()
    proc = tmp_path / "cgroup"
    proc.write_text(lines)
    for rel, text in files.items():
        (tmp_path / "fs" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "fs" / rel).write_text(text)
    return str(proc), str(tmp_path / "fs")


def test_memory_limit_reads_v1_and_v2_and_the_smallest_on_the_path(tmp_path):
    from spill.ground.machine import memory_limit

    proc, root = _cgroups(
        tmp_path / "v1",
        "5:cpu:/\n4:memory:/slurm/job7\n",
        {
            "memory/memory.limit_in_bytes": "9223372036854771712\n",  # v1's "no limit"
            "memory/slurm/memory.limit_in_bytes": "8589934592\n",
            "memory/slurm/job7/memory.limit_in_bytes": "419430400\n",
        },
    )
    assert memory_limit(proc, root) == 400 << 20
    proc, root = _cgroups(
        tmp_path / "v2",
        "0::/box/app\n",
        {"box/memory.max": "1073741824\n", "box/app/memory.max": "max\n"},
    )
    assert memory_limit(proc, root) == 1 << 30  # the parent's limit binds the child
    proc, root = _cgroups(tmp_path / "none", "0::/\n", {"memory.max": "max\n"})
    assert memory_limit(proc, root) is None
    assert memory_limit(str(tmp_path / "missing"), root) is None
