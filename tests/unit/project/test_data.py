"""A project's data file -> split and rendered rows: deterministic, stratified, one-line errors."""

from __future__ import annotations

import csv
import io
import json
import re

import pytest

from spill.errors import DataError
from spill.project.data import (
    Row,
    detect_task,
    prepare,
    prompt_of,
    read_inputs,
    read_rows,
    split,
)


def write_csv(path, rows, header=("text", "label")):
    import csv

    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


LABELED = [(f"item {i} {'abc'[i % 3]}", "abc"[i % 3]) for i in range(30)]


def test_csv_and_jsonl_read_the_same(tmp_path):
    a = read_rows(write_csv(tmp_path / "d.csv", LABELED), "text", "label")
    jl = tmp_path / "d.jsonl"
    jl.write_text("".join(json.dumps({"text": t, "label": y, "x": 1}) + "\n" for t, y in LABELED))
    assert read_rows(jl, "text", "label") == a
    assert a[0] == Row(1, "item 0 a", "a")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("text,label\n", "no data rows; the file is empty"),
        ("", "no data rows"),
        (
            "text,labl\nhi,a\n",
            "no column 'label' (--output/data.output); the columns are 'text', 'labl'",
        ),
        ("text,label\nhi,\n", "line 2 has an empty 'label'"),
    ],
    ids=["header only", "empty", "missing column", "empty cell"],
)
def test_bad_files(tmp_path, content, message):
    path = tmp_path / "d.csv"
    path.write_text(content)
    with pytest.raises(DataError) as err:
        read_rows(path, "text", "label")
    assert message in str(err.value) and str(path) in str(err.value)


def test_single_label_and_too_few_rows(tmp_path):
    one = write_csv(tmp_path / "one.csv", [("a", "x"), ("b", "x"), ("c", "x")])
    with pytest.raises(DataError, match="every row has the output 'x'; a single label"):
        prepare(one, "text", "label", "auto", 0, 0.2, "{input}", False)
    tiny = write_csv(tmp_path / "tiny.csv", [("a", "x")])
    with pytest.raises(DataError, match="1 row; a project needs one to train on"):
        prepare(tiny, "text", "label", "auto", 0, 0.2, "{input}", False)


def test_task_detection():
    rows = [Row(i, f"q{i}", "abc"[i % 3]) for i in range(30)]
    assert detect_task(rows) == "classification"
    free = [Row(i, f"q{i}", f"a long free answer number {i}") for i in range(30)]
    assert detect_task(free) == "generation"


def test_split_is_stratified_seeded_and_content_based(tmp_path):
    rows = read_rows(write_csv(tmp_path / "d.csv", LABELED), "text", "label")
    train, test = split(rows, 0, 0.2, "classification", tmp_path)
    assert len(test) == 6 and sorted(r.output for r in test) == ["a", "a", "b", "b", "c", "c"]
    assert split(rows, 0, 0.2, "classification", tmp_path) == (train, test)
    assert split(rows, 1, 0.2, "classification", tmp_path)[1] != test
    # reordering the file changes nothing; each row keeps its side
    shuffled = read_rows(write_csv(tmp_path / "r.csv", LABELED[::-1]), "text", "label")
    assert {r.input for r in split(shuffled, 0, 0.2, "classification", tmp_path)[1]} == {
        r.input for r in test
    }


def test_rendered_rows(tmp_path):
    path = write_csv(tmp_path / "d.csv", LABELED)
    plain = prepare(path, "text", "label", "auto", 0, 0.2, "Q: {input}\n", False)
    assert plain.task == "classification" and plain.labels == ("a", "b", "c")
    first = json.loads(plain.train.splitlines()[0])
    assert set(first) == {"id", "prompt", "completion"} and first["prompt"].startswith("Q: item")
    graded = json.loads(plain.test.splitlines()[0])
    assert set(graded) == {"id", "prompt", "answer", "input"}  # the input, for people to read
    assert graded["prompt"] == f"Q: {graded['input']}\n"
    chat = prepare(path, "text", "label", "auto", 0, 0.2, "Pick {labels}: {input}", True)
    first = json.loads(chat.train.splitlines()[0])
    assert [m["role"] for m in first["messages"]] == ["user", "assistant"]
    assert first["messages"][0]["content"].startswith("Pick a, b, c: item")
    assert (plain.n_train, plain.n_test) == (24, 6)
    assert prepare(path, "text", "label", "auto", 0, 0.2, "Q: {input}\n", False) == plain


