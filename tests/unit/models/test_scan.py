"""``spill.models.scan``: one pass gives the file's sha256 and the first float tensor holding
NaN or inf, whatever the chunks (an element split between two), for F32, F16 and BF16; other
dtypes, other files and an unparsable header are only hashed."""

import hashlib

import numpy as np
import pytest

from spill.models.scan import NotFinite, Scan, checked_sha256, scan_file
from spill.store.safetensors_io import float32_to_bf16_bits, write_file


def tensors(rng) -> dict:
    return {
        "a.weight": ("F32", rng.standard_normal((33, 17)).astype(np.float32)),
        "b.weight": ("F16", rng.standard_normal((101,)).astype(np.float16)),
        "c.weight": ("BF16", float32_to_bf16_bits(rng.standard_normal((7, 45)))),
        "d.index": ("I64", np.arange(9)),
    }


def fed(data: bytes, size: int, safetensors: bool = True) -> Scan:
    scan = Scan(safetensors)
    for i in range(0, len(data), size):
        scan.update(data[i : i + size])
    return scan


@pytest.mark.parametrize(
    "name, at, value",
    [
        ("a.weight", (32, 16), np.nan),
        ("a.weight", (0, 0), -np.inf),
        ("b.weight", (50,), np.inf),
        ("c.weight", (6, 44), np.nan),
        ("c.weight", (3, 0), np.inf),
    ],
)
def test_the_first_poisoned_tensor_is_named_whatever_the_chunks(tmp_path, name, at, value):
    t = tensors(np.random.default_rng(1))
    dtype, a = t[name]
    a = a.copy()
    if dtype == "BF16":
        a[at] = float32_to_bf16_bits(np.array([value], np.float32))[0]
    else:
        a[at] = value
    t[name] = (dtype, a)
    path = tmp_path / "m.safetensors"
    write_file(path, t)
    data = path.read_bytes()
    for size in (1, 3, 5, 7, 64, 1 << 22):
        scan = fed(data, size)
        assert scan.bad == name and scan.hexdigest() == hashlib.sha256(data).hexdigest(), size
    assert scan_file(path) == (hashlib.sha256(data).hexdigest(), name)
    with pytest.raises(NotFinite, match=f"{path}: {name} holds NaN or inf"):
        checked_sha256(path)


def test_finite_files_other_dtypes_and_other_files_pass(tmp_path):
    path = tmp_path / "m.safetensors"
    write_file(path, tensors(np.random.default_rng(2)) | {"e": ("I32", np.full(4, -1, np.int32))})
    data = path.read_bytes()
    for size in (1, 3, 5, 7, 1 << 22):
        assert fed(data, size).bad is None, size
    assert checked_sha256(path) == hashlib.sha256(data).hexdigest()
    # the same bytes under another name are not read as tensors; a damaged header only hashed
    other = tmp_path / "m.bin"
    other.write_bytes(np.full(64, np.nan, np.float32).tobytes())
    assert scan_file(other)[1] is None
    damaged = tmp_path / "d.safetensors"
    damaged.write_bytes((8).to_bytes(8, "little") + b"{not json" + b"\xff" * 64)
    assert scan_file(damaged) == (hashlib.sha256(damaged.read_bytes()).hexdigest(), None)
    huge = tmp_path / "h.safetensors"
    huge.write_bytes((1 << 40).to_bytes(8, "little") + b"\0" * 16)
    assert scan_file(huge)[1] is None


def test_a_float_weight_beside_its_own_scales_is_left_to_the_readers(tmp_path):
    """Packed words stored as F32 read as NaN: the readers refuse that form by name, so the
    scan does not call it damaged; the scales beside it are scanned."""
    words = np.full((4, 2), 0xFFFFFFFF, np.uint32).view(np.float32)
    t = {"m.weight": ("F32", words), "m.scales": ("F16", np.ones((4, 1), np.float16))}
    path = tmp_path / "m.safetensors"
    write_file(path, t)
    assert scan_file(path)[1] is None
    t["m.scales"] = ("F16", np.full((4, 1), np.inf, np.float16))
    write_file(path, t)
    assert scan_file(path)[1] == "m.scales"
