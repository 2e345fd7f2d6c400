"""Qwen3-MoE (issue 41) on spill's MLX engine against mlx-lm's own ``qwen3_moe`` and against
spill's torch engine, on transformers-made folders (``hf_families.MOE``): log-probs within
``TOLERANCE`` (float32) and greedy tokens equal to ``mlx_lm.generate.generate_step``'s; MLX and
torch log-probs within 1e-5; the streamed walk and kept activations training bit for bit alike;
and, one layer at a time, MLX's gradients to adapters on the attention and on the experts equal
to torch's autograd (an unrouted expert's exactly zero).

mlx-lm 0.32.2's ``qwen3_moe.py`` honours ``mlp_only_layers``, ``decoder_sparse_step`` and
``norm_topk_prob`` as transformers does, but reads ``num_experts`` (transformers 5 writes
``num_local_experts``), a top-level ``rope_theta`` and an explicit ``head_dim`` (no default of
hidden / heads), and its attention has no biases: it refuses "qwen3_moe-step"'s
``attention_bias`` weights. So mlx-lm reads a copy of each folder whose config.json has those
keys (``for_mlx_lm``; spill reads the folder transformers wrote), and runs "qwen3_moe-step"
without the biases ("qwen3_moe-step-unbiased"). Its top k comes from ``argpartition`` (unsorted)
and its weighted sum over the k slots is one reduction, where spill and transformers add expert
by expert in ascending order: equal within float32 rounding, not bit for bit."""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path

import numpy as np
import pytest

from spill.engines.base import GenerateParams
from spill.models.config import load_config
from tests.unit.engines import hf_families
from tests.unit.engines.kit import PROMPTS, adapter_gaps, load_engine, open_runner
from tests.unit.engines.test_families import ROWS

pytestmark = pytest.mark.mlx
ENGINE = load_engine("mlx", module=True)
mlx_lm = pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install mlx-lm)")
mx = pytest.importorskip("mlx.core")
generate_step = pytest.importorskip("mlx_lm.generate").generate_step
torch = pytest.importorskip("torch")
TOLERANCE = 1e-5
NEW = 12
# every MoE variant, and "qwen3_moe-step" without the attention biases mlx-lm's qwen3_moe lacks
SPECS = dict(hf_families.MOE)
SPECS["qwen3_moe-step-unbiased"] = (
    SPECS["qwen3_moe-step"][0],
    {**SPECS["qwen3_moe-step"][1], "attention_bias": False},
)
MLX_LM = ["qwen3_moe", "qwen3_moe-step-unbiased"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_models):
    root = tmp_path_factory.mktemp("moe-mlx")
    return {
        v: hf_families.make(v, root / v, tiny_models["llama"], seed=k, spec=spec)
        for k, (v, spec) in enumerate(SPECS.items())
    }


@pytest.fixture(scope="module")
def mlx_lm_folders(folders, tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-mlx-lm")
    return {v: for_mlx_lm(folders[v], root / v) for v in MLX_LM}


@pytest.fixture(params=MLX_LM)
def runs_in_mlx_lm(request, folders, mlx_lm_folders):
    return request.param, folders[request.param], mlx_lm_folders[request.param]


@pytest.fixture(params=list(hf_families.MOE))
def variant(request, folders):
    return request.param, folders[request.param]


def for_mlx_lm(folder: Path, copy: Path) -> Path:
    """A copy of ``folder`` whose config.json also has the keys mlx-lm's qwen3_moe reads."""
    shutil.copytree(folder, copy)
    path = copy / "config.json"
    config = json.loads(path.read_text())
    config["num_experts"] = config["num_local_experts"]
    config["rope_theta"] = config["rope_parameters"]["rope_theta"]
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    path.write_text(json.dumps(config, indent=2))
    return copy


def mlx_lm_model(folder):
    model, _ = mlx_lm.utils.load_model(folder)
    model.set_dtype(mx.float32)
    return model


def mlx_lm_log_probs(model, prompt, completion) -> np.ndarray:
    ids = mx.array(np.concatenate([prompt, completion]))[None]
    logits = model(ids).astype(mx.float32)
    logp = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))[0]  # (T, V)
    return logp[len(prompt) - 1 : -1][np.arange(len(completion)), completion]


