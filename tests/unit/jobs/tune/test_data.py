import json
import math

import numpy as np
import pytest

from spill.errors import DataError
from spill.jobs.schedule import cosine_lr
from spill.jobs.tune.data import load_examples, micro_batch_at
from spill.models.tokenizer import Tokenizer


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_prompt_completion_targets_only_completion(tmp_path, tiny_models):
    tok = Tokenizer(tiny_models["llama"])
    ex = load_examples(
        _write(tmp_path / "d.jsonl", [{"prompt": "ab", "completion": "cd"}]), tok, 64
    )[0]
    assert list(ex.ids) == [97, 98, 99, 100, tok.eos_ids[0]]
    assert list(ex.targets) == [False, False, True, True, True]


def test_messages_target_assistant_turns_only(tmp_path, tiny_models):
    tok = Tokenizer(tiny_models["qwen2"])
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "z"},
    ]
    ex = load_examples(_write(tmp_path / "d.jsonl", [{"messages": msgs}]), tok, 256)[0]
    learned = tok.decode(ex.ids[ex.targets], skip_special_tokens=False)
    assert learned == "yo<|im_end|>\nz<|im_end|>\n"
    assert tok.decode(ex.ids, skip_special_tokens=False) == tok.apply_chat_template(
        msgs, add_generation_prompt=False
    )


def test_text_rows_and_errors(tmp_path, tiny_models):
    tok = Tokenizer(tiny_models["llama"])
    ex = load_examples(_write(tmp_path / "d.jsonl", [{"text": "abc"}]), tok, 64)[0]
    assert list(ex.targets) == [False, True, True]
    with pytest.raises(DataError, match="needs 'prompt' and 'completion'"):
        load_examples(_write(tmp_path / "e.jsonl", [{"prompt": "x"}]), tok, 64)
    with pytest.raises(DataError, match="nothing to learn within --seq-len 2"):
        load_examples(
            _write(tmp_path / "f.jsonl", [{"prompt": "abcdef", "completion": "g"}]), tok, 2
        )


def test_micro_batches_are_a_pure_function_and_cover_each_epoch(tmp_path, tiny_models):
    tok = Tokenizer(tiny_models["llama"])
    rows = [{"prompt": "p" * (i % 5 + 1), "completion": str(i)} for i in range(10)]
    exs = load_examples(_write(tmp_path / "d.jsonl", rows), tok, 64)
    a = [micro_batch_at(exs, 3, i, 2, tok.pad_id) for i in range(10)]
    b = [micro_batch_at(exs, 3, i, 2, tok.pad_id) for i in reversed(range(10))][::-1]
    for x, y in zip(a, b, strict=True):
        assert (
            x.rows == y.rows
            and np.array_equal(x.tokens, y.tokens)
            and np.array_equal(x.targets, y.targets)
        )
    epoch0 = sorted(r for mb in a[:5] for r in mb.rows)
    assert epoch0 == list(range(10))
    assert [mb.rows for mb in a[:5]] != [mb.rows for mb in a[5:]]  # each epoch reshuffles
    assert (
        a[0].rows != micro_batch_at(exs, 4, 0, 2, tok.pad_id).rows
        or a[1].rows != micro_batch_at(exs, 4, 1, 2, tok.pad_id).rows
    )
    mb = a[0]
    assert not mb.targets[:, 0].any() and not (mb.targets & ~mb.attention).any()


def test_cosine_schedule():
    assert cosine_lr(0, 1.0, 0, 10) == 1.0
    assert cosine_lr(0, 1.0, 4, 10) == 0.0 and cosine_lr(2, 1.0, 4, 10) == 0.5
    assert math.isclose(cosine_lr(7, 1.0, 4, 10), 0.5)
    assert cosine_lr(10, 1.0, 4, 10) == 0.0
