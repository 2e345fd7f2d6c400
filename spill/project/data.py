"""A project's data file -> the rows each stage reads, as deterministic JSONL bytes (``prepare``).

The file is CSV (a header row) or JSONL (one object per line); ``input`` and ``output`` name a
column or key. A row's id is its position among the data rows (1-based). The task is
``classification`` or ``generation`` (``detect_task``); both are graded by exact match and by the
gold answer's log-prob. The test split (``split``) and the validation rows (``carve``) depend on the
seed and the rows' content, not on their order, so moving rows changes nothing and editing one row
moves at most that row; the test rows are never validation rows.
"""

from __future__ import annotations

import csv
import hashlib
import json
import re
import string
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from spill.errors import DataError
from spill.jobs.inputs import jsonl_objects

MAX_LABELS = 50
MAX_LABEL_CHARS = 64
TEMPLATE_FIELDS = ("input", "labels")  # what a prompt template is filled in with


@dataclass(frozen=True)
class Row:
    id: int
    input: str
    output: str
    rejected: str | None = None  # a preference pair's worse answer (``data.rejected``)


@dataclass(frozen=True)
class Prepared:
    """What the stages read, as bytes; a pure function of (data file, config)."""

    task: str
    labels: tuple[str, ...]  # the label set (classification), else ()
    rows: int
    train: bytes  # training rows (prompt/completion or messages)
    test: bytes  # graded rows (prompt or messages, and answer)
    prompts: bytes  # the training inputs alone, for a teacher to answer
    n_train: int
    n_test: int
    valid: bytes = b""  # validation rows carved off the training rows (tune.valid), as train
    n_valid: int = 0

    def files(self) -> dict[str, bytes]:
        out = {"train.jsonl": self.train, "test.jsonl": self.test, "prompts.jsonl": self.prompts}
        return out | ({"valid.jsonl": self.valid} if self.n_valid else {})


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _cell(value, path: Path, where: str, col: str) -> str:
    if value is None or isinstance(value, (dict, list)):
        raise DataError(f"{path}: {where} has no text in {col!r}; fill it or remove the row")
    text = value if isinstance(value, str) else json.dumps(value)
    if not text.strip():
        raise DataError(f"{path}: {where} has an empty {col!r}; fill it or remove the row")
    return text


# characters in one CSV cell: real text (a long document) fits; memory stays bounded when a
# quote left open would make the rest of a file one cell (Python's default is 128 KiB)
CELL_LIMIT = 16 << 20


def _csv_records(path: Path) -> tuple[list[str], list[tuple[str, dict]]]:
    old = csv.field_size_limit(CELL_LIMIT)
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            reader = csv.DictReader(f)
            columns, records, start = [], [], 1  # start: the line the next record starts on
            try:
                columns = list(reader.fieldnames or [])
                start = reader.line_num + 1
                for rec in reader:
                    if any(rec.values()):
                        records.append((f"line {reader.line_num}", rec))
                    start = reader.line_num + 1
            except csv.Error as e:
                if "field larger than field limit" not in str(e):
                    raise
                raise DataError(_cell_too_long(path, start, columns)) from None
    finally:
        csv.field_size_limit(old)
    return columns, records


def _cell_too_long(path: Path, line: int, columns: list[str]) -> str:
    """The refusal of a record (starting on ``line``) with a cell over ``CELL_LIMIT``: the
    column and size of its longest cell, counted through the record again, line by line as
    the reader reads it, without keeping its text."""
    col = size = 0
    longest = (0, 0)  # (size, column)
    quoted = False
    with open(path, encoding="utf-8-sig", newline="") as f:
        for n, text in enumerate(f, 1):
            if n < line:
                continue
            pos = 0
            for m in re.finditer('""|[",]', text):
                size += m.start() - pos
                pos = m.end()
                if m.group() == '""':
                    size += quoted  # an escaped quote inside quotes; an empty cell outside
                elif m.group() == '"':
                    quoted = not quoted
                elif quoted:
                    size += 1
                else:
                    longest = max(longest, (size, col))
                    col, size = col + 1, 0
            size += len(text) - pos
            if not quoted:  # the record ends with this line
                size -= len(text) - len(text.rstrip("\r\n"))
                break
    size, col = max(longest, (size, col))
    name = repr(columns[col]) if col < len(columns) else f"{col + 1} (the header's)"
    return (
        f"{path}: line {line}, column {name}: a cell of {size:,} characters, past the limit of "
        f"{CELL_LIMIT:,} for one cell; shorten it or split the row (a quote left open before it "
        "makes the rest of the file one cell)"
    )


def _jsonl_records(path: Path) -> tuple[list[str], list[tuple[str, dict]]]:
    objects = jsonl_objects(path)
    columns = dict.fromkeys(k for _, obj in objects for k in obj)  # first-seen order
    return list(columns), [(f"line {lineno}", obj) for lineno, obj in objects]


