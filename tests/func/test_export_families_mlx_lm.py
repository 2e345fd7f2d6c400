"""``spill export --format mlx`` of an adapter tuned on each family mlx-lm has (Qwen3, Mistral,
SmolLM3, Gemma 3, Phi-3's fused linears; transformers-made folders, ``hf_families.MLX_LM``):
mlx-lm loads the merged folder, float32 and ``--quantize 4`` (its affine layout), and its gold
log-probs are spill's within 1e-4 (sums over an answer's tokens; the float export against
``spill eval --adapter`` on the base, the packed one against spill scoring that same folder)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.func.test_export_families import FLOAT, ROWS, TUNE, _jsonl, _ok, _spill
from tests.unit.engines import hf_families
from tests.unit.engines.kit import load_engine

pytestmark = pytest.mark.mlx
mlx_lm = pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install mlx-lm)")
FAMILIES = ["qwen3", "mistral-full", "smollm3", "gemma3", "phi3-half"]


def _mlx_lm_log_probs(folder: Path) -> list[float]:
    """The gold answers' summed log-probs under ``mlx_lm.utils.load_model(folder)``."""
    import mlx.core as mx

    from spill.models.tokenizer import Tokenizer

    model, _ = mlx_lm.utils.load_model(folder)
    tok, out = Tokenizer(folder), []
    for row in ROWS:
        prompt, answer = tok.encode(row["prompt"]), tok.encode(row["answer"], False)
        logits = model(mx.array([prompt + answer]))[0].astype(mx.float32)
        lp = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True)).astype(np.float64)
        out.append(float(sum(lp[len(prompt) - 1 + i, t] for i, t in enumerate(answer))))
    return out


def _eval(model: Path, rows: Path, out: Path, home: Path, *extra: str) -> list[float]:
    argv = ["eval", str(model), str(rows), "--out", str(out), "--engine", "mlx", *extra, *FLOAT]
    _ok(_spill(*argv, home=home))
    return [json.loads(line)["gold_logprob"] for line in out.read_text().splitlines()]


@pytest.mark.parametrize("variant", FAMILIES)
def test_mlx_lm_loads_the_mlx_export_as_spill_scores_it(variant, tmp_path, tiny_models):
    load_engine("mlx")  # skips, saying how to install it, where MLX is missing
    home, spec = tmp_path / "home", hf_families.MLX_LM[variant]
    model = hf_families.make(variant, tmp_path / variant, tiny_models["llama"], spec=spec)
    model = hf_families.for_mlx_lm(model)
    train = _jsonl(
        tmp_path / "train.jsonl",
        [
            {"prompt": f"Question {i}: what is {i} plus 3?", "completion": f" {i + 3}."}
            for i in range(8)
        ],
    )
    state, rows = tmp_path / "state", _jsonl(tmp_path / "rows.jsonl", ROWS)
    argv = ["tune", str(model), str(train), "--name", "t", "--state", str(state)]
    _ok(_spill(*argv, *TUNE, "--targets", "all", *FLOAT, home=home))
    adapter = ["--adapter", str(state / "adapter")]
    ours = _eval(model, rows, tmp_path / "eval.jsonl", home, *adapter)

    merged = tmp_path / "mlx"
    _ok(_spill("export", str(state), str(merged), "--format", "mlx", "--dtype", "f32", home=home))
    assert np.allclose(_mlx_lm_log_probs(merged), ours, rtol=0, atol=1e-4)

    packed = tmp_path / "mlx-q4"
    argv = ["export", str(state), str(packed), "--format", "mlx", "--quantize", "4"]
    _ok(_spill(*argv, "--dtype", "f32", home=home))
    assert json.loads((packed / "config.json").read_text())["quantization"]["bits"] == 4
    ours = _eval(packed, rows, tmp_path / "eval-q4.jsonl", home)
    assert np.allclose(_mlx_lm_log_probs(packed), ours, rtol=0, atol=1e-4)
