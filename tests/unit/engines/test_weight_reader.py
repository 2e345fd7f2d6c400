"""The ring's reader: pread into torch-owned (recycled) memory, or a mapped view, equals safetensors' own loading."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from spill.engines.torch.reader import MAPPED, WeightReader
from spill.models.weights import weight_files
from spill.store.safetensors_io import float32_to_bf16_bits, write_file


@pytest.fixture
def mixed(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "a.bf16": ("BF16", float32_to_bf16_bits(rng.normal(size=(7, 5)).astype(np.float32))),
        "b.f32": ("F32", rng.normal(size=(3, 11)).astype(np.float32)),
        "c.f16": ("F16", rng.normal(size=(13,)).astype(np.float16)),
        "d.bf16": ("BF16", float32_to_bf16_bits(rng.normal(size=(4, 4)).astype(np.float32))),
    }
    write_file(tmp_path / "model.safetensors", tensors)
    return tmp_path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reads_equal_safetensors(mixed, dtype):
    ref = load_file(mixed / "model.safetensors")
    reader = WeightReader(weight_files(mixed), torch.device("cpu"), dtype)
    for _ in range(3):  # later rounds take recycled tensors
        got = reader.tensors(list(ref))
        for name, t in ref.items():
            assert got[name].dtype == dtype
            assert torch.equal(got[name], t.to(dtype)), name
        reader.recycle(list(got.values()))
    reader.close()


def test_recycled_memory_is_reused_and_never_aliases(mixed):
    reader = WeightReader(weight_files(mixed), torch.device("cpu"), torch.bfloat16)
    first = reader.tensors(["a.bf16", "d.bf16"])
    ptr = first["a.bf16"].data_ptr()
    kept = first["d.bf16"].clone()
    reader.recycle([first["a.bf16"]])
    second = reader.tensors(["a.bf16", "d.bf16"])
    assert second["a.bf16"].data_ptr() == ptr  # recycled, not freshly allocated
    assert second["d.bf16"].data_ptr() != first["d.bf16"].data_ptr()  # d was not given back
    assert torch.equal(first["d.bf16"], kept)  # an unreleased tensor is never overwritten
    reader.close()


def test_a_mapped_load_views_the_file_and_is_never_pooled(mixed):
    """Within ``mapping()`` (a streamed CPU layer), tensors in the compute dtype are views of the
    page cache: equal to safetensors' loading, never handed out again by the pool; converted
    tensors still come from owned, recycled memory."""
    ref = load_file(mixed / "model.safetensors")
    reader = WeightReader(weight_files(mixed), torch.device("cpu"), torch.bfloat16)
    with reader.mapping():  # file order b.f32 a.bf16 c.f16 d.bf16: a and d are ranges of bf16
        got = reader.tensors(["a.bf16", "d.bf16"]) | reader.tensors(["b.f32", "c.f16"])
    for name, t in ref.items():
        assert torch.equal(got[name], t.to(torch.bfloat16)), name
    mapped = {n for n, t in got.items() if getattr(t, MAPPED, False)}
    assert mapped == {"a.bf16", "d.bf16"}  # the bf16 ones; f32 and f16 were converted
    reader.recycle(list(got.values()))
    again = reader.tensors(list(ref))  # not mapping: owned memory, some from the pool
    ptrs = {got[n].data_ptr() for n in mapped}
    assert not any(t.data_ptr() in ptrs for t in again.values())
    assert not any(getattr(t, MAPPED, False) for t in again.values())
    reader.close()


def test_a_budget_drops_each_run_of_read_bytes_it_joins(mixed, monkeypatch):
    """Under a budget each read drops the cached pages of the whole run of bytes read that it
    joins (touching runs merge), kept as sorted runs however many disjoint reads came before."""
    from spill.engines.core import reader as core_reader

    dropped = []
    monkeypatch.setattr(
        core_reader.os, "posix_fadvise", lambda fd, lo, n, advice: dropped.append((lo, lo + n))
    )
    shards = core_reader.ShardFiles(weight_files(mixed))
    shards.drop = True
    for lo, hi in [(0, 10), (20, 30), (50, 60), (10, 20), (35, 40), (30, 35), (70, 80), (5, 75)]:
        shards._forget(3, lo, hi - lo)
    assert dropped == [
        (0, 10), (20, 30), (50, 60), (0, 30), (35, 40), (0, 40), (70, 80), (0, 80),
    ]  # fmt: skip
    assert shards._runs[3] == ([0], [80])
    shards.close()