def test_new_inputs_are_read_as_the_data_is(tmp_path):
    """``spill predict``'s rows: the input column alone, ids from an ``id`` column or the row's
    position, a row without the input named in one line."""
    plain = write_csv(tmp_path / "new.csv", [("hello there",), ("second",)], header=("text",))
    assert read_inputs(plain, "text") == [(1, "hello there"), (2, "second")]
    jl = tmp_path / "new.jsonl"
    jl.write_text('{"id": "a", "text": "one"}\n\n{"id": 7, "text": "two", "label": "x"}\n')
    assert read_inputs(jl, "text") == [("a", "one"), (7, "two")]
    assert prompt_of("one", ("x", "y"), "{input} ({labels})?", True) == {
        "messages": [{"role": "user", "content": "one (x, y)?"}]
    }
    assert prompt_of("one", (), "Q: {input}", False) == {"prompt": "Q: one"}

    cases = {
        '{"text": "one"}\n{"body": "two"}\n': "line 2 has no text in 'text'",
        '{"body": "two"}\n': "no column 'text' (the project's data.input)",
        '{"id": 1, "text": "a"}\n{"id": 1, "text": "b"}\n': "line 2 repeats the id 1 of line 1",
        '{"id": [1], "text": "a"}\n': "'id' that is no string or integer",
    }
    for content, message in cases.items():
        jl.write_text(content)
        with pytest.raises(DataError, match=re.escape(message)) as e:
            read_inputs(jl, "text")
        assert "\n" not in str(e.value)


def ids(jsonl: bytes) -> list[int]:
    return [json.loads(line)["id"] for line in jsonl.splitlines()]


def test_validation_rows_come_off_the_training_rows_only(tmp_path):
    path = write_csv(tmp_path / "d.csv", LABELED)
    whole = prepare(path, "text", "label", "auto", 0, 0.2, "Q: {input}\n", False)
    assert whole.n_valid == 0 and "valid.jsonl" not in whole.files()  # the files of before
    for valid, n in ((5, 5), (0.25, 6)):  # a count, or a fraction of the 24 training rows
        p = prepare(path, "text", "label", "auto", 0, 0.2, "Q: {input}\n", False, valid)
        assert (p.n_train, p.n_valid, p.n_test) == (24 - n, n, 6)
        assert p.test == whole.test  # the graded rows never change
        assert sorted(ids(p.train) + ids(p.valid)) == sorted(ids(whole.train))
        assert ids(p.valid) == sorted(ids(p.valid))  # file order
        assert set(json.loads(p.valid.splitlines()[0])) == {"id", "prompt", "completion"}
        assert p == prepare(path, "text", "label", "auto", 0, 0.2, "Q: {input}\n", False, valid)
        assert p.files()["valid.jsonl"] == p.valid
    other = prepare(path, "text", "label", "auto", 1, 0.2, "Q: {input}\n", False, 5)
    assert ids(other.valid) != ids(
        prepare(path, "text", "label", "auto", 0, 0.2, "Q", False, 5).valid
    )
    for bad in (24, 30):
        with pytest.raises(DataError, match=f"tune.valid {bad} leaves .* give at least 1 of each"):
            prepare(path, "text", "label", "auto", 0, 0.2, "Q: {input}\n", False, bad)


def test_validation_settings_are_stage_inputs_only_when_validation_is_on():
    from spill.conf import defaults

    from spill.settings import TuneSettings, stage_inputs

    off = stage_inputs("tune", TuneSettings(**defaults("tune")))
    assert not {"tune.valid", "tune.eval_every", "tune.keep_best"} & set(off)
    on = stage_inputs("tune", TuneSettings(**{**defaults("tune"), "valid": 0.1}))
    assert {"tune.valid": 0.1, "tune.eval_every": 10, "tune.keep_best": False}.items() <= on.items()


def test_a_cell_past_pythons_128_kib_default_is_read(tmp_path):
    """Real text (a 300 KB document) fits the 16 MiB limit; the process's own limit is kept."""
    before = csv.field_size_limit()
    long = "word " * 60_000
    rows = read_rows(write_csv(tmp_path / "d.csv", [("a", "x"), (long, "y")]), "text", "label")
    assert rows[1].input == long and len(long) > 128 * 1024
    assert csv.field_size_limit() == before


@pytest.mark.parametrize(
    "record, column",
    [('a,"{cell}"\n', "label"), ('"{cell}",y\n', "text"), ('"x\n{cell}\ny""z",y\n', "text")],
    ids=["unquoted", "quoted", "lines and an escaped quote"],
)
def test_a_cell_past_the_limit_names_its_line_column_and_size(
    tmp_path, monkeypatch, record, column
):
    """The limit made small: the refusal counts the cell again (quotes, escaped quotes and line
    breaks as the reader counts them) without keeping it."""
    from spill.project import data

    monkeypatch.setattr(data, "CELL_LIMIT", 100)
    path = tmp_path / "d.csv"
    cell = "w," * 60  # 120 characters
    path.write_text("text,label\nhi,x\n" + record.format(cell=cell) + "ok,x\n")
    with pytest.raises(DataError) as err:
        read_rows(path, "text", "label")
    (cells,) = csv.reader(io.StringIO(record.format(cell=cell), newline=""))
    size = len(cells[0 if column == "text" else 1])
    assert size > 100
    assert str(err.value) == (
        f"{path}: line 3, column {column!r}: a cell of {size:,} characters, past the limit of 100 "
        "for one cell; shorten it or split the row (a quote left open before it makes the rest "
        "of the file one cell)"
    )
