"""The shape of the house (STYLE.md): imports point down, torch and mlx stay behind the engine
seam, modules stay small, and every shipped JSON Schema is itself valid."""

from __future__ import annotations

import ast
import functools
import json
import re
from pathlib import Path

import pytest

from tests.conftest import ENGINES, assert_not_imported

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "spill"
HEAVY = re.compile(r"^\s*(import|from)\s+(torch|mlx|transformers|peft)\b", re.MULTILINE)
FAMILY_BUDGET, BUDGET = 300, 400
# "spill/path.py" or "bench/name.py": lines, with a reason next to each
EXCEPTIONS: dict[str, int] = {}
# The floors of spill/, each with the floors it rests on directly. A module may import its own
# floor and every floor below it, and nothing else: not in a function, not under TYPE_CHECKING.
FLOORS: dict[str, tuple[str, ...]] = {
    "ground": (),  # GROUND: imports nothing of spill but GROUND
    "store": ("ground",),  # locations, atomic and conditional writes, byte formats, drills
    "models": ("store",),  # families, names, sources, weight files, fingerprints
    "engines": ("models",),  # the engine seam: the only floor that imports torch or mlx
    "control": ("store",),  # control objects, leases, fencing, payload pointers, moves
    "payloads": ("control",),  # checkpoints and row segments in a run's payload folders
    "jobs": ("payloads", "engines"),  # tune and row jobs, preemption
    "project": ("jobs",),  # spill.yaml, plan, build, move, bundle
    "examples": ("project",),  # the relay: run by the cli only
    "serve": ("project",),  # the OpenAI-compatible server: run by the cli only
    "cli": ("examples", "serve"),  # argument parsing and printing: nothing imports it
}
GROUND = {  # spill/<name>.py or spill/<name>/, and the data packages installed beside them
    *("__init__", "errors", "console", "ground"),
    "settings",
    *("conf", "schemas", "projects", "reports"),
}
CLI = {"cli", "__main__"}


def _modules():
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def test_heavy_imports_only_in_engines():
    rels = [str(p.relative_to(ROOT)) for p in _modules()]
    leaks = [
        r
        for r in rels
        if not r.startswith("spill/engines/") and HEAVY.search((ROOT / r).read_text())
    ]
    assert not leaks, f"torch/mlx imported outside spill/engines/: {leaks}"


def _floor(name: str) -> str:
    """The floor of ``spill`` or ``spill.<part>...`` (a module, or a name imported from one)."""
    head = name.split(".")[1] if "." in name else "__init__"
    return "cli" if head in CLI else head if head in FLOORS else "ground"