def test_log_probs_match_mlx_lm(runs_in_mlx_lm):
    name, folder, theirs_folder = runs_in_mlx_lm
    theirs = mlx_lm_model(theirs_folder)
    runner = open_runner(ENGINE, folder, ring=2, dtype="float32")
    for prompt, completion, ours in zip(*ROWS, runner.score(*ROWS), strict=True):
        gap = np.abs(ours - mlx_lm_log_probs(theirs, prompt, completion)).max()
        assert gap <= TOLERANCE, (name, gap)
    runner.close()


def test_greedy_matches_mlx_lm(runs_in_mlx_lm):
    """A KV-cached decode on both sides, from a short, a 2-token and a 30-token prompt."""
    name, folder, theirs_folder = runs_in_mlx_lm
    theirs = mlx_lm_model(theirs_folder)
    runner = open_runner(ENGINE, folder, ring=2, dtype="float32")
    for prompt in (PROMPTS[0], PROMPTS[1], ROWS[0][-1]):
        ours = runner.generate([prompt], GenerateParams(max_new_tokens=NEW), [0])[0]
        steps = generate_step(
            mx.array(prompt), theirs, max_tokens=NEW, sampler=lambda x: mx.argmax(x, -1)
        )
        want = [int(token) for token, _ in steps]
        assert len(want) == NEW and ours.tokens.tolist() == want[: len(ours.tokens)], name
    runner.close()


def test_log_probs_match_the_torch_engine(variant):
    name, folder = variant
    ours = open_runner(ENGINE, folder, ring=2, dtype="float32")
    theirs = open_runner(load_engine("torch"), folder, ring=2, dtype="float32")
    for a, b in zip(ours.score(*ROWS), theirs.score(*ROWS), strict=True):
        assert np.abs(a - b).max() <= TOLERANCE, name
    ours.close()
    theirs.close()


def layer_gradients(cfg, weights, x, cotangent, adapters, engine: str):
    """Layer 0's output and the gradients of x and of every adapter's A and B for ``cotangent``,
    through spill's MLX family and mx.vjp or its torch family and autograd (numpy in, out)."""
    names = sorted(adapters)
    flat = [m for n in names for m in adapters[n]]
    valid = np.ones(x.shape[:2], dtype=bool)
    if engine == "mlx":
        from spill.engines.mlx import ops, qwen3_moe

        w = {k: mx.array(v) for k, v in weights.items()}
        ctx = ops.context(mx.array(valid), 0, x.shape[1], ops.inv_freq(cfg), mx.float32)

        def run(h, *leaves):
            lora = {n: (leaves[2 * j], leaves[2 * j + 1], 2.0) for j, n in enumerate(names)}
            return [qwen3_moe.layer(cfg, 0, w, h, ctx, None, lora)]

        args = [mx.array(x), *(mx.array(a) for a in flat)]
        (out,), grads = mx.vjp(run, args, [mx.array(cotangent)])
        return np.array(out), [np.array(g) for g in grads]
    from spill.engines.torch import ops, qwen3_moe

    w = {k: torch.from_numpy(v) for k, v in weights.items()}
    ctx = ops.context(torch.from_numpy(valid), 0, x.shape[1], ops.inv_freq(cfg), torch.float32)
    args = [torch.tensor(a, requires_grad=True) for a in (x, *flat)]
    lora = {n: (args[1 + 2 * j], args[2 + 2 * j], 2.0) for j, n in enumerate(names)}
    out = qwen3_moe.layer(cfg, 0, w, args[0], ctx, None, lora)
    out.backward(torch.from_numpy(cotangent))
    unused = torch.zeros(())  # an unrouted expert's adapter: autograd leaves its grad None
    return out.detach().numpy(), [(unused if a.grad is None else a.grad).numpy() for a in args]


