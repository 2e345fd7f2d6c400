"""Each 2026 family stored as people download it (issue 37): a transformers-made Qwen3, Mistral,
SmolLM3, Gemma 3, Phi-3 and Ministral 3 model saved by ``save_pretrained`` in bfloat16, in
several safetensors shards (``max_shard_size``) with an index, with its head tied the other way
from its float32 variant in ``hf_families`` (so every family is checked tied and untied; Mistral
tied, SmolLM3 and Gemma 3 untied are only here). On every engine, in float32 numerics:

- gold log-probs within 1e-5 of transformers' model loaded from the same folder in float32, and
  greedy tokens equal to its ``generate`` on a prompt past every window;
- the sharded folder scores streamed bit for bit as the same weights saved in one file score
  resident.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from spill.engines.base import GenerateParams
from tests.unit.engines import hf_families
from tests.unit.engines.kit import open_runner, same
from tests.unit.engines.test_families import LONG, NEW, ROWS, hf_log_probs

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_models):
    """variant -> (sharded folder, the same weights in one file)."""
    root = tmp_path_factory.mktemp("hf-stored")
    made = {}
    for k, (v, spec) in enumerate(hf_families.STORED.items()):
        pair = []
        for label, shard in (("sharded", hf_families.SHARD), ("whole", None)):
            pair.append(
                hf_families.make(
                    v,
                    root / f"{v}-{label}",
                    tiny_models["llama"],
                    seed=k,
                    spec=spec,
                    dtype="bfloat16",
                    max_shard_size=shard,
                )  # fmt: skip
            )
        made[v] = tuple(pair)
    return made


@pytest.fixture(params=list(hf_families.STORED))
def stored(request, folders):
    return request.param, *folders[request.param]


def test_the_folders_are_bf16_sharded_and_tied_as_asked(stored):
    name, sharded, whole = stored
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 2 and all((sharded / f).is_file() for f in files)
    assert (whole / "model.safetensors").is_file() and not list(whole.glob("*index.json"))
    config = json.loads((sharded / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    tied = hf_families.TIES[name]
    assert config["tie_word_embeddings"] is tied
    assert ("lm_head.weight" in index["weight_map"]) is not tied


def test_log_probs_and_greedy_match_transformers(engine, stored):
    name, folder, _ = stored
    hf = hf_families.load(folder)  # the bfloat16 weights, upcast to float32
    assert hf.lm_head.weight.dtype == torch.float32
    runner = open_runner(engine, folder, ring=2, dtype="float32")
    for prompt, completion, ours in zip(*ROWS, runner.score(*ROWS), strict=True):
        assert np.abs(ours - hf_log_probs(hf, prompt, completion)).max() <= 1e-5, name
    ours = runner.generate([LONG[0]], GenerateParams(max_new_tokens=NEW), [0])[0]
    out = hf.generate(torch.tensor(LONG[0])[None], do_sample=False, max_new_tokens=NEW)
    theirs = out[0, len(LONG[0]) :].tolist()
    assert ours.tokens.tolist() == theirs[: len(ours.tokens)] and len(ours.tokens) > 0, name
    runner.close()


def test_the_sharded_folder_streamed_scores_as_one_file_resident(engine, stored):
    _, sharded, whole = stored
    streamed = open_runner(engine, sharded, ring=2, dtype="float32")
    resident = open_runner(engine, whole, resident=True, dtype="float32")
    assert same(streamed.score(*ROWS), resident.score(*ROWS))
    streamed.close()
    resident.close()
