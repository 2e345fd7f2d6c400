"""``spill export`` of adapters tuned on Qwen3-MoE (issue 41; transformers-made folders,
``hf_families.MOE``; the adapter on the attention linears, and on every expert too, each folded
into its expert): the merged HF folder keeps config.json's
MoE keys and every expert under the hub's per-expert names, bit for bit the base's, and scores in
transformers' Qwen3MoeForCausalLM as ``spill eval --adapter`` on the base (within 1e-5, float32),
a base with stacked experts (transformers 5's fused layout, mlx-lm's switch_mlp) too;
the mlx-lm folder loads in mlx-lm's qwen3_moe (the keys it reads written) and scores the same. A
GGUF (llama.cpp's qwen3moe: experts stacked as ``ffn_*_exps``) of a model that routes every layer
with top-k weights renormalized imports back through spill's importer bit for bit and scores the
same, its Q4_0 form imports packed; dense layers and ``norm_topk_prob`` false are refused in one
line. Slow: llama.cpp runs that GGUF as transformers runs the HF export."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from spill.errors import UnsupportedModel
from spill.jobs.export.gguf import _refuse_unwritable
from spill.models.config import load_config, parse_config
from spill.models.sources.tiny import write_tiny
from tests.func.test_export_families import (
    FLOAT,
    ROTARY,
    ROWS,
    TUNE,
    _gold_log_probs,
    _jsonl,
    _llama_cpp_logits,
    _ok,
    _spill,
    _tensors,
    _with_a_merge,
)
from tests.unit.engines import hf_families

# every layer routed, top 2 of 8 renormalized: what llama.cpp's qwen3moe runs; experts 64 wide,
# so Q4_0's 32-value blocks split every matrix
ROUTED = (
    "Qwen3Moe",
    dict(
        num_hidden_layers=2,
        head_dim=24,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    ),
)
SPECS = {**hf_families.MOE, "qwen3_moe-routed": ROUTED}
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
REFUSED = {  # why each variant's GGUF is refused
    "qwen3_moe": "its layers [1] have a dense MLP",
    "qwen3_moe-step": "its layers [0] have a dense MLP",
}


def _tune(tmp_path: Path, model: Path, home: Path, targets: str = "all") -> Path:
    """The state of a 2-step float32 tune of ``model`` on the attention linears ("all") or
    ``targets``."""
    rows = [
        {"prompt": f"Question {i}: what is {i} plus 3?", "completion": f" {i + 3}."}
        for i in range(8)
    ]
    tmp_path.mkdir(exist_ok=True)
    train, state = _jsonl(tmp_path / "train.jsonl", rows), tmp_path / "state"
    argv = ["tune", str(model), str(train), "--name", "t", "--state", str(state)]
    _ok(_spill(*argv, *TUNE, "--targets", targets, *FLOAT, home=home))
    return state


def _eval(folder: Path, tmp_path: Path, label: str, home: Path, *extra: str) -> list[float]:
    """``spill eval``'s gold log-prob of each of ROWS on ``folder`` (float32)."""
    rows, graded = _jsonl(tmp_path / "rows.jsonl", ROWS), tmp_path / f"{label}.jsonl"
    argv = ["eval", str(folder), str(rows), "--out", str(graded), *extra, *FLOAT]
    _ok(_spill(*argv, home=home))
    return [json.loads(line)["gold_logprob"] for line in graded.read_text().splitlines()]


