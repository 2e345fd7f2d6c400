"""Engine tests run torch on one thread: tiny models are all overhead, and on a shared 2-core
machine OpenMP's barriers between two threads cost 10-50x on matrices this small."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
