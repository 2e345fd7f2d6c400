"""``--packed-matmul``: torch's int4 kernel on 4-bit layers. The repacked layout is torch's own
conversion byte for byte, the kernel computes the affine values (within bfloat16's rounding),
the kernel's file is made once, checked by its stat and made again when its bytes change, and
streamed, held-slot and resident runs give the same bits (``torch.equal``), numerics named
``bfloat16+int4mm``."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from spill.engines.base import GenerateParams  # noqa: E402
from spill.engines.torch import ENGINE, int4, int4_file  # noqa: E402
from spill.engines.torch.quant import Packed, dequantize  # noqa: E402
from spill.errors import EngineError  # noqa: E402
from spill.models.config import load_config  # noqa: E402
from spill.models.resolve import quantize_model  # noqa: E402
from spill.models.weights import quantized_weights, weight_files  # noqa: E402
from tests.unit.engines.kit import open_runner  # noqa: E402

PROMPTS = [np.arange(3, 12, dtype=np.int64), np.arange(40, 45, dtype=np.int64)]
COMPLETIONS = [np.arange(7, 10, dtype=np.int64)] * 2


def _packed(rows: int, cols: int, group: int, seed: int = 0) -> tuple[Packed, torch.Tensor]:
    """A random 4-bit matrix as spill stores it, and its values (int32, (rows, cols))."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.int64)
    words = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for n in range(8):  # element k of a word in bits 4k..4k+3, low bits first
        words |= q[:, n::8] << (4 * n)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    scales = torch.rand(rows, cols // group, generator=gen) * 0.02
    biases = (torch.rand(rows, cols // group, generator=gen) - 0.5) * 0.2
    return Packed(words, scales, biases, 4, group, words.view(torch.uint8)), q.to(torch.int32)


@pytest.mark.parametrize("rows,cols,group", [(64, 64, 32), (128, 256, 64), (192, 512, 128)])
def test_repack_is_torchs_own_conversion(rows, cols, group):
    p, q = _packed(rows, cols, group)
    w = int4.repack(p)
    assert torch.equal(w.packed, torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
    assert w.scale_zero.shape == (cols // group, rows, 2)


def test_the_kernel_computes_the_affine_values():
    p, _ = _packed(128, 256, 32, seed=1)
    x = torch.randn(3, 5, 256, generator=torch.Generator().manual_seed(2))
    float32 = x @ dequantize(p, torch.empty(p.shape)).T  # the dequantized path
    got = int4.linear(x.bfloat16(), int4.repack(p)).float()  # (3, 5, 128)
    assert got.shape == float32.shape
    assert float((got - float32).norm() / float32.norm()) < 1e-2  # bf16 scales and activations


def test_what_the_kernel_takes():
    assert int4.accepts(4, 64, (128, 256))
    assert not int4.accepts(8, 64, (128, 256))  # 8-bit: dequantized
    assert not int4.accepts(4, 64, (96, 256))  # output rows not in blocks of 64
    assert not int4.accepts(4, 16, (128, 256))  # GGUF Q6_K's groups of 16


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    home = tmp_path_factory.mktemp("int4-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPILL_HOME", str(home))
        mp.setenv("SPILL_MACHINE_CACHE", str(home / "machine"))
        # hidden 128: every linear's output rows come in blocks of 64
        yield quantize_model("tiny:llama:3:2x128", 4, 32, progress=lambda _: None)


def _kernel_file(folder, notes: list[str]):
    cfg, files = load_config(folder), weight_files(folder)
    fp = "sha256:" + "ab" * 32
    derived = int4_file.ensure(cfg, files, quantized_weights(cfg, files), fp, notes.append)
    return derived.folder / int4_file.FILE


def test_the_kernel_file_holds_every_module_repacked(folder):
    from spill.engines.torch.reader import WeightReader

    notes: list[str] = []
    path = _kernel_file(folder, notes)
    assert len(notes) == 1 and "int4 kernel's layout" in notes[0]
    cfg, files = load_config(folder), weight_files(folder)
    quantized = quantized_weights(cfg, files)
    names = int4_file.accepted(cfg, files, quantized)
    assert len(names) == 7 * cfg.num_hidden_layers  # every linear of every layer
    source = WeightReader(files, torch.device("cpu"), torch.bfloat16, quantized)
    kernel = WeightReader(
        files, torch.device("cpu"), torch.bfloat16, quantized, weight_files(path.parent)
    )
    try:
        stored, read = source.tensors(names), kernel.tensors(names)
        for n in names:
            want = int4.repack(stored[n])
            assert torch.equal(read[n].packed, want.packed), n
            assert torch.equal(read[n].scale_zero, want.scale_zero), n
    finally:
        source.close()
        kernel.close()


def test_the_kernel_file_is_made_once_and_again_when_its_bytes_change(folder):
    notes: list[str] = []
    path = _kernel_file(folder, notes)
    before = path.read_bytes()
    assert _kernel_file(folder, notes) == path and len(notes) <= 1  # made by now, not again
    os.utime(path)  # touched, same bytes: hashed again, kept
    assert _kernel_file(folder, notes) == path and len(notes) <= 1
    record = json.loads((path.parent / int4_file.RECORD).read_text())
    assert record["stat"][1] == os.stat(path).st_mtime_ns
    data = bytearray(before)
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))  # a changed byte: made again
    _kernel_file(folder, notes)
    assert "int4 kernel's layout" in notes[-1]
    assert path.read_bytes() == before


def test_streamed_held_and_resident_give_the_same_bits(folder):
    cfg = load_config(folder)
    got = {}
    for name, opts in {"resident": {"resident": True}, "ring 2": {"ring": 2}}.items():
        runner = open_runner(ENGINE, folder, packed_matmul=True, **opts)
        try:
            assert runner.info.numerics == "bfloat16+int4mm"
            assert "int4 matmul" in runner.info.line(), runner.info.line()
            scores = runner.score(PROMPTS, COMPLETIONS)
            gens = runner.generate(PROMPTS, GenerateParams(6), [0, 1])
        finally:
            runner.close()
        got[name] = (
            [s.view(np.uint32).tolist() for s in scores],
            [g.tokens.tolist() for g in gens],
        )
    assert got["ring 2"] == got["resident"]
    assert cfg.num_hidden_layers == 2


def test_a_streamed_pass_counts_the_kernel_files_bytes(folder):
    """A pass over a streamed model reads its layers once, from the kernel's file where that holds
    them: the reader's count (a benchmark's bytes a token) takes that file's reads too."""
    read = {}
    for kernel in (False, True):
        runner = open_runner(ENGINE, folder, ring=2, packed_matmul=kernel, dtype="bfloat16")
        try:
            before = runner.model.kernel.reader.bytes_read
            runner.score(PROMPTS[:1], COMPLETIONS[:1])
            read[kernel] = runner.model.kernel.reader.bytes_read - before
        finally:
            runner.close()
    # the same packed words either way; the kernel's scales and zeros are bfloat16 as stored
    assert read[True] == pytest.approx(read[False], rel=0.05), read


def test_it_computes_near_the_dequantized_path(folder):
    runs = {}
    for kernel in (False, True):
        runner = open_runner(
            ENGINE, folder, packed_matmul=kernel, dtype=None if kernel else "bfloat16"
        )
        try:
            runs[kernel] = np.concatenate(runner.score(PROMPTS, COMPLETIONS))
        finally:
            runner.close()
    # log-probs of a random model (-7 to -27 here), bf16 either way: within 5 % of each other
    assert np.allclose(runs[True], runs[False], rtol=0.05, atol=0), runs


def test_float32_is_refused_and_a_float_model_is_told(folder, tiny_models):
    with pytest.raises(EngineError, match="--packed-matmul computes in bfloat16"):
        open_runner(ENGINE, folder, packed_matmul=True, dtype="float32")
    runner = open_runner(ENGINE, tiny_models["llama"], packed_matmul=True, dtype="float32")
    try:
        assert runner.info.numerics == "float32"  # a float model: nothing changes
    finally:
        runner.close()
