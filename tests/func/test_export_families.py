"""``spill export`` of adapters tuned on Qwen3, Mistral, SmolLM3 and Gemma 3 (transformers-made
folders): the merged HF folder loads in transformers and scores the gold answers as ``spill eval
--adapter`` does on the base (within 1e-5, float32), and a GGUF, which spill cannot write for these
families yet, is refused in one line with nothing left at OUT."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import run_spill
from tests.unit.engines import hf_families

ROWS = [
    {"id": 0, "prompt": "Question 5: what is 5 plus 8?", "answer": " 13."},
    {
        "id": 1,
        "prompt": "Question 11: what is 11 plus 14? And then some more words",
        "answer": " 25.",
    },
]
TUNE = ["--steps", "2", "--batch", "4", "--lr", "0.05", "--rank", "4", "--seq-len", "64"]
FLOAT = ["--dtype", "float32"]


def _ok(proc):
    assert proc.returncode == 0, proc.stderr
    return proc


def _spill(*args: str, home: Path):
    return run_spill(*args, env={"SPILL_HOME": str(home), "OMP_NUM_THREADS": "1"}, timeout=300)


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _gold_log_probs(folder: Path) -> list[float]:
    """transformers' summed log-prob of each row's answer after its prompt (spill's tokenizer)."""
    import torch

    from spill.models.tokenizer import Tokenizer

    model, tok = hf_families.load(folder), Tokenizer(folder)
    out = []
    for row in ROWS:
        prompt, answer = tok.encode(row["prompt"]), tok.encode(row["answer"], False)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + answer])).logits[0].double()
        lp = torch.log_softmax(logits, -1)
        out.append(sum(lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(answer)))
    return out


@pytest.mark.parametrize("variant", ["qwen3", "mistral", "smollm3", "gemma3", "phi3", "phi3-long"])
def test_the_hf_export_scores_as_spill_with_the_adapter_and_a_gguf_is_refused(
    variant, tmp_path, tiny_models
):
    home = tmp_path / "home"
    model = hf_families.make(variant, tmp_path / variant, tiny_models["llama"])
    train = _jsonl(
        tmp_path / "train.jsonl",
        [
            {"prompt": f"Question {i}: what is {i} plus {i + 3}?", "completion": f" {2 * i + 3}."}
            for i in range(8)
        ],
    )
    state = tmp_path / "state"
    argv = ["tune", str(model), str(train), "--name", "t", "--state", str(state)]
    _ok(_spill(*argv, *TUNE, "--targets", "all", *FLOAT, home=home))
    rows, graded = _jsonl(tmp_path / "rows.jsonl", ROWS), tmp_path / "eval.jsonl"
    adapter = str(state / "adapter")
    _ok(
        _spill(
            "eval",
            str(model),
            str(rows),
            "--out",
            str(graded),
            "--adapter",
            adapter,
            *FLOAT,
            home=home,
        )
    )
    spill_lp = [json.loads(line)["gold_logprob"] for line in graded.read_text().splitlines()]

    hf = tmp_path / "hf"
    _ok(_spill("export", str(state), str(hf), "--dtype", "f32", home=home))
    assert np.allclose(_gold_log_probs(hf), spill_lp, rtol=0, atol=1e-5)

    gguf = tmp_path / "gguf"
    refused = _spill("export", str(state), str(gguf), "--format", "gguf", home=home)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 1 and len(lines) == 1 and "Traceback" not in refused.stderr
    family = json.loads((model / "config.json").read_text())["model_type"]  # gemma3_text
    assert lines[0].startswith("spill: error: ") and f"no GGUF of a {family} model" in lines[0]
    assert not gguf.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".exporting")]
