"""Engine tests run torch on one thread: tiny models are all overhead, and on a shared 2-core
machine OpenMP's barriers between two threads cost 10-50x on matrices this small. The core's
tests (the ring) never import torch, so this fixture does not either. ``engine`` runs a test
on every engine, skipping (and saying why) one that is not installed."""

from __future__ import annotations

import sys

import pytest

from tests.unit.engines.kit import ENGINES, load_engine


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    torch = sys.modules.get("torch")
    if torch is None:  # a torch-free module: nothing to set
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=ENGINES)
def engine(request):
    return load_engine(request.param)
