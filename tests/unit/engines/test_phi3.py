"""Phi-3 / Phi-4-mini's own facts (issue 37), beside the family tests of ``test_families``:
config.json read as Phi3Config derives it (longrope's original length from the top level, the
attention factor from max / original, the legacy "su" name, partial rotary from either place),
the rotary tables equal to transformers' Phi3RotaryEmbedding (torch bit for bit, MLX within an
ulp of its cos/sin) below and past the original length (transformers picks the factors per forward from its longest position; spill
too), and the LoRA targets a Phi-3 has: its fused linears, by PEFT's names."""

from __future__ import annotations

import math

import numpy as np
import pytest

from spill.engines.core.common import long_rope
from spill.errors import ModelError, SpillError, UnsupportedModel
from spill.models.config import FUSED, LINEARS, parse_config
from spill.models.lora import KNOWN, LoraConfig
from tests.unit.engines.hf_families import LONGROPE

torch = pytest.importorskip("torch")


def raw(**keys) -> dict:
    base = {
        "model_type": "phi3",
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 112,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "original_max_position_embeddings": 16,
        "partial_rotary_factor": 0.5,
        "rope_scaling": {"type": "longrope", **LONGROPE},
    }
    return base | keys


def test_config_json_is_read_as_phi3config_derives_it():
    transformers = pytest.importorskip("transformers")
    for keys in (
        {},
        {"rope_scaling": {"type": "su", **LONGROPE}},  # the early Phi-3 configs' name
        {"rope_scaling": {"type": "longrope", "attention_factor": 1.25, **LONGROPE}},
        {"rope_scaling": None, "rope_parameters": {"rope_type": "longrope", **LONGROPE}},
    ):
        ours = parse_config(raw(**keys))
        theirs = transformers.Phi3Config(**raw(**keys))
        rotary = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(theirs)
        assert ours.linears == FUSED and ours.rotary_dim == 8
        assert ours.rope_original == theirs.rope_parameters["original_max_position_embeddings"]
        assert ours.rope_attention == rotary.attention_scaling
    plain = parse_config(raw(rope_scaling=None, partial_rotary_factor=0.75))
    assert (plain.rope_short, plain.rotary_dim, plain.rope_attention) == ((), 12, 1.0)
    # no factor given: max / original (256 / 16), as transformers computes the attention factor
    assert parse_config(raw()).rope_attention == math.sqrt(1 + math.log(16) / math.log(16))


@pytest.mark.parametrize(
    "keys, error, words",
    [
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, UnsupportedModel, "'dynamic'"),
        ({"hidden_act": "gelu"}, UnsupportedModel, "hidden_act 'gelu'"),
        (
            {"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}},
            ModelError,
            "longrope lists 1 short and 1 long factors for 4",
        ),
    ],
)
def test_what_spill_does_not_run_is_refused_in_one_line(keys, error, words):
    with pytest.raises(error) as got:
        parse_config(raw(**keys))
    assert words in str(got.value) and "\n" not in str(got.value)


@pytest.mark.parametrize("engine", ["torch", pytest.param("mlx", marks=pytest.mark.mlx)])
@pytest.mark.parametrize("length", [10, 16, 17, 40])
def test_rotary_tables_equal_transformers_below_and_past_the_original_length(engine, length):
    """The tables a forward of ``length`` tokens turns by: transformers' short factors up to 16
    positions, its long ones past them, times the attention factor, bit for bit."""
    transformers = pytest.importorskip("transformers")
    theirs = transformers.Phi3Config(**raw())
    rotary = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(theirs)
    positions = torch.arange(length)[None]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    cfg = parse_config(raw())
    valid = np.ones((1, length), dtype=bool)
    assert long_rope(cfg, valid, 0, length) == (length > 16)
    if engine == "torch":
        from spill.engines.torch.ops import context, inv_freq

        freq = inv_freq(cfg, long=long_rope(cfg, valid, 0, length))
        ctx = context(
            torch.from_numpy(valid), 0, length, freq, torch.float32, scale=cfg.rope_attention
        )
        ours = ctx.cos.numpy(), ctx.sin.numpy()
    else:
        mx = pytest.importorskip("mlx.core")
        from spill.engines.mlx.ops import context, inv_freq

        freq = inv_freq(cfg, long=long_rope(cfg, valid, 0, length))
        ctx = context(mx.array(valid), 0, length, freq, mx.float32, scale=cfg.rope_attention)
        ours = np.array(ctx.cos), np.array(ctx.sin)
        from spill.engines.torch.ops import inv_freq as torch_freq

        long = long_rope(cfg, valid, 0, length)  # the frequencies are torch's, bit for bit
        assert np.array_equal(np.array(freq), torch_freq(cfg, long=long).numpy())
        # MLX's cos and sin round apart from torch's by an ulp (as on every family)
        assert np.allclose(ours[0], cos.numpy(), rtol=0, atol=3e-7)
        assert np.allclose(ours[1], sin.numpy(), rtol=0, atol=3e-7)
        return
    assert np.array_equal(ours[0], cos.numpy()) and np.array_equal(ours[1], sin.numpy())


