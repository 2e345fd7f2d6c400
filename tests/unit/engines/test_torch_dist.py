"""Where torch's exchange sends a job's gradients: NCCL on the rank's own GPU only when every rank
computes there (one agreement per job device), host memory over gloo otherwise. The agreement
is a collective; here it is a world of one (``any_of`` returns this rank's flag). The NCCL
exchange itself needs two GPUs: tests/func/test_procs.py, marked ``cuda``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("spill.engines.torch.dist")


@pytest.fixture
def alone(monkeypatch):
    """A world of one; ``gpu`` set gives the rank cuda:0 as its own (no GPU needed to ask)."""
    monkeypatch.setattr(dist, "any_of", lambda flag: flag)
    monkeypatch.setattr(dist, "_agreed", {})

    def gpu(index: int | None) -> None:
        monkeypatch.setattr(dist, "_gpu", None if index is None else torch.device("cuda", index))

    return gpu


@pytest.mark.parametrize(
    ("device", "want"),
    [("cuda", True), ("cuda:0", True), ("cuda:1", False), ("cpu", False), ("gpu", False)],
)
def test_a_rank_with_its_own_gpu_exchanges_there_when_it_computes_there(alone, device, want):
    alone(0)
    assert dist._on_gpus(device) is want  # "gpu": MLX's name, never torch's NCCL


def test_a_rank_without_a_gpu_exchanges_in_host_memory(alone):
    alone(None)
    assert dist._on_gpus("cuda") is False


def test_the_agreement_is_asked_once_per_device(alone, monkeypatch):
    asked = []
    monkeypatch.setattr(dist, "any_of", lambda flag: asked.append(flag) or flag)
    alone(0)
    for _ in range(3):
        assert dist._on_gpus("cuda") is True
    assert asked == [False]  # "is any rank not on its GPU?" once