def test_gradients_reach_the_attention_and_the_routed_experts_adapters(folders):
    """Layer 0 (sparse) of "qwen3_moe" on 3 tokens, with adapters on q_proj and on every
    expert's gate/up/down: MLX's vjp gives torch's gradients (within 1e-5 of the largest), each
    routed expert's adapters get some, and the experts no token chose get exactly zero."""
    from safetensors.numpy import load_file

    folder = folders["qwen3_moe"]
    cfg = load_config(folder)
    assert 0 in cfg.sparse
    stem = "model.layers.0."
    stored = load_file(folder / "model.safetensors")
    weights = {k[len(stem) :]: v for k, v in stored.items() if k.startswith(stem)}
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, (1, 3, cfg.hidden_size)).astype(np.float32)  # (B, T, hidden)
    cotangent = rng.normal(0, 1, x.shape).astype(np.float32)
    shapes = cfg.layer_linears(0)
    modules = ["self_attn.q_proj", *(m for m in shapes if m.startswith("mlp.experts."))]
    adapters = {
        m: tuple(rng.normal(0, 0.1, s).astype(np.float32) for s in ((n, 4), (4, o)))
        for m, (n, o) in ((m, shapes[m]) for m in modules)
    }
    out, grads = layer_gradients(cfg, weights, x, cotangent, adapters, "mlx")
    ref_out, ref_grads = layer_gradients(cfg, weights, x, cotangent, adapters, "torch")
    assert np.abs(out - ref_out).max() <= TOLERANCE
    for ours, theirs in zip(grads, ref_grads, strict=True):
        assert np.abs(ours - theirs).max() <= TOLERANCE * max(1.0, np.abs(theirs).max())
    by_module = dict(zip(sorted(adapters), zip(grads[1::2], grads[2::2], strict=True), strict=True))
    assert all(np.abs(g).max() > 0 for g in by_module["self_attn.q_proj"])
    experts = {m: gs for m, gs in by_module.items() if m.startswith("mlp.experts.")}
    reached = {m.split(".")[2] for m, gs in experts.items() if any(g.any() for g in gs)}
    assert 2 <= len(reached) < cfg.experts  # 3 tokens x top 2 of 8: some experts unrouted
    for m, (a, b) in experts.items():  # a routed expert's A and B both, an unrouted one's neither
        assert (a.any() and b.any()) == (m.split(".")[2] in reached), m


def test_an_expert_adapter_in_mlx_lm_layout_scores_in_mlx_lm_as_in_spill(
    mlx_lm_folders, folders, tmp_path
):
    """spill's adapter on q_proj and every expert (the dense layer's MLP beside them), written in
    mlx-lm's layout (``LoRASwitchLinear``'s stacked ``mlp.switch_mlp.*``) and loaded by
    ``mlx_lm.load(..., adapter_path=...)``: log-probs as spill's with the adapter (float32)."""
    from spill.models.lora import LoraConfig, export_mlx
    from tests.unit.engines.kit import nudged

    folder = folders["qwen3_moe"]
    cfg = load_config(folder)
    lora = LoraConfig(rank=4, alpha=8, targets=("q_proj", "gate_proj", "up_proj", "down_proj"))
    params = nudged(cfg, lora, seed=3)
    adapter = export_mlx(params, lora, cfg.num_hidden_layers, tmp_path / "mlx")
    theirs, _ = mlx_lm.load(str(mlx_lm_folders["qwen3_moe"]), adapter_path=str(adapter))
    theirs.set_dtype(mx.float32)
    runner = open_runner(ENGINE, folder, ring=2, dtype="float32")
    gaps, moved = adapter_gaps(runner, lora, params, ROWS, partial(mlx_lm_log_probs, theirs))
    runner.close()
    print(f"\nmlx-lm vs spill with an expert adapter: {max(gaps):.3g} (moved {min(moved):.3g})")
    assert max(gaps) <= TOLERANCE and min(moved) > 1e-3, (gaps, moved)
