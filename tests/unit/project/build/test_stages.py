"""The stage objects: one vocabulary the planner, executor and tables ask, and no other module
of ``spill.project`` that branches on a stage name or imports in a circle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from spill.project.build import stages
from spill.store.location import location

STAGES_PKG = Path(stages.__file__).parent
PROJECT = STAGES_PKG.parents[1]


def test_each_stage_says_what_it_is():
    by = {s.name: s for s in stages.STAGES}
    assert list(by) == ["eval:base", "distill", "tune", "eval", "export"]
    assert [s.unit for s in stages.STAGES] == ["row", "row", "step", "row", "format"]
    assert [s.uri(location("memory://x")) for s in stages.STAGES] == [
        f"memory://x/stages/{d}" for d in ("eval-base", "distill", "tune", "eval", "export")
    ]
    assert [s.output("toy") for s in stages.STAGES] == [
        "files/eval-base.jsonl",
        "files/teacher.jsonl",
        "adapters/toy",
        "files/eval.jsonl",
        "exports/toy",
    ]
    for s in stages.STAGES:  # each runs its own job
        assert type(s).execute is not stages.Stage.execute, s
        assert type(s).inputs is not stages.Stage.inputs, s
    assert [s.model_key for s in stages.STAGES] == ["model.name", "teacher.name"] + [
        "model.name"
    ] * 3
    for i, s in enumerate(stages.STAGES):  # a stage reads only stages before it
        assert set(s.needs) <= set(stages.NAMES[:i])
    assert by["tune"].count_name() == "tune.steps" and by["eval"].count_name() == "eval's rows"
    with pytest.raises(KeyError):
        stages.get("train")  # an alias is the command line's, resolved by StopAfter


def test_summaries():
    assert stages.TUNE.summarize({"step": 3, "steps": 9, "loss": 1.23456}) == (
        "3 of 9 steps, loss 1.2346"
    )
    graded = {"rows": 4, "correct": 3, "accuracy": 0.75, "gold_logprob_per_token": -0.5}
    assert stages.EVAL.summarize(graded) == "accuracy 0.750 (3/4), logprob/token -0.500"
    assert stages.EVAL_BASE.summarize({"rows": 4, "accuracy": None}) == "4 rows graded"
    assert stages.DISTILL.summarize({"rows": 5, "truncated": 2}) == (
        "5 rows answered, 2 cut at max_new_tokens"
    )
    assert all(s.summarize({}) == "" for s in stages.STAGES)
    made = {"dtype": "bf16", "quantize": None, "files": 7, "bytes": 3 * 2**20, "dequantized": 0}
    gguf = {**made, "quantize": "q8_0", "bytes": 2**20}
    assert stages.EXPORT.summarize({"formats": {"hf": made, "gguf": gguf}}) == (
        "gguf q8_0, hf bf16 (4.0 MiB)"
    )


# a stage name compared, tested for membership, or used as a dict key with a value
BRANCH = re.compile(
    r"""(==|!=|\bin)\s*\(?\s*["'](eval:base|distill|tune|eval)["']"""
    r"""|["'](eval:base|distill|tune|eval)["']\s*(==|!=|:\s*(self\.|"|\w+\[))"""
)
# config.py, init.py and data.py name config groups (``tune.lr``), not stages
VOCABULARY_FREE = sorted(
    p
    for p in PROJECT.rglob("*.py")
    if STAGES_PKG not in p.parents and p.name not in ("config.py", "init.py", "data.py")
)


@pytest.mark.parametrize("path", VOCABULARY_FREE, ids=lambda p: p.relative_to(PROJECT).as_posix())
def test_no_module_branches_on_a_stage_name(path):
    hits = [
        f"{path.relative_to(PROJECT)}:{n}: {line.strip()}"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if BRANCH.search(line)
    ]
    assert not hits, "ask the stage object instead:\n" + "\n".join(hits)


def _imports(path: Path) -> set[str]:
    """The spill.project modules a module imports anywhere (functions too), except for typing."""
    tree = ast.parse(path.read_text())
    skip = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip or not isinstance(node, ast.ImportFrom) or not node.module:
            continue
        if node.module.startswith("spill.project."):
            for a in node.names:  # a module of a package counts as that module
                sub = PROJECT.parent.parent.joinpath(*node.module.split("."), a.name)
                named = f"{node.module}.{a.name}" if sub.with_suffix(".py").is_file() else ""
                out.add(_short(named or node.module))
    return out - {_short(_name(path))}


def _name(path: Path) -> str:
    """``spill.project.build.plan`` for ``spill/project/build/plan.py`` (a package: its folder)."""
    rel = path.relative_to(PROJECT.parent.parent).with_suffix("")
    return ".".join(rel.parts).removesuffix(".__init__")


def _short(module: str) -> str:
    """A module's name below ``spill.project``, the stages package as one (``build.stages``)."""
    short = module.removeprefix("spill.project.")
    return "build.stages" if short.startswith("build.stages") else short


def test_project_imports_form_no_circle():
    graph: dict[str, set[str]] = {}
    for p in PROJECT.rglob("*.py"):
        graph.setdefault(_short(_name(p)), set()).update(_imports(p))
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        if seen.get(name) == 2:
            return
        assert seen.get(name) != 1, "import circle: " + " -> ".join([*path, name])
        seen[name] = 1
        for dep in sorted(graph.get(name, ())):
            visit(dep, [*path, name])
        seen[name] = 2

    for name in sorted(graph):
        visit(name, [])
    assert "build.record" not in graph["build.plan"]
    assert graph["build.stages"] <= {"build.outputs", "data", "bundle.installed"}
