"""The torch ring on a quantized base: slots hold the packed bytes and are sized by them, the
residency policy (float resident if it fits, else packed held, else packed streamed) says which
in the pre-run line, and every mode computes the float folder's bits in float32: log-probs,
greedy tokens and a few tune steps' adapters and optimizer state (``torch.equal``-exact)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from spill.engines.base import GenerateParams, LoadOptions  # noqa: E402
from spill.engines.core import ring as ring_module  # noqa: E402
from spill.engines.core.budget import resident_bytes  # noqa: E402
from spill.engines.core.common import RingPlan, plan_model_ring  # noqa: E402
from spill.engines.torch import ENGINE  # noqa: E402
from spill.engines.torch.quant import Packed  # noqa: E402
from spill.models.config import load_config  # noqa: E402
from spill.models.lora import ALL_LINEAR, LoraConfig  # noqa: E402
from spill.models.resolve import quantize_model  # noqa: E402
from spill.models.sources.quantize import dequantize_folder  # noqa: E402
from spill.models.weights import layer_bytes, weight_files  # noqa: E402
from tests.unit.engines.kit import equal_states, fresh, open_runner, tune  # noqa: E402

PROMPTS = [np.arange(3, 12, dtype=np.int64), np.arange(40, 45, dtype=np.int64)]
COMPLETIONS = [np.arange(7, 10, dtype=np.int64)] * 2


def test_plan_prefers_float_resident_then_held_then_packed_slots(tiny_models):
    cfg = load_config(tiny_models["llama"])  # 4 layers
    f = cfg.layer_params() * 4
    p = f // 6

    def plan(**kw) -> RingPlan:
        return plan_model_ring(cfg, 4, LoadOptions(**kw), pytest.fail, p)

    assert plan(memory=4 * f) == RingPlan(4, True, False, p, f)  # the float form fits
    assert plan(memory=4 * p + 2 * f) == RingPlan(4, False, True, p, f)  # the packed form fits
    assert plan(memory=3 * p + 2 * f) == RingPlan(3, False, False, p, f)  # slots of packed bytes
    assert plan(memory=1).slots == 2
    assert plan(memory=4 * f, ring=2) == RingPlan(2, False, False, p, f)
    assert plan(memory=1, resident=True) == RingPlan(4, False, True, p, f)
    assert plan(memory=3 * p + 2 * f).layer_memory() == 3 * p + 2 * f
    assert plan(memory=4 * f).layer_memory() == 4 * f
    # a float model (or an engine that computes on packed weights) plans as before
    assert plan_model_ring(cfg, 4, LoadOptions(memory=3 * f + 1), pytest.fail) == RingPlan(
        3, False, False, f, 0
    )


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    home = tmp_path_factory.mktemp("packed-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPILL_HOME", str(home))
        mp.setenv("SPILL_MACHINE_CACHE", str(home / "machine"))
        packed = quantize_model("tiny:llama:3", 4, 32, progress=lambda _: None)
        plain = dequantize_folder(packed, home / "plain")
    return packed, plain


def test_a_slot_holds_the_packed_layer_and_is_sized_by_it(folders):
    packed, plain = folders
    cfg = load_config(packed)
    slot = layer_bytes(cfg, weight_files(packed), 4)
    assert layer_bytes(cfg, weight_files(plain), 4) == cfg.layer_params() * 4
    assert 4 * slot < cfg.layer_params() * 4  # 4-bit g32 with float32 scales: ~4.3x smaller
    runner = open_runner(ENGINE, packed, dtype="float32", ring=2)
    try:
        w = runner.model.ring._load_fn(0)  # what the loader puts in a slot
        linears = [k for k in cfg.layer_keys() if k.endswith("proj.weight")]
        assert all(isinstance(w[k], Packed) for k in linears)
        assert w["input_layernorm.weight"].dtype == torch.float32
        assert runner.layer_memory == 2 * slot + 2 * cfg.layer_params() * 4
    finally:
        runner.close()


def _modes(packed, plain):
    cfg = load_config(packed)
    f, p = cfg.layer_params() * 4, layer_bytes(cfg, weight_files(packed), 4)
    layers, head = cfg.num_hidden_layers, resident_bytes(cfg, 4)  # --memory holds the head too
    return [
        ("float folder", plain, {"resident": True}, "resident"),
        ("float resident", packed, {"memory": head + layers * f}, "dequantized to float32 at load"),
        ("held", packed, {"memory": head + layers * p + 2 * f}, "held packed"),
        ("ring 2", packed, {"ring": 2}, "streaming, ring 2 of"),
        ("slots", packed, {"memory": head + 3 * p + 2 * f}, "streaming, ring 3 of"),
    ]


def test_every_mode_scores_and_generates_the_float_folders_bits(folders):
    got = {}
    for name, folder, opts, words in _modes(*folders):
        runner = open_runner(ENGINE, folder, dtype="float32", **opts)
        try:
            assert words in runner.info.line(), runner.info.line()
            scores = runner.score(PROMPTS, COMPLETIONS)
            gens = runner.generate(PROMPTS, GenerateParams(6), [0, 1])
        finally:
            runner.close()
        got[name] = (
            [s.view(np.uint32).tolist() for s in scores],
            [g.tokens.tolist() for g in gens],
        )
    assert all(v == got["float folder"] for v in got.values()), got


def test_every_mode_tunes_the_float_folders_adapters(folders):
    cfg = load_config(folders[0])
    lora = LoraConfig(rank=4, alpha=8, dropout=0.1, targets=ALL_LINEAR)
    states, losses = {}, {}
    for name, folder, opts, _ in _modes(*folders):
        runner = open_runner(ENGINE, folder, dtype="float32", **opts)
        try:
            trainer = fresh(runner, cfg, lora)
            losses[name] = tune(trainer, 3)
            states[name] = trainer.state()
        finally:
            runner.close()
    assert all(v == losses["float folder"] for v in losses.values()), losses
    assert all(equal_states(s, states["float folder"]) for s in states.values())


def test_dequantizing_on_the_computing_thread_gives_the_same_bits(folders, monkeypatch):
    packed, _ = folders
    got = []
    for ahead in (True, False):
        monkeypatch.setattr(ring_module, "EXPAND_AHEAD", ahead)
        runner = open_runner(ENGINE, packed, dtype="float32", ring=2)
        try:
            (scores, _) = runner.score(PROMPTS, COMPLETIONS)
            got.append(scores.view(np.uint32).tolist())
            assert runner.model.ring.max_live <= 2
        finally:
            runner.close()
    assert got[0] == got[1]