def test_the_long_factors_turn_a_forward_whose_longest_position_passes_the_original():
    """Positions count valid tokens: a left-padded row of 16 tokens stays short; a decode step
    at position 16 (the 17th token) turns long, as transformers' per-forward choice does."""
    cfg = parse_config(raw())
    padded = np.array([[0, 0, 0, 0] + [1] * 16], dtype=bool)
    assert not long_rope(cfg, padded, 0, 20)
    grown = np.concatenate([padded, np.ones((1, 1), dtype=bool)], axis=1)
    assert long_rope(cfg, grown, 20, 1)
    assert not long_rope(parse_config(raw(rope_scaling=None)), grown, 0, 21)  # no longrope


def test_lora_targets_are_the_models_own_linears():
    assert LoraConfig.parse_targets("all", FUSED) == (
        "qkv_proj",
        "o_proj",
        "gate_up_proj",
        "down_proj",
    )
    assert LoraConfig.parse_targets("down_proj, qkv_proj", FUSED) == ("qkv_proj", "down_proj")
    assert LoraConfig.parse_targets("all", LINEARS)[0] == "q_proj"
    with pytest.raises(SpillError) as got:
        LoraConfig.parse_targets("q_proj,v_proj", FUSED, "phi3")
    assert str(got.value) == (
        "unknown LoRA target(s) of a phi3 model ['q_proj', 'v_proj']; choose from qkv_proj, "
        "o_proj, gate_up_proj, down_proj or 'all'"
    )
    with pytest.raises(SpillError, match="unknown LoRA target"):
        LoraConfig.parse_targets("qkv_proj", LINEARS, "llama")
    assert LoraConfig.parse_targets("qkv_proj,q_proj", KNOWN) == ("q_proj", "qkv_proj")


@pytest.mark.parametrize("engine", ["torch", pytest.param("mlx", marks=pytest.mark.mlx)])
def test_qlora_on_a_4bit_phi3_trains_as_its_dequantized_float_form(engine, tmp_path, tiny_models):
    """The fused linears packed to 4 bits (``spill models quantize``): a LoRA tune on them gives
    the losses and adapters of the same tune on the dequantized float folder, within float32
    rounding: the first step's loss bit for bit; later steps moved by 2.4e-7 in a loss on a
    machine with OpenBLAS (MLX) or with torch's threads busy, so bits are not promised here."""
    from spill.models.config import load_config
    from spill.models.sources.quantize import dequantize_folder, quantize_folder
    from tests.unit.engines import hf_families
    from tests.unit.engines.kit import fresh, load_engine, open_runner, tune

    runtime = load_engine(engine)
    folder = hf_families.make("phi3-long", tmp_path / "phi3", tiny_models["llama"])
    packed, unpacked = tmp_path / "q4", tmp_path / "f32"
    quantize_folder(folder, packed, 4, 32, lambda line: None)
    dequantize_folder(packed, unpacked)
    cfg = load_config(folder)
    lora = LoraConfig(rank=4, alpha=8, dropout=0.1, targets=LoraConfig.parse_targets("all", FUSED))
    got = []
    for weights in (packed, unpacked):
        runner = open_runner(runtime, weights, dtype="float32", ring=2)
        trainer = fresh(runner, cfg, lora)
        got.append((runner.info.weights, tune(trainer, 2), trainer.state()))
        runner.close()
    assert "4-bit" in got[0][0] and "4-bit" not in got[1][0]
    assert got[0][1][0] == got[1][1][0]
    assert np.allclose(got[0][1], got[1][1], rtol=1e-6, atol=0)
    for x, y in zip(got[0][2], got[1][2], strict=True):
        assert x.keys() == y.keys()
        assert all(np.allclose(x[n], y[n], rtol=1e-4, atol=1e-7) for n in x), x.keys()
