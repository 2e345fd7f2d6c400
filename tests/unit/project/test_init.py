"""``spill init``: a folder with spill.yaml, its schema and the data, nothing else; choices
written once."""

from __future__ import annotations

from pathlib import Path

import pytest

from spill.errors import DataError, SpillError
from spill.project.config import compose
from spill.project.init import init
from tests.unit.project.test_data import LABELED, write_csv

ROOT = Path(__file__).resolve().parents[3]


def test_init_writes_files_that_compose(tmp_path):
    data = write_csv(tmp_path / "tickets.csv", LABELED)
    out = init(data, "text", "label", tmp_path / "proj", seed=3)
    files = sorted(p.name for p in (tmp_path / "proj").iterdir())
    assert files == ["spill.schema.json", "spill.yaml", "tickets.csv"]
    assert (tmp_path / "proj" / "tickets.csv").read_bytes() == data.read_bytes()
    text = (tmp_path / "proj" / "spill.yaml").read_text()
    first = text.splitlines()[0]
    # a relative modeline to a copy of the schema: the project names no path of this machine
    assert first == "# yaml-language-server: $schema=spill.schema.json"
    assert str(tmp_path) not in text
    shipped = ROOT / "schemas" / "spill-yaml.schema.json"
    assert (tmp_path / "proj" / "spill.schema.json").read_bytes() == shipped.read_bytes()
    p = compose(tmp_path / "proj")
    assert (p.name, p.seed, p.data.task, p.data.file) == (
        "proj",
        3,
        "classification",
        "tickets.csv",
    )
    assert p.prompt.chat and "{labels}" in p.prompt.template  # the classify prompt
    assert p.engine.name in ("torch", "mlx") and p.teacher.name is None
    assert p.tune.micro_batch in (2, 4, 8) and p.id and len(p.id) == 12
    assert out["task"] == "classification" and out["labels"] == 3 and out["rows"] == 30
    assert "free memory" in text and "# 3 labels: a, b, c" in text


def test_model_and_teacher_given(tmp_path):
    data = write_csv(tmp_path / "d.csv", LABELED)
    init(data, "text", "label", tmp_path / "p", model="tiny:llama:1", teacher="qwen2.5:1.5b")
    p = compose(tmp_path / "p")
    assert p.model.name == "tiny:llama:1" and p.teacher.name == "qwen2.5:1.5b"
    text = (tmp_path / "p" / "spill.yaml").read_text()
    assert "- model: custom" in text and "- teacher: qwen2.5-1.5b" in text


def test_free_text_gets_the_chat_prompt(tmp_path):
    rows = [(f"question {i}", f"a free answer that differs {i}") for i in range(12)]
    data = write_csv(tmp_path / "qa.csv", rows, header=("q", "a"))
    out = init(data, "q", "a", tmp_path / "qa")
    p = compose(tmp_path / "qa")
    assert out["task"] == "generation" and p.data.task == "generation"
    assert p.prompt.template == "{input}" and p.prompt.chat


def test_refuses_a_folder_in_use_and_bad_data(tmp_path):
    data = write_csv(tmp_path / "d.csv", LABELED)
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("mine")
    with pytest.raises(SpillError, match="exists and is not empty"):
        init(data, "text", "label", tmp_path / "used")
    with pytest.raises(DataError, match="no column 'labl'"):
        init(data, "text", "labl", tmp_path / "new")
    single = write_csv(tmp_path / "s.csv", [("a", "x"), ("b", "x")])
    with pytest.raises(DataError, match="single label"):
        init(single, "text", "label", tmp_path / "new")
    assert not (tmp_path / "new").exists()
    assert (tmp_path / "used" / "x").read_text() == "mine"


def test_init_in_the_folder_that_holds_the_data(tmp_path):
    (tmp_path / "mine").mkdir()
    data = write_csv(tmp_path / "mine" / "d.csv", LABELED)
    init(data, "text", "label", tmp_path / "mine")
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == [
        "d.csv",
        "spill.schema.json",
        "spill.yaml",
    ]
    assert compose(tmp_path / "mine").data.file == "d.csv"


@pytest.mark.parametrize("drawn", ["968835431188", "1e1234567890", "000000000012"])
def test_an_id_that_reads_as_a_number_stays_a_string(tmp_path, monkeypatch, drawn):
    """The project id is 12 random hex digits: when they happen to read as a YAML number (CI drew
    968835431188 once), spill.yaml must still give a string."""
    import uuid

    class Fixed:
        hex = drawn + "0" * 20

    monkeypatch.setattr(uuid, "uuid4", lambda: Fixed)
    data = write_csv(tmp_path / "d.csv", LABELED)
    init(data, "text", "label", tmp_path / "p")
    assert compose(tmp_path / "p").id == drawn


HOSTILE = [  # each a label, a column name or both: data that must stay data in spill.yaml
    "x\nexport: {formats: [hf]}",
    "hydra:\n  run: {dir: /tmp/elsewhere}",
    "hydra: y",
    "a\u2028tune: {steps: 1}",  # YAML's own line breaks, which JSON leaves raw
    "b\x85seed: 7",
    "c\r\nname: evil",
    "${oc.env:HOME}",
    "\\${oc.env:HOME}\\",
    "# not a comment",
]


def test_labels_and_columns_are_data_in_spill_yaml(tmp_path):
    """A label or a column name holding a line break, ``hydra:``, ``${...}`` or ``#``: the
    generated spill.yaml has exactly init's top-level keys, and composes to the same texts."""
    import csv
    import subprocess
    import sys

    import yaml

    from spill.project.data import read_rows

    column_in, column_out = "text\nexport: {formats: [gguf]}", "${oc.env:HOME}\u2028hydra: x"
    data = tmp_path / "hostile.csv"
    with data.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow([column_in, column_out])
        w.writerows((f"row {i}", HOSTILE[i % len(HOSTILE)]) for i in range(3 * len(HOSTILE)))
    proc = subprocess.run(
        [sys.executable, "-m", "spill", "init", str(data), "--input", column_in,
         "--output", column_out, "--project", str(tmp_path / "p")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    text = (tmp_path / "p" / "spill.yaml").read_text(encoding="utf-8")
    doc = yaml.safe_load(text)
    keys = ["data", "defaults", "hydra", "id", "name", "schema_version", "seed", "tune"]
    assert sorted(doc) == keys  # init's own, nothing a value injected
    assert doc["hydra"] == {"searchpath": ["pkg://spill.conf"]}
    assert sorted(doc["data"]) == ["file", "input", "output", "task"]
    p = compose(tmp_path / "p")
    assert (p.data.input, p.data.output, p.data.file) == (column_in, column_out, "hostile.csv")
    assert p.tune.steps != 1 and p.seed == 0 and p.name == "p"
    rows = read_rows(tmp_path / "p" / p.data.file, p.data.input, p.data.output)
    assert {r.output for r in rows} == set(HOSTILE)