def _below(floor: str) -> set[str]:
    """Every floor that ``floor`` rests on, directly or through another."""
    out: set[str] = set()
    for f in FLOORS[floor]:
        out |= {f, *_below(f)}
    return out


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every ``spill`` name ``path`` imports, at module level, in a function or under
    ``TYPE_CHECKING`` alike (``from a import b`` counts as ``a.b``: ``b`` may be a module)."""
    package = list(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                up = package[: len(package) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return [(n, m) for n, m in out if m == "spill" or m.startswith("spill.")]


@functools.cache
def _all_arrows() -> tuple[tuple[str, str, str], ...]:
    """(importing floor, imported floor, "path imports name") for every import between two
    floors."""
    out = []
    for p in _modules():
        mine = _floor(".".join(p.relative_to(ROOT).with_suffix("").parts))
        for _, name in _imports(p):
            if _floor(name) != mine:
                out.append((mine, _floor(name), f"{p.relative_to(ROOT)} imports {name}"))
    return tuple(out)


def _arrows() -> list[tuple[str, str, str]]:
    return list(_all_arrows())


def test_every_part_of_spill_has_a_floor():
    """A new package or top-level module of spill/ is given its floor here first."""
    parts = {p.stem for p in PKG.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    unknown = parts - set(FLOORS) - GROUND - CLI
    assert not unknown, f"add to FLOORS, GROUND or CLI: {sorted(unknown)}"
    assert set(FLOORS) - {"ground"} <= parts | {"cli"}, "a floor that no longer exists"


def test_floors_import_only_floors_below():
    bad = [w for a, b, w in _arrows() if b not in _below(a)]
    assert not bad, bad


def test_no_circle_between_floors():
    """Neither the table nor the imports themselves go round: a walk from any floor along its
    imports never comes back to it."""
    graph: dict[str, set[str]] = {f: set(below) for f, below in FLOORS.items()}
    for a, b, _ in _arrows():
        graph[a].add(b)

    def circle(at: str, path: tuple[str, ...]) -> tuple[str, ...] | None:
        if at in path:
            return (*path[path.index(at) :], at)
        return next(filter(None, (circle(b, (*path, at)) for b in sorted(graph[at]))), None)

    circles = list(filter(None, (circle(f, ()) for f in sorted(graph))))
    assert not circles, circles[0]


def _module_graph() -> dict[str, set[str]]:
    """Each module of spill/ with the modules it imports (a package is its ``__init__``; a name
    imported from a module counts as that module), in functions and under TYPE_CHECKING too."""
    mods = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
        for p in _modules()
    }
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        for _, name in _imports(p):
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name and name != m:
                graph[m].add(name)
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of two or more modules (Tarjan's walk, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                part = stack[stack.index(v) :]
                del stack[stack.index(v) :]
                if len(part) > 1:
                    out.append(sorted(part))
    return out


def test_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_circle_between_modules():
    """No two modules of spill/ import each other, directly or round a longer path (STYLE.md: a
    circle means two modules are one concept, or a third is missing)."""
    circles = _circles(_module_graph())
    assert not circles, f"{len(circles)} circles: {circles}"


def test_no_module_imports_another_modules_private_name():
    """A leading underscore says a name is its module's own; a name another module needs is
    public."""
    bad = [
        f"{p.relative_to(ROOT)}:{node.lineno} imports {node.module}.{a.name}"
        for p in _modules()
        for node in ast.walk(ast.parse(p.read_text(), str(p)))
        if isinstance(node, ast.ImportFrom) and node.module != "__future__"
        for a in node.names
        if a.name.startswith("_") and not a.name.startswith("__")
    ]
    assert not bad, bad


def test_store_imports_no_floor_above_it():
    above = {"control", "models", "payloads", "jobs", "project", "engines", "examples", "cli"}
    bad = [w for a, b, w in _arrows() if a == "store" and b in above]
    assert not bad, bad


def test_nothing_below_the_cli_imports_it():
    bad = [w for a, b, w in _arrows() if b == "cli"]
    assert not bad, bad


def test_shared_command_line_names_are_defined_once():
    """The job verbs and the engine flags have one definition, in spill/cli/options.py."""
    names = ("JOB_VERBS", "ENGINE_FLAGS", "engine_options", "engine_overrides")
    found: dict[str, list[str]] = {n: [] for n in names}
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                defined = [node.name]
            elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                defined = [t.id for t in targets if isinstance(t, ast.Name)]
            else:
                continue
            for n in defined:
                if n in found:
                    found[n].append(f"{p.relative_to(ROOT)}:{node.lineno}")
    where = {n: [w.split(":")[0] for w in at] for n, at in found.items()}
    assert where == {n: ["spill/cli/options.py"] for n in names}, found


def test_line_budget():
    """spill/ and bench/: the benchmarks are read and changed like the package."""
    bench = sorted((ROOT / "bench").rglob("*.py"))
    over = []
    for p in [*_modules(), *bench]:
        rel = str(p.relative_to(ROOT))
        n = len(p.read_text().splitlines())
        family = p.parent.name in ("torch", "mlx") and p.stem in ("llama", "qwen2")
        limit = EXCEPTIONS.get(rel, FAMILY_BUDGET if family else BUDGET)
        if n > limit:
            over.append(f"{rel}: {n} lines (limit {limit})")
    assert not over, over


@pytest.mark.parametrize(
    "schema", sorted((PKG.parent / "schemas").glob("*.json")), ids=lambda p: p.name
)
def test_schemas_are_valid(schema):
    from jsonschema import Draft202012Validator

    Draft202012Validator.check_schema(json.loads(schema.read_text()))


def test_engine_free_modules_import_without_torch():
    code = (
        "import spill.cli, spill.jobs.tune, spill.jobs.rows.generate, spill.models.resolve, spill.payloads.checkpoint\n"
        "import spill.engines, spill.engines.base\n"
    )
    assert_not_imported(code, (*ENGINES, "transformers"))


def test_a_written_usage_line_names_every_option():
    """A verb whose usage line is written by hand (``spill move``, ``spill bundle``) names each of
    its options there, unless the line says ``[options]``."""
    import argparse

    from spill.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = {
        name: [
            flag
            for action in parser._actions
            for flag in action.option_strings
            if flag.startswith("--") and flag != "--help" and flag not in parser.usage
        ]
        for name, parser in sub.choices.items()
        if parser.usage and "[options]" not in parser.usage
    }
    assert {"move", "bundle"} <= missing.keys()
    assert not any(missing.values()), missing


def test_module_docstrings_are_short():
    """A module docstring says what a caller needs in at most 9 lines (issue 36); rationale and
    measurements go in comments next to the code they explain."""
    long = {}
    for path in _modules():
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        if doc and doc.count("\n") + 1 >= 10:
            long[str(path.relative_to(ROOT))] = doc.count("\n") + 1
    assert not long, f"module docstrings of 10 lines or more: {long}"
