"""The torch engine's dequantizer equals spill's numpy one bit for bit, in chunks or whole."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from spill.engines.torch import quant as tq  # noqa: E402
from spill.models import quant  # noqa: E402


@pytest.mark.parametrize("bits", quant.BITS)
@pytest.mark.parametrize("group", quant.READ_GROUP_SIZES)
def test_dequantize_into_equals_numpy(bits, group, monkeypatch):
    rng = np.random.default_rng(bits * group)
    q = rng.integers(0, 1 << bits, (37, 256), dtype=np.uint8)
    q[0] = (1 << bits) - 1  # top bits set: the int32 shift is arithmetic, the mask must fix it
    s = rng.standard_normal((37, 256 // group)).astype(np.float32)
    b = rng.standard_normal((37, 256 // group)).astype(np.float32)
    packed = quant.pack(q, bits)
    want = quant.dequantize(packed, s, b, bits, group)
    monkeypatch.setattr(tq, "CHUNK_VALUES", 256 * 5)  # five rows a chunk: the chunking is exercised
    weight = torch.from_numpy(packed.view(np.int32))
    out = torch.empty((37, 256), dtype=torch.float32)
    got = tq.dequantize_into(out, weight, torch.from_numpy(s), torch.from_numpy(b), bits, group)
    assert np.array_equal(got.numpy().view(np.uint32), want.view(np.uint32))
    half = torch.empty((37, 256), dtype=torch.bfloat16)
    tq.dequantize_into(
        half, weight, torch.from_numpy(s).half(), torch.from_numpy(b).half(), bits, group
    )
    ref = quant.dequantize(packed, s.astype(np.float16), b.astype(np.float16), bits, group)
    assert torch.equal(half, torch.from_numpy(ref).to(torch.bfloat16))
