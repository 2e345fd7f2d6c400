import pytest

from spill.errors import DataError
from spill.jobs.inputs import read_prompt_rows


def test_ids_default_to_line_numbers(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_text('{"prompt": "a"}\n\n{"id": "x", "messages": [{"role": "user", "content": "b"}]}\n')
    rows = read_prompt_rows(p)
    assert (
        [r.id for r in rows] == [1, "x"]
        and rows[0].prompt == "a"
        and rows[1].messages[0]["content"] == "b"
    )


@pytest.mark.parametrize(
    "text,message",
    [
        ("[1, 2]\n", "expected a JSON object"),
        ('{"id": true, "prompt": "a"}\n', "'id' must be"),
        ('{"id": 1, "messages": []}\n', "'messages' must be"),
    ],
)
def test_bad_rows(tmp_path, text, message):
    p = tmp_path / "in.jsonl"
    p.write_text(text)
    with pytest.raises(DataError, match=message):
        read_prompt_rows(p)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        read_prompt_rows(tmp_path / "nope.jsonl")