def _records(path: Path, columns_needed: dict[str, str]) -> list[tuple[str, dict]]:
    """``(where, record)`` of every data row; a missing file or column fails in one line
    (``columns_needed``: column -> the setting that names it)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such data file; give a CSV or JSONL file")
    kind = path.suffix.lower()
    if kind not in (".csv", ".jsonl", ".json", ".ndjson"):
        raise DataError(f"{path}: not a .csv or .jsonl file; convert it to one of those")
    try:
        columns, records = (_csv_records if kind == ".csv" else _jsonl_records)(path)
    except (UnicodeDecodeError, csv.Error) as e:
        raise DataError(f"{path}: unreadable ({e}); save it as UTF-8 CSV or JSONL") from None
    if not records:
        raise DataError(f"{path}: no data rows; the file is empty")
    for col, flag in columns_needed.items():
        if col not in columns:
            have = ", ".join(repr(c) for c in columns) or "none"
            raise DataError(f"{path}: no column {col!r} ({flag}); the columns are {have}")
    return records


def read_rows(
    path: Path, input_col: str, output_col: str, rejected_col: str | None = None
) -> list[Row]:
    """Every data row; a missing file, column or value fails in one line naming it; with
    ``rejected_col`` each row is a preference pair whose two answers differ."""
    needed = {input_col: "--input/data.input", output_col: "--output/data.output"}
    if rejected_col is not None:
        needed[rejected_col] = "--rejected/data.rejected"
    out = []
    for i, (where, rec) in enumerate(_records(path, needed), 1):
        row = Row(
            i,
            _cell(rec.get(input_col), path, where, input_col),
            _cell(rec.get(output_col), path, where, output_col),
            _cell(rec.get(rejected_col), path, where, rejected_col) if rejected_col else None,
        )
        if row.rejected is not None and row.rejected.strip() == row.output.strip():
            raise DataError(
                f"{path}: {where} has the same {output_col!r} and {rejected_col!r}; a "
                "preference pair needs two different answers"
            )
        out.append(row)
    return out


def read_inputs(path: Path, input_col: str) -> list[tuple[str | int, str]]:
    """``(id, input)`` of every row of a file of new inputs, read as the project's data is: the
    id is the row's ``id`` column when it has one (each distinct), else its position (1-based)."""
    out: list[tuple[str | int, str]] = []
    seen: dict = {}
    for i, (where, rec) in enumerate(_records(path, {input_col: "the project's data.input"}), 1):
        rid = rec.get("id", i)
        if not isinstance(rid, (str, int)) or isinstance(rid, bool) or rid == "":
            raise DataError(f"{path}: {where} has an 'id' that is no string or integer")
        if rid in seen:
            raise DataError(f"{path}: {where} repeats the id {rid!r} of {seen[rid]}")
        seen[rid] = where
        out.append((rid, _cell(rec.get(input_col), path, where, input_col)))
    return out