@pytest.mark.parametrize("targets", ["all", "q_proj,experts"])
@pytest.mark.parametrize("variant", list(REFUSED))
def test_the_hf_export_keeps_the_experts_and_scores_as_spill_and_a_gguf_is_refused(
    variant, targets, tmp_path, tiny_models
):
    """With expert targets each expert's adapter folds into that expert (and the dense layer's
    into its MLP); nothing else changes."""
    home = tmp_path / "home"
    model = hf_families.make(variant, tmp_path / variant, tiny_models["llama"], spec=SPECS[variant])
    state = _tune(tmp_path, model, home, targets)
    ours = _eval(model, tmp_path, "adapter", home, "--adapter", str(state / "adapter"))

    hf = tmp_path / "hf"
    _ok(_spill("export", str(state), str(hf), "--dtype", "f32", home=home))
    base, merged = json.loads((model / "config.json").read_text()), load_config(hf)
    config = json.loads((hf / "config.json").read_text())
    moe = ("num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")
    moe += ("mlp_only_layers", "decoder_sparse_step")
    assert {k: config[k] for k in moe} == {k: base[k] for k in moe}
    assert merged.sparse == load_config(model).sparse and merged.sparse
    want, got = _tensors(model), _tensors(hf)
    assert set(got) == set(want)
    assert (
        f"model.layers.{merged.sparse[0]}.mlp.experts.{merged.experts - 1}.down_proj.weight" in got
    )
    changed = {k for k in want if not np.array_equal(got[k], want[k])}
    assert changed and all(k.endswith("_proj.weight") for k in changed)
    adapted = {k.split(".", 3)[-1].rsplit(".", 1)[0] for k in changed}
    if targets == "all":
        assert all(k.startswith("self_attn.") for k in adapted)
    else:
        dense = next(i for i in range(merged.num_hidden_layers) if i not in merged.sparse)
        assert f"model.layers.{dense}.mlp.down_proj.weight" in changed
        assert f"model.layers.{merged.sparse[0]}.mlp.experts.0.up_proj.weight" in changed
        assert {k.split(".")[-1] for k in adapted} == {"q_proj", *PROJECTIONS}
    gap = np.abs(np.array(_gold_log_probs(hf)) - ours).max()
    print(f"\n{variant} {targets}: transformers on the HF export vs spill --adapter: {gap:.3g}")
    assert gap <= 1e-5, gap

    gguf = tmp_path / "gguf"
    refused = _spill("export", str(state), str(gguf), "--format", "gguf", home=home)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 1 and len(lines) == 1 and "Traceback" not in refused.stderr
    assert lines[0].startswith("spill: error: ") and REFUSED[variant] in lines[0], lines
    assert not gguf.exists()


