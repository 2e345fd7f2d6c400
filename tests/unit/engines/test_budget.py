"""core.budget: where M comes from (--memory, else a cgroup limit below the RAM, else none),
the ring's share of it, and the one-line refusal naming the smallest M."""

from __future__ import annotations

import pytest

from spill.engines.base import LoadOptions, ModelSpec, TuneShape
from spill.engines.core import budget
from spill.engines.core.common import tune_bytes
from spill.errors import EngineError
from spill.models.config import load_config
from spill.models.lora import LoraConfig

MIB = 1 << 20


def test_memory_flag_wins_then_the_cgroup_then_nothing(monkeypatch):
    monkeypatch.setattr(budget, "memory_limit", lambda: 400 * MIB)
    monkeypatch.setattr(budget, "physical_memory", lambda: 24 << 30)
    assert budget.resolve(300 * MIB) == budget.Budget(300 * MIB, "--memory")
    found = budget.resolve(None)
    assert found.total == 400 * MIB - budget.RUNTIME
    assert found.words() == (
        f"memory {400 - budget.RUNTIME // MIB} MiB (cgroup limit 400 MiB less "
        f"{budget.RUNTIME // MIB} MiB for the runtime)"
    )
    monkeypatch.setattr(budget, "memory_limit", lambda: 32 << 30)  # above the RAM: no promise
    assert budget.resolve(None) == budget.Budget(None)
    assert budget.resolve(None).words() == ""
    monkeypatch.setattr(budget, "memory_limit", lambda: None)
    assert budget.resolve(None).total is None


def test_what_earlier_jobs_of_the_process_left_comes_out_of_m(monkeypatch):
    """A build's later stages: M less what the process holds above where it stood before its
    first job beyond RUNTIME's slack, said in the pre-run line; nothing carried, nothing said;
    no M, none taken."""
    monkeypatch.setattr(budget, "memory_limit", lambda: 700 * MIB)
    monkeypatch.setattr(budget, "physical_memory", lambda: 24 << 30)
    monkeypatch.setattr(budget, "_carried", 0)
    budget.carry(budget.SLACK)  # what RUNTIME's slack holds is not taken
    assert budget.resolve(300 * MIB) == budget.Budget(300 * MIB, "--memory")
    budget.carry(113 * MIB + budget.SLACK)
    assert budget.resolve(300 * MIB) == budget.Budget(
        187 * MIB, "--memory, less 113 MiB held from earlier stages"
    )
    assert budget.resolve(None).words() == (
        f"memory {700 - budget.RUNTIME // MIB - 113} MiB (cgroup limit 700 MiB less "
        f"{budget.RUNTIME // MIB} MiB for the runtime, less 113 MiB held from earlier stages)"
    )
    assert budget.resolve(50 * MIB).total == 0  # the line that refuses names what is left
    budget.carry(-5 * MIB)  # the process holds less than before its first job
    assert budget.resolve(300 * MIB) == budget.Budget(300 * MIB, "--memory")
    monkeypatch.setattr(budget, "memory_limit", lambda: None)
    budget.carry(113 * MIB + budget.SLACK)
    assert budget.resolve(None) == budget.Budget(None)


def test_the_process_says_its_anonymous_memory():
    """In bytes: 64 MiB of a fresh private anonymous mapping written shows (not the heap's: it may
    hold pages another test freed, resident already; other threads may add their own)."""
    import mmap

    from spill.ground.machine import anonymous_memory

    before = anonymous_memory()
    block = mmap.mmap(-1, 64 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # not shmem
    block.write(b"x" * (64 * MIB))  # every page
    after = anonymous_memory()
    block.close()
    assert before is not None and after - before >= 56 * MIB, (before, after)  # bytes, not kB


def test_the_ring_plans_from_what_the_resident_parts_leave():
    assert budget.ring_share(budget.Budget(300 * MIB, "--memory"), 108 * MIB) == 192 * MIB
    assert budget.ring_share(budget.Budget(100 * MIB, "--memory"), 108 * MIB) == 0
    assert budget.ring_share(budget.Budget(None), 108 * MIB) is None


def test_a_plan_past_the_budget_is_refused_naming_the_smallest():
    m = budget.Budget(100 * MIB, "--memory")
    budget.check_fits(m, 70 * MIB, 30 * MIB, 2)  # exactly fits
    with pytest.raises(EngineError) as e:
        budget.check_fits(m, 108 * MIB, 27 * MIB + 1, 2)
    assert str(e.value) == (
        "--memory 100 MiB cannot hold this model's resident parts (108 MiB: embeddings and "
        "head) and a ring of 2 layers (27 MiB); use --memory 136MiB or more (or --ring 1), with "
        f"a limit of {136 + budget.RUNTIME // MIB} MiB around the process"
    )
    budget.check_fits(budget.Budget(None), 10**12, 10**12, 2)  # no budget: nothing to refuse


def test_a_tunes_reserve_counts_and_is_named():
    m = budget.Budget(100 * MIB, "--memory")
    budget.check_fits(m, 50 * MIB, 30 * MIB, 2, 20 * MIB)  # exactly fits
    with pytest.raises(EngineError) as e:
        budget.check_fits(m, 50 * MIB, 30 * MIB, 2, 20 * MIB + 1)
    assert str(e.value) == (
        "--memory 100 MiB cannot hold this model's resident parts (50 MiB: embeddings and "
        "head), a ring of 2 layers (30 MiB) and a tune's state and least activations (20 MiB: "
        "recomputed); use --memory 101MiB or more (or --ring 1) or a smaller --micro-batch or "
        f"--seq-len, with a limit of {101 + budget.RUNTIME // MIB} MiB around the process"
    )


def test_the_opener_reserves_a_tune_before_the_ring(engine, tiny_models):
    """Under M a tune's state and least activations come out of M before the ring plans: the
    same M streams fewer slots for a tune than for a run, and M too small for the tune is
    refused naming it, where the same M still opens a run."""
    folder = tiny_models["llama"]
    cfg = load_config(folder)
    spec, shape = ModelSpec(folder, cfg), TuneShape(LoraConfig(rank=8), 4, 128)
    layer = cfg.layer_params() * 4
    resident = budget.resident_bytes(cfg, 4)
    need = tune_bytes(cfg, shape, 4)
    assert need > layer  # the run's room for its 4 layers is the tune's reserve
    opts = LoadOptions(dtype="float32", memory=resident + need + 3 * layer)
    run, tune = engine.open(spec, opts), engine.open(spec, opts, shape)
    try:
        assert run.info.resident and (tune.info.ring, tune.info.resident) == (3, False)
    finally:
        run.close(), tune.close()
    small = LoadOptions(dtype="float32", memory=resident + need + layer)
    with pytest.raises(EngineError, match="a tune's state and least activations"):
        engine.open(spec, small, shape)
    engine.open(spec, small).close()
