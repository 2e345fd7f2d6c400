"""Preference rows: what a pair's tokens are, how a micro-batch of pairs is laid out, the one-line
refusals of a bad row, and the objectives' gradients against finite differences."""

import json

import numpy as np
import pytest

from spill.errors import DataError
from spill.jobs.tune.objectives import Dpo, Orpo
from spill.jobs.tune.pairs import load_pairs, pair_batch_at
from spill.models.tokenizer import Tokenizer


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_text_pair_is_the_prompt_then_each_answer_with_its_end(tmp_path, tiny_models):
    tok = Tokenizer(tiny_models["llama"])
    [pair] = load_pairs(
        _write(tmp_path / "p.jsonl", [{"prompt": "ab", "chosen": "c", "rejected": "de"}]), tok, 64
    )
    end = tok.token_id(tok.eos_token)
    assert pair.prompt == 2
    assert list(pair.chosen) == [97, 98, 99, end]
    assert list(pair.rejected) == [97, 98, 100, 101, end]


def test_a_chat_pair_ends_each_answer_as_the_template_does(tmp_path, tiny_models):
    tok = Tokenizer(tiny_models["qwen2"])
    row = {"messages": [{"role": "user", "content": "hi"}], "chosen": "yo", "rejected": "no"}
    [pair] = load_pairs(_write(tmp_path / "p.jsonl", [row]), tok, 256)
    head = tok.encode_chat(row["messages"], add_generation_prompt=True)
    assert list(pair.chosen[: pair.prompt]) == head
    said = tok.decode(pair.chosen[pair.prompt :], skip_special_tokens=False)
    assert said == "yo<|im_end|>\n"


def test_a_micro_batch_is_the_chosen_then_the_rejected(tmp_path, tiny_models):
    tok = Tokenizer(tiny_models["llama"])
    rows = [{"prompt": f"q{i}", "chosen": "a" * (i + 1), "rejected": "b"} for i in range(4)]
    pairs = load_pairs(_write(tmp_path / "p.jsonl", rows), tok, 64)
    b = pair_batch_at(pairs, 0, 0, 2, 0)
    assert b.pairs == 2 and b.tokens.shape[0] == 4
    for i, r in enumerate(b.rows):
        assert list(b.tokens[i, : len(pairs[r].chosen)]) == list(pairs[r].chosen)
        assert list(b.tokens[2 + i, : len(pairs[r].rejected)]) == list(pairs[r].rejected)
    assert (b.targets == b.answer).all() and not b.targets[:, : pairs[0].prompt].any()
    orpo = pair_batch_at(pairs, 0, 0, 2, 0, whole_chosen=True)
    assert (orpo.targets[:2, 1:] == orpo.attention[:2, 1:]).all()  # ORPO's NLL: whole sequence
    assert (orpo.targets[2:] == orpo.answer[2:]).all()


@pytest.mark.parametrize(
    "row, says",
    [
        ({"prompt": "x", "chosen": "a"}, "needs 'rejected'"),
        ({"prompt": "x", "rejected": "a"}, "needs 'chosen'"),
        ({"prompt": "x", "chosen": " ", "rejected": "a"}, "'chosen' is empty"),
        ({"prompt": "x", "chosen": "a", "rejected": ""}, "'rejected' is empty"),
        ({"prompt": "x", "chosen": "same", "rejected": "same"}, "are the same"),
        ({"chosen": "a", "rejected": "b"}, "needs 'prompt'"),
        ({"prompt": "x" * 80, "chosen": "a", "rejected": "b"}, "fills --seq-len 16"),
    ],
)
def test_a_bad_row_is_one_line_naming_its_place(tmp_path, tiny_models, row, says):
    tok = Tokenizer(tiny_models["llama"])
    good = {"prompt": "p", "chosen": "a", "rejected": "b"}
    path = _write(tmp_path / "p.jsonl", [good, row])
    with pytest.raises(DataError) as e:
        load_pairs(path, tok, 16)
    text = str(e.value)
    assert f"{path}:2" in text and says in text and "\n" not in text


@pytest.mark.parametrize("method", ["dpo", "orpo"])
def test_the_objective_weights_are_its_gradient(tmp_path, tiny_models, method):
    """d loss / d ce from the objective against central differences of its own loss."""
    tok = Tokenizer(tiny_models["llama"])
    rows = [{"prompt": f"q{i}", "chosen": "ab"[: i % 2 + 1], "rejected": "xyz"} for i in range(6)]
    pairs = load_pairs(_write(tmp_path / "p.jsonl", rows), tok, 64)
    batch = pair_batch_at(pairs, 0, 0, 3, 0, whole_chosen=method == "orpo")
    rows_, cols = np.nonzero(batch.targets[:, 1:])
    rng = np.random.default_rng(0)
    ce = rng.uniform(0.2, 3.0, len(rows_))

    def make():
        if method == "dpo":
            return Dpo(batch, 0.3, 0.5, rng_refs)
        return Orpo(batch, 0.3, 0.5)

    rng_refs = -rng.uniform(1, 10, (3, 2))
    _, weights = make()(ce, rows_, cols)
    eps = 1e-6
    for t in range(0, len(ce), 3):
        up, down = ce.copy(), ce.copy()
        up[t] += eps
        down[t] -= eps
        numeric = (make()(up, rows_, cols)[0] - make()(down, rows_, cols)[0]) / (2 * eps)
        assert weights[t] == pytest.approx(numeric, rel=1e-5, abs=1e-9)
