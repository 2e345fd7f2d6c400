"""core.budget: where M comes from (--memory, else a cgroup limit below the RAM, else none),
the ring's share of it, and the one-line refusal naming the smallest M."""

from __future__ import annotations

import pytest

from spill.engines.core import budget
from spill.errors import EngineError

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
