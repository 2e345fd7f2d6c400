import numpy as np
import pytest
from safetensors.numpy import load_file, save

from spill.errors import ModelError
from spill.store.safetensors_io import (
    bf16_bits_to_float32,
    encode,
    float32_to_bf16_bits,
    read_header,
    write_file,
)


def test_bf16_rounding_matches_torch():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(0).normal(size=10_000).astype(np.float32)
    x[:4] = [0.0, -0.0, 1e-40, 3.0e38]
    ours = float32_to_bf16_bits(x)
    ref = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ours, ref)
    assert np.array_equal(
        bf16_bits_to_float32(ours), torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    )


def test_written_file_reads_back_with_safetensors(tmp_path):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    write_file(tmp_path / "x.safetensors", {"b": ("F32", a), "a": ("F32", a * 2)}, {"format": "pt"})
    back = load_file(tmp_path / "x.safetensors")
    assert np.array_equal(back["b"], a) and np.array_equal(back["a"], a * 2)
    header = read_header(tmp_path / "x.safetensors")
    assert header["__metadata__"] == {"format": "pt"} and list(header)[1:] == ["a", "b"]


def test_truncated_and_corrupt_files(tmp_path):
    p = tmp_path / "x.safetensors"
    write_file(p, {"a": ("F32", np.ones(100, dtype=np.float32))})
    raw = p.read_bytes()
    p.write_bytes(raw[:-10])
    with pytest.raises(ModelError, match="truncated"):
        read_header(p)
    p.write_bytes(raw[:5])
    with pytest.raises(ModelError, match="truncated"):
        read_header(p)
    p.write_bytes(b"\xff" * 64)
    with pytest.raises(ModelError, match="corrupt"):
        read_header(p)


def test_encode_lays_out_what_safetensors_writes_without_copying():
    rng = np.random.default_rng(0)
    tensors = {
        "b::x": rng.random((2, 3), dtype=np.float32),
        "a": np.ones(5, np.float32),
        "scalar": np.array(2.5, np.float32),
        "empty": np.zeros((0, 4), np.float32),
    }
    parts = encode({k: ("F32", a) for k, a in tensors.items()})
    assert b"".join(bytes(p) for p in parts) == save(dict(sorted(tensors.items())))
    # each tensor's buffer is the array's own memory
    assert all(
        np.shares_memory(np.frombuffer(p, np.float32), a)
        for p, a in zip(parts[1:], [tensors[k] for k in sorted(tensors)], strict=True)
        if a.size
    )
