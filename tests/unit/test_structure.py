"""The shape of the house (STYLE.md): imports point down, torch and mlx stay behind the engine
seam, modules stay small, and every shipped JSON Schema is itself valid."""

from __future__ import annotations

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


def test_layers_import_down():
    """models/, store/ and control/ never import project/, jobs/ or cli; engines never import
    jobs/; examples/ (the top, beside cli) is imported by nothing else."""
    top = ("spill.cli", "spill.examples")
    rules = {
        "models": ("spill.project", "spill.jobs", "spill.engines", *top),
        "store": ("spill.project", "spill.jobs", "spill.engines", *top),
        "control": ("spill.project", "spill.jobs", "spill.engines", *top),
        "engines": ("spill.jobs", *top),
        "jobs": ("spill.examples",),  # jobs/resume replays a recorded command through the cli
        "project": ("spill.examples",),
    }
    bad = []
    for p in _modules():
        layer = p.relative_to(PKG).parts[0]
        for banned in rules.get(layer, ()):
            if re.search(
                rf"^\s*(from|import)\s+{re.escape(banned)}\b", p.read_text(), re.MULTILINE
            ):
                bad.append(f"{p.relative_to(ROOT)} imports {banned}")
    assert not bad, bad


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
        "import spill.cli, spill.jobs.tune, spill.jobs.run, spill.models.resolve, spill.payloads.checkpoint\n"
        "import spill.engines, spill.engines.base\n"
    )
    assert_not_imported(code, (*ENGINES, "transformers"))