# ``classification`` when the outputs form a closed label set (at most 50 distinct values, each
# short, and no more than half as many labels as rows), else ``generation`` (free text). The table
# leads with exact match for a classification and shows both for free text.
def detect_task(rows: list[Row]) -> str:
    counts = Counter(r.output for r in rows)
    closed = (
        len(counts) <= MAX_LABELS
        and len(counts) <= max(2, len(rows) // 2)
        and all(len(label) <= MAX_LABEL_CHARS for label in counts)
    )
    return "classification" if closed else "generation"


def check_rows(rows: list[Row], path: Path) -> None:
    if len(rows) < 2:
        raise DataError(
            f"{path}: {len(rows)} row; a project needs one to train on and one to grade"
        )
    labels = {r.output for r in rows}
    if len(labels) == 1:
        raise DataError(
            f"{path}: every row has the output {next(iter(labels))!r}; a single label teaches "
            "nothing, add rows with other outputs"
        )


def _keys(rows: list[Row], seed: int) -> dict[int, bytes]:
    seen: Counter = Counter()
    out = {}
    for r in rows:
        seen[(r.input, r.output)] += 1
        text = f"{seed}\0{r.input}\0{r.output}\0{seen[(r.input, r.output)]}"
        out[r.id] = hashlib.sha256(text.encode()).digest()
    return out


# A row goes to the test side when its key ``sha256(seed, input, output, n-th repeat)`` ranks among
# the lowest ``test_fraction`` of its label (classification: stratified, every label with two rows
# or more keeps one on each side) or of all rows (generation).
def split(
    rows: list[Row], seed: int, test_fraction: float, task: str, path: Path
) -> tuple[list[Row], list[Row]]:
    """``(train, test)`` in file order; see the comment above."""
    keys = _keys(rows, seed)
    groups: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        groups[r.output if task == "classification" else ""].append(r)
    test_ids: set[int] = set()
    for members in groups.values():
        n = len(members)
        k = round(n * test_fraction)
        if n >= 2:
            k = min(max(k, 1), n - 1)
        ranked = sorted(members, key=lambda r: keys[r.id])
        test_ids.update(r.id for r in ranked[:k])
    train = [r for r in rows if r.id not in test_ids]
    test = [r for r in rows if r.id in test_ids]
    if not test or not train:
        raise DataError(
            f"{path}: the split leaves no rows to {'grade' if not test else 'train on'}; "
            "add rows or change data.test_fraction"
        )
    return train, test


# Validation (``tune.valid``): the training rows whose key, hashed once more, ranks lowest are set
# aside for the tune stage's validation loss; the test rows never.
def carve(train: list[Row], seed: int, valid: float | None, path: Path) -> tuple[list, list]:
    """``(train, valid)``: ``valid`` rows (a count, or a fraction below 1) of the training rows
    for validation, chosen by a seeded key of their own (not the test split's, so they are a
    fair sample of what is left), each list in file order. The test rows are never touched."""
    if valid is None:
        return train, []
    k = round(len(train) * valid) if valid < 1 else int(valid)
    if not 1 <= k < len(train):
        raise DataError(
            f"{path}: tune.valid {valid} leaves {k} of the {len(train)} training rows to "
            f"validate and {len(train) - k} to train on; give at least 1 of each (or add rows)"
        )
    keys = _keys(train, seed)
    chosen = {
        r.id
        for r in sorted(train, key=lambda r: hashlib.sha256(b"valid\0" + keys[r.id]).digest())[:k]
    }
    return [r for r in train if r.id not in chosen], [r for r in train if r.id in chosen]


def _jsonl(records: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()


def template_problem(template: str) -> str | None:
    """What is wrong with a prompt template, or None: it may hold ``{input}`` and ``{labels}``
    and nothing else, no format spec (``{input:>300000000}`` pads to 300 MB) nor conversion."""
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as e:
        return f"is not a valid template ({e}); write {{{{ and }}}} for literal braces"
    for _, name, spec, conversion in parts:
        if name is None:
            continue
        if name not in TEMPLATE_FIELDS:
            return (
                f"uses {{{name}}}; only {{input}} and {{labels}} are filled in (write {{{{ and "
                "}} for literal braces)"
            )
        if spec or conversion:
            shown = (
                f"{{{name}{'!' + conversion if conversion else ''}{':' + spec if spec else ''}}}"
            )
            return f"has {shown[:40]}; write {{{name}}} alone (no format spec or conversion)"
    return None


def prompt_of(text: str, labels: tuple[str, ...], template: str, chat: bool) -> dict:
    """The model's side of a row for an input: ``{"prompt"}``, or ``{"messages"}`` (one user
    turn) when ``chat``; ``spill predict`` asks a tuned model the same way."""
    text = template.format(input=text, labels=", ".join(labels))
    return {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}


def render(
    train: list[Row],
    test: list[Row],
    labels: tuple[str, ...],
    template: str,
    chat: bool,
    pairs: bool = False,
) -> tuple[bytes, bytes, bytes]:
    """(training rows, graded rows, teacher prompts) for a prompt template; ``pairs``: the
    training rows are preference pairs (``{prompt|messages, chosen, rejected}``)."""

    def prompt(r: Row) -> dict:
        return prompt_of(r.input, labels, template, chat)

    def trained(r: Row) -> dict:
        p = prompt(r)
        if pairs:
            return {"id": r.id, **p, "chosen": r.output, "rejected": r.rejected}
        if chat:
            return {
                "id": r.id,
                "messages": [*p["messages"], {"role": "assistant", "content": r.output}],
            }
        return {"id": r.id, **p, "completion": r.output}

    graded = [
        {"id": r.id, **prompt(r), "answer": r.output, "input": r.input}
        | ({"rejected": r.rejected} if r.rejected is not None else {})
        for r in test
    ]
    return (
        _jsonl([trained(r) for r in train]),
        _jsonl(graded),
        _jsonl([{"id": r.id, **prompt(r)} for r in train]),
    )


def prepare(
    path: Path,
    input_col: str,
    output_col: str,
    task: str,
    seed: int,
    test_fraction: float,
    template: str,
    chat: bool,
    valid: float | None = None,
    rejected_col: str | None = None,
    method: str = "sft",
) -> Prepared:
    """``rejected_col``: each row a preference pair (graded on preference too); ``method``: the
    tune's, whose training rows are pairs unless it is ``sft`` (trained on the chosen answers)."""
    if method != "sft" and rejected_col is None:
        raise DataError(
            f"tune.method {method} trains on preference pairs; set data.rejected to the column "
            "of the worse answer (spill init --rejected COL)"
        )
    rows = read_rows(path, input_col, output_col, rejected_col)
    check_rows(rows, path)
    task = detect_task(rows) if task == "auto" else task
    labels = tuple(sorted({r.output for r in rows})) if task == "classification" else ()
    if task == "classification" and len(labels) > MAX_LABELS:
        raise DataError(
            f"{path}: {len(labels)} distinct outputs is no closed label set; "
            "set data.task: generation"
        )
    train, test = split(rows, seed, test_fraction, task, path)
    train, held = carve(train, seed, valid, path)
    pairs = method != "sft"
    tr, te, pr = render(train, test, labels, template, chat, pairs)
    va = render(held, [], labels, template, chat, pairs)[0]
    return Prepared(task, labels, len(rows), tr, te, pr, len(train), len(test), va, len(held))
