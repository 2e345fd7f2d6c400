"""Qwen3, Mistral and SmolLM3 on every engine against transformers' own models of them: gold
log-probs within 1e-5 and greedy tokens equal to ``generate`` (float32), with sequences longer
than the sliding windows, a NoPE layer and per-head q/k norms; streamed == resident bit for bit;
a 4-bit copy computes as its float form; training through the streamed walk and through kept
activations bit for bit alike, and MLX's gradients within 2e-5 of torch's. The models are made
by transformers (``hf_families``), never by spill."""

from __future__ import annotations

import numpy as np
import pytest

from spill.engines.base import GenerateParams
from tests.unit.engines import hf_families
from tests.unit.engines.kit import COMPLETIONS, PROMPTS, open_runner, same, tokens

torch = pytest.importorskip("torch")
# a long row: 30 prompt tokens and 15 scored ones, past every window (6 and 7)
LONG = (np.arange(30, 60), np.arange(60, 75))
ROWS = ([*PROMPTS, LONG[0]], [*COMPLETIONS, LONG[1]])
# rows scored alone with >= 8 positions each: on a CPU MLX multiplies a packed matrix dequantized
# (as the float folder) from ops.DENSE_ROWS rows, through quantized_matmul below
PACKED_ROWS = ([LONG[0], np.arange(3, 15)], [LONG[1], np.arange(40, 50)])
NEW = 12


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_models):
    root = tmp_path_factory.mktemp("hf-families")
    return {
        v: hf_families.make(v, root / v, tiny_models["llama"], seed=k)
        for k, v in enumerate(hf_families.VARIANTS)
    }


@pytest.fixture(params=list(hf_families.VARIANTS))
def variant(request, folders):
    return request.param, folders[request.param]


def hf_log_probs(model, prompt, completion):
    ids = torch.tensor(np.concatenate([prompt, completion]))[None]
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), dim=-1)[0]  # (T, V)
    return logp[len(prompt) - 1 : -1].gather(1, ids[0, len(prompt) :, None])[:, 0].numpy()


def test_log_probs_match_transformers(engine, variant):
    name, folder = variant
    hf = hf_families.load(folder)
    runner = open_runner(engine, folder, ring=2, dtype="float32")
    got = runner.score(*ROWS)
    for prompt, completion, ours in zip(*ROWS, got, strict=True):
        ref = hf_log_probs(hf, prompt, completion)
        assert np.abs(ours - ref).max() <= 1e-5, name
    runner.close()


def test_greedy_matches_transformers(engine, variant):
    """Prompts longer than the window, then a KV-cached decode past it."""
    name, folder = variant
    hf = hf_families.load(folder)
    stop = tuple(hf.generation_config.eos_token_id)
    runner = open_runner(engine, folder, ring=2, dtype="float32")
    for prompt in (PROMPTS[0], PROMPTS[2], LONG[0]):
        ours = runner.generate([prompt], GenerateParams(max_new_tokens=NEW, stop_ids=stop), [0])[0]
        out = hf.generate(torch.tensor(prompt)[None], do_sample=False, max_new_tokens=NEW)
        theirs = out[0, len(prompt) :].tolist()
        n = len(ours.tokens)
        assert ours.tokens.tolist() == theirs[:n], name
        if ours.finish == "stop":
            assert theirs[n] in stop
        else:
            assert n == NEW == len(theirs)
    runner.close()


def test_streamed_and_resident_are_bit_identical(engine, variant):
    _, folder = variant
    streamed = open_runner(engine, folder, ring=2, dtype="float32")
    resident = open_runner(engine, folder, resident=True, dtype="float32")
    assert not streamed.info.resident and resident.info.resident
    assert same(streamed.score(*ROWS), resident.score(*ROWS))
    params = GenerateParams(max_new_tokens=NEW)
    prompts = [*PROMPTS, LONG[0]]
    a = streamed.generate(prompts, params, [0, 1, 2, 3])  # one batch, left-padded
    b = resident.generate(prompts, params, [0, 1, 2, 3])
    assert tokens(a) == tokens(b)
    streamed.close()
    resident.close()


def test_a_quantized_copy_computes_as_its_float_form(engine, variant, tmp_path):
    """``spill models quantize``'s 4-bit copy (the linears and embeddings packed, the q/k norms
    kept float) scores as its dequantized float folder, bit for bit, streamed and resident."""
    from spill.models.sources.quantize import dequantize_folder, quantize_folder

    _, folder = variant
    packed, unpacked = tmp_path / "q4", tmp_path / "f32"
    quantize_folder(folder, packed, 4, 32, lambda line: None)
    dequantize_folder(packed, unpacked)
    for options in ({"ring": 2}, {"resident": True}):
        a = open_runner(engine, packed, dtype="float32", **options)
        b = open_runner(engine, unpacked, dtype="float32", **options)
        assert "4-bit" in a.info.weights
        assert same(a.score(*PACKED_ROWS), b.score(*PACKED_ROWS))
        a.close()
        b.close()


def test_kept_activations_and_the_recompute_walk_train_bit_identically(engine, variant):
    """The streamed walk (recompute, kept base outputs on torch) and one graph over the resident
    stack: the same losses, adapters and AdamW state bit for bit, with dropout, on rows past the
    windows (up to 11 tokens against windows of 6 and 7)."""
    from spill.models.config import load_config
    from spill.models.lora import LoraConfig
    from tests.unit.engines.kit import fresh, nudged
    from tests.unit.engines.kit import tune as tune_steps

    _, folder = variant
    cfg = load_config(folder)
    lora = LoraConfig(
        rank=4, alpha=8, dropout=0.1, targets=LoraConfig.parse_targets("all", cfg.linears)
    )
    runs = []
    for options, mode in (({"ring": 2}, "auto"), ({"resident": True}, "keep")):
        runner = open_runner(engine, folder, dtype="float32", **options)
        trainer = fresh(runner, cfg, lora, nudged(cfg, lora))
        assert trainer.plan(3, 8, mode).keep == (mode == "keep")
        runs.append((tune_steps(trainer, 3), trainer.state()))
        runner.close()
    (losses_a, state_a), (losses_b, state_b) = runs
    assert losses_a == losses_b and losses_a[-1] < losses_a[0]
    assert all(
        a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)
        for a, b in zip(state_a, state_b, strict=True)
    )


@pytest.mark.mlx
def test_mlx_gradients_match_the_torch_trainer(variant):
    from spill.models.config import load_config
    from spill.models.lora import LoraConfig
    from tests.unit.engines.kit import batches, fresh, load_engine, nudged

    _, folder = variant
    cfg = load_config(folder)
    lora = LoraConfig(rank=4, alpha=8, targets=LoraConfig.parse_targets("all", cfg.linears))
    params, batch = nudged(cfg, lora), batches(0)[0]
    got = []
    for name in ("torch", "mlx"):
        runner = open_runner(load_engine(name), folder, ring=2, dtype="float32")
        trainer = fresh(runner, cfg, lora, params)
        loss = trainer.accumulate(batch)
        got.append((loss, {n: trainer.kernel.numpy(g) for n, g in trainer.grads.items()}))
        runner.close()
    (loss_t, grads_t), (loss_m, grads_m) = got
    assert loss_m == pytest.approx(loss_t, rel=1e-5)
    for name, ref in grads_t.items():
        assert np.abs(ref).max() > 0, name
        assert np.abs(grads_m[name] - ref).max() <= 2e-5 * np.abs(ref).max(), name
