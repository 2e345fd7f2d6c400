"""Reading row inputs (JSONL) with one-line errors that name the file and line."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from spill.errors import DataError


def read_jsonl(path: Path) -> list[tuple[int, dict]]:
    """``(line number, object)`` for every non-blank line of a JSONL file."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file; give a JSONL file with one JSON object per line")
    rows = jsonl_objects(path)
    if not rows:
        raise DataError(f"{path}: no rows; the file is empty")
    return rows


_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")  # an escaped UTF-16 surrogate, maybe lone


def jsonl_objects(path: Path) -> list[tuple[int, dict]]:
    """``(line number, object)`` for every non-blank line; none for an empty file. A line that
    is not UTF-8, nests too deeply for the parser or holds a lone surrogate (``"\\ud800"``: no
    text, the tokenizer cannot take it) fails here, in one line naming it."""
    rows = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise DataError(f"{where}: not UTF-8 text; save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{where}: not valid JSON ({e.msg}); fix or remove that line"
                ) from None
            except RecursionError:
                raise DataError(
                    f"{where}: JSON nested too deeply to read; flatten that line"
                ) from None
            if not isinstance(obj, dict):
                raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            if _SURROGATE.search(raw):
                try:
                    json.dumps(obj, ensure_ascii=False).encode("utf-8")
                except UnicodeEncodeError:
                    raise DataError(
                        f"{where}: a string holds a lone surrogate escape (such as \\ud800), "
                        "which is no text; fix or remove that line"
                    ) from None
            rows.append((lineno, obj))
    return rows


@dataclass(frozen=True)
class PromptRow:
    id: str | int
    prompt: str | None
    messages: list[dict] | None


def _messages(path: Path, lineno: int, messages) -> list[dict]:
    ok = (
        isinstance(messages, list)
        and messages
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in messages
        )
    )
    if not ok:
        raise DataError(
            f'{path}:{lineno}: \'messages\' must be a non-empty list of {{"role": ..., "content": ...}} objects'
        )
    return messages


def read_prompt_rows(path: Path) -> list[PromptRow]:
    """Rows ``{"id", "prompt"}`` or ``{"id", "messages"}``; ids default to the line number."""
    out, seen = [], {}
    for lineno, obj in read_jsonl(path):
        rid = obj.get("id", lineno)
        if not isinstance(rid, (str, int)) or isinstance(rid, bool):
            raise DataError(f"{path}:{lineno}: 'id' must be a string or an integer")
        if rid in seen:
            raise DataError(
                f"{path}:{lineno}: id {rid!r} repeats line {seen[rid]}; ids must be unique"
            )
        seen[rid] = lineno
        if "messages" in obj:
            out.append(PromptRow(rid, None, _messages(path, lineno, obj["messages"])))
        elif isinstance(obj.get("prompt"), str):
            out.append(PromptRow(rid, obj["prompt"], None))
        else:
            raise DataError(
                f"{path}:{lineno}: row has no 'prompt' (a string) or 'messages' (a list); add one"
            )
    return out
