"""spill from a real wheel: the shipped conf/ and schemas/ are inside the installed package.

An editable install reads conf/ and schemas/ from the checkout and so hides missing package
data. Here the wheel is built (``pip wheel . --no-deps``), installed without its dependencies into
a fresh virtual environment (they come from the test environment through PYTHONPATH, which
carries no ``spill``), and run from a folder outside the checkout: ``spill init`` on a CSV,
``spill build --dry-run`` and a schema validation.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(cmd: list, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert proc.returncode == 0, (cmd, proc.stdout[-2000:], proc.stderr[-2000:])
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(out)])
    (found,) = out.glob("streamweights-*.whl")
    return found


def test_wheel_ships_conf_and_schemas(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "spill/conf/engine/torch.yaml" in names
    assert "spill/conf/tune/default.yaml" in names
    assert "spill/schemas/build-state.schema.json" in names
    shipped = {n.split("/", 2)[2] for n in names if n.startswith("spill/schemas/")}
    on_disk = {p.name for p in (ROOT / "schemas").glob("*.json")}
    assert on_disk and on_disk <= shipped
    yamls = {
        n.split("/", 2)[2] for n in names if n.startswith("spill/conf/") and n.endswith("yaml")
    }
    assert {
        p.relative_to(ROOT / "conf").as_posix() for p in (ROOT / "conf").rglob("*.yaml")
    } == yamls
    assert not [n for n in names if n.startswith(("conf/", "schemas/", "tests/", "projects/"))]
    packages = {
        p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "spill").rglob("__init__.py")
    }
    assert {p + "/__init__.py" for p in packages} <= set(names)  # pyproject lists every package
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "spill").rglob("*.py")}
    assert modules <= set(names)
    # what `spill example relay` copies: the example projects, the noise floor, the script
    for project in ("toy", "tickets"):
        on_disk = {
            f"spill/projects/{project}/{p.name}"
            for p in (ROOT / "projects" / project).iterdir()
            if p.is_file() and not p.name.startswith(".")
        }
        assert on_disk <= set(names)
    assert any(n.startswith("spill/reports/") and n.endswith("-noise-floor.json") for n in names)
    assert {"spill/examples/relay.sh", "spill/examples/relay.md"} <= set(names)
    assert not [n for n in names if n.startswith("spill/reports/") and n.endswith(".md")]


def test_installed_wheel_inits_plans_and_validates(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    purelib = next((env_dir / "lib").glob("python*/site-packages"))
    # install the wheel's files alone; its dependencies come from this test environment
    with zipfile.ZipFile(wheel) as z:
        z.extractall(purelib)
    deps = os.pathsep.join(site.getsitepackages())
    env = {**os.environ, "PYTHONPATH": deps, "SPILL_HOME": str(tmp_path / "home")}
    where = tmp_path / "work"
    where.mkdir()
    spill = [str(python), "-m", "spill"]
    found = _run([str(python), "-c", "import spill; print(spill.__file__)"], env=env, cwd=where)
    assert found.stdout.strip().startswith(str(purelib)), found.stdout

    rows = ["text,label"] + [f"item {i} is {'red' if i % 2 else 'blue'},{i % 2}" for i in range(40)]
    (where / "data.csv").write_text("\n".join(rows) + "\n")
    _run([*spill, "init", "data.csv", "--input", "text", "--output", "label", "--project", "p",
          "--model", "tiny:llama:0:2x64"], env=env, cwd=where)  # fmt: skip
    plan = _run([*spill, "build", "p", "--dry-run"], env=env, cwd=where)
    assert "eval:base" in plan.stdout and "fresh: not run yet" in plan.stdout
    _run([*spill, "example", "relay", "relay"], env=env, cwd=where)
    assert (where / "relay" / "project" / "tickets.csv").is_file()
    assert (where / "relay" / "noise-floor.json").is_file()

    check = (
        "from spill.ground.validate import validate, SchemaInvalid\n"
        "try:\n    validate({'nonsense': 1}, 'build-state')\nexcept SchemaInvalid as e:\n"
        "    print('refused', e)\n"
    )
    out = _run([str(python), "-c", check], env=env, cwd=where)
    assert out.stdout.startswith("refused"), out.stdout