def _restacked(hub: Path, folder: Path, layout: str) -> Path:
    """``hub``'s model with its experts stored as transformers 5 holds them in memory ("fused":
    ``experts.gate_up_proj`` (E, 2I, H), ``experts.down_proj`` (E, H, I)) or as mlx-lm's
    ``switch_mlp`` stacks ("switch_mlp": (E, out, in) a projection)."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(hub / "model.safetensors")
    out = {n: t for n, t in tensors.items() if ".mlp.experts." not in n}
    mlps = {n.split(".experts.")[0] for n in tensors if ".mlp.experts." in n}
    for mlp in sorted(mlps):
        count = len({n for n in tensors if n.startswith(f"{mlp}.experts.") and "down" in n})

        def stack(p: str, mlp=mlp, count=count) -> np.ndarray:
            return np.stack([tensors[f"{mlp}.experts.{e}.{p}.weight"] for e in range(count)])

        if layout == "fused":
            out[f"{mlp}.experts.gate_up_proj"] = np.concatenate(
                [stack("gate_proj"), stack("up_proj")], axis=1
            )
            out[f"{mlp}.experts.down_proj"] = stack("down_proj")
        else:
            out |= {f"{mlp}.switch_mlp.{p}.weight": stack(p) for p in PROJECTIONS}
    folder.mkdir()
    save_file(out, folder / "model.safetensors", {"format": "pt"})
    for f in hub.iterdir():
        if f.suffix == ".json" and f.name != "model.safetensors.index.json":
            shutil.copy(f, folder / f.name)
    return folder


@pytest.mark.parametrize(
    ("layout", "targets"),
    [("fused", "all"), ("switch_mlp", "all"), ("fused", "q_proj,experts")],
)
def test_stacked_experts_are_exported_per_expert_as_the_hub_names_them(
    layout, targets, tmp_path, tiny_models
):
    """A base whose experts are stored stacked (transformers 5's fused in-memory layout, mlx-lm's
    switch_mlp) exports each expert's tensors by the hub's names, bit for bit the hub folder's
    where no adapter folds in, and the HF folder scores in transformers as spill scores the
    stacked base with the adapter (one on every expert too: read through the per-expert views)."""
    home, spec = tmp_path / "home", SPECS["qwen3_moe"]
    hub = hf_families.make("qwen3_moe", tmp_path / "hub", tiny_models["llama"], spec=spec)
    model = _restacked(hub, tmp_path / layout, layout)
    state = _tune(tmp_path, model, home, targets)
    ours = _eval(model, tmp_path, "adapter", home, "--adapter", str(state / "adapter"))
    hf = tmp_path / "hf"
    _ok(_spill("export", str(state), str(hf), "--dtype", "f32", home=home))
    want, got = _tensors(hub), _tensors(hf)
    assert set(got) == set(want)
    adapted = (".self_attn.",) if targets == "all" else (".self_attn.", "_proj.weight")
    assert all(
        np.array_equal(got[k], w) for k, w in want.items() if not any(a in k for a in adapted)
    )
    expert = "model.layers.0.mlp.experts.3.up_proj.weight"
    assert np.array_equal(got[expert], want[expert]) == (targets == "all")
    gap = np.abs(np.array(_gold_log_probs(hf)) - ours).max()
    print(f"\n{layout} {targets}: transformers on the HF export vs spill --adapter: {gap:.3g}")
    assert gap <= 1e-5, gap


def test_llama_cpps_qwen3moe_renormalizes_so_norm_topk_prob_false_is_refused(tmp_path):
    raw = json.loads((write_tiny(tmp_path / "moe", "qwen3_moe") / "config.json").read_text())
    _refuse_unwritable(SimpleNamespace(config=parse_config(raw), base_name="base"))
    with pytest.raises(UnsupportedModel) as err:
        cfg = parse_config(raw | {"norm_topk_prob": False})
        _refuse_unwritable(SimpleNamespace(config=cfg, base_name="base"))
    said = str(err.value)
    assert "\n" not in said and "norm_topk_prob is false" in said and "--format hf" in said


@pytest.mark.mlx
@pytest.mark.parametrize("targets", ["all", "q_proj,experts"])
def test_mlx_lm_loads_the_mlx_export_as_spill_scores_it(targets, tmp_path, tiny_models):
    """mlx-lm's qwen3_moe reads ``num_experts``, a top-level ``rope_theta`` and ``head_dim``,
    which the export writes; it has no attention biases, so "qwen3_moe" (a dense layer among
    the routed ones), not "qwen3_moe-step". ``--quantize 4`` stacks the experts as switch_mlp.
    Expert adapters fold into each expert."""
    mlx_lm = pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install mlx-lm)")
    mx = pytest.importorskip("mlx.core")
    home, variant = tmp_path / "home", "qwen3_moe"
    model = hf_families.make(variant, tmp_path / variant, tiny_models["llama"], spec=SPECS[variant])
    state = _tune(tmp_path, model, home, targets)
    ours = _eval(model, tmp_path, "adapter", home, "--adapter", str(state / "adapter"))
    out = tmp_path / "mlx"
    _ok(_spill("export", str(state), str(out), "--format", "mlx", "--dtype", "f32", home=home))
    config = json.loads((out / "config.json").read_text())
    assert config["num_experts"] == 8 and config["rope_theta"] == 10000.0
    assert config["head_dim"] == 24

    gap = np.abs(np.array(_mlx_lm_log_probs(mlx_lm, mx, out)) - ours).max()
    print(f"\n{targets}: mlx-lm vs spill, summed gold log-probs: {gap:.3g}")
    assert gap <= 1e-5, gap

    # packed: each projection's experts stacked as switch_mlp (down_proj's 48 columns make no
    # group of 64: stacked in float), scored by spill on that same folder
    packed = tmp_path / "mlx-q4"
    argv = ["export", str(state), str(packed), "--format", "mlx", "--quantize", "4"]
    _ok(_spill(*argv, "--dtype", "f32", home=home))
    names = set(_tensors(packed))
    stacks = {
        f"model.layers.0.mlp.switch_mlp.{p}.{part}"
        for p in PROJECTIONS
        for part in ("weight", "scales")
    }
    assert names >= stacks - {"model.layers.0.mlp.switch_mlp.down_proj.scales"}
    assert "model.layers.0.mlp.switch_mlp.down_proj.scales" not in names
    assert not [n for n in names if ".experts." in n]
    assert json.loads((packed / "config.json").read_text())["quantization"]["bits"] == 4
    ours = _eval(packed, tmp_path, "packed", home)
    gap = np.abs(np.array(_mlx_lm_log_probs(mlx_lm, mx, packed)) - ours).max()
    print(f"mlx-lm vs spill on the 4-bit export: {gap:.3g}")
    assert gap <= 1e-4, gap


def test_a_packed_moe_base_is_dequantized_for_the_hf_export(tmp_path, tiny_models):
    """An adapter tuned on a 4-bit mlx-lm folder of a Qwen3-MoE (its experts switch_mlp stacks,
    spill's own mlx export): the HF export dequantizes every expert under the hub's names and
    scores in transformers as spill scores the packed base with the adapter (within 1e-5)."""
    home, variant = tmp_path / "home", "qwen3_moe"
    model = hf_families.make(variant, tmp_path / variant, tiny_models["llama"], spec=SPECS[variant])
    packed = tmp_path / "mlx-q4"
    argv = ["export", str(_tune(tmp_path, model, home)), str(packed), "--format", "mlx"]
    _ok(_spill(*argv, "--quantize", "4", "--dtype", "f32", home=home))
    state = _tune(tmp_path / "again", packed, home)
    ours = _eval(packed, tmp_path, "adapter", home, "--adapter", str(state / "adapter"))
    hf = tmp_path / "hf"
    _ok(_spill("export", str(state), str(hf), "--dtype", "f32", home=home))
    got = _tensors(hf)
    assert set(got) == set(_tensors(model)) and "quantization" not in json.loads(
        (hf / "config.json").read_text()
    )
    assert np.allclose(_gold_log_probs(hf), ours, rtol=0, atol=1e-5)


def _mlx_lm_log_probs(mlx_lm, mx, folder: Path) -> list[float]:
    """The gold answers' summed log-probs under mlx-lm (float32)."""
    from spill.models.tokenizer import Tokenizer

    theirs, _ = mlx_lm.utils.load_model(folder)
    theirs.set_dtype(mx.float32)
    tok, got = Tokenizer(folder), []
    for row in ROWS:
        prompt, answer = tok.encode(row["prompt"]), tok.encode(row["answer"], False)
        logits = theirs(mx.array([prompt + answer]))[0].astype(mx.float32)
        lp = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True)).astype(np.float64)
        got.append(float(sum(lp[len(prompt) - 1 + i, t] for i, t in enumerate(answer))))
    return got


@pytest.mark.parametrize("targets", ["all", "q_proj,experts"])
def test_a_gguf_export_imports_back_bit_for_bit_and_scores_as_spill(targets, tmp_path, tiny_models):
    """Expert adapters fold into each expert's slice of the ``ffn_*_exps`` stacks."""
    from gguf import GGUFReader

    from spill.models.gguf.importer import import_gguf

    home = tmp_path / "home"
    model = _with_a_merge(
        hf_families.make("x", tmp_path / "moe", tiny_models["llama"], spec=ROUTED)
    )
    state = _tune(tmp_path, model, home, targets)
    hf, out = tmp_path / "hf", tmp_path / "gguf"
    _ok(_spill("export", str(state), str(hf), "--dtype", "f32", home=home))
    _ok(_spill("export", str(state), str(out), "--format", "gguf", "--dtype", "f32", home=home))
    gguf = out / "model-f32.gguf"
    reader = GGUFReader(gguf)
    fields = {f.name: f.contents() for f in reader.fields.values()}
    assert fields["general.architecture"] == "qwen3moe"
    assert fields["qwen3moe.expert_count"] == 8 and fields["qwen3moe.expert_used_count"] == 2
    assert fields["qwen3moe.expert_feed_forward_length"] == 64
    shapes = {t.name: tuple(int(d) for d in t.shape[::-1]) for t in reader.tensors}
    assert shapes["blk.1.ffn_gate_inp.weight"] == (8, 64)
    assert shapes["blk.1.ffn_gate_exps.weight"] == (8, 64, 64)
    assert shapes["blk.1.ffn_down_exps.weight"] == (8, 64, 64)
    assert not [n for n in shapes if n.endswith(("ffn_gate.weight", "ffn_up.weight"))]

    back = import_gguf(gguf, tmp_path / "back")
    mine, theirs = load_config(back), load_config(hf)
    moe = ("experts", "experts_per_token", "expert_size", "norm_topk_prob", "sparse")
    assert all(getattr(mine, k) == getattr(theirs, k) for k in ROTARY + moe)
    want, got = _tensors(hf), _tensors(back)
    assert set(got) == set(want)
    assert all(np.array_equal(got[k], w) for k, w in want.items())
    ours = _eval(model, tmp_path, "adapter", home, "--adapter", str(state / "adapter"))
    gap = np.abs(np.array(_eval(back, tmp_path, "gguf", home)) - ours).max()
    print(f"\n{targets}: spill on the GGUF imported back vs spill --adapter: {gap:.3g}")
    assert gap <= 1e-5, gap
    if targets != "all":  # the experts moved: the merge reached the stacks
        base = _tensors(model)
        assert not np.array_equal(want["model.layers.1.mlp.experts.5.down_proj.weight"],
                                  base["model.layers.1.mlp.experts.5.down_proj.weight"])  # fmt: skip

    # Q4_0 (every matrix, the stacks too), imported kept packed and dequantized alike
    q4 = tmp_path / "q4"
    _ok(_spill("export", str(state), str(q4), "--format", "gguf", "--quantize", "q4_0", home=home))
    kept = import_gguf(q4 / "model-q4_0.gguf", tmp_path / "kept", keep_quantization=True)
    floats = import_gguf(q4 / "model-q4_0.gguf", tmp_path / "floats")
    assert json.loads((kept / "config.json").read_text())["quantization"]
    scores = {
        label: _eval(f, tmp_path, label, home) for label, f in (("kept", kept), ("floats", floats))
    }
    assert np.allclose(scores["kept"], scores["floats"], rtol=0, atol=1e-5)
    assert not np.allclose(scores["floats"], ours, rtol=0, atol=1e-5)  # it rounded


@pytest.mark.slow  # llama-cpp-python (built from its sdist)
def test_llama_cpp_runs_the_qwen3moe_gguf_as_transformers_runs_the_hf_export(tmp_path, tiny_models):
    """The routed model, tuned and exported as f32 GGUF (llama.cpp's qwen3moe) and HF:
    llama.cpp's logits (F32 KV cache) are within 1e-4 of transformers' at every position."""
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed (it builds from its sdist)"
    )
    import torch

    from spill.models.tokenizer import Tokenizer
    from tests.func.test_export_families import _tuned_f32_exports

    hf, gguf = _tuned_f32_exports(tmp_path, tiny_models, ROUTED)
    theirs, tok = hf_families.load(hf), Tokenizer(hf)
    ids = tok.encode(" ".join(f"w{i}" for i in range(20)))[:50]
    got = _llama_cpp_logits(llama_cpp, gguf, ids, 256)
    with torch.no_grad():
        want = theirs(torch.tensor([ids])).logits[0].double().numpy()
    gap = np.abs(got - want).max()
    print(f"\n{len(ids)} tokens: llama.cpp vs transformers {gap:.3g}")
    assert gap <= 1e-4, gap
