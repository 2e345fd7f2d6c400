"""A spill.yaml's ``hydra:`` tree cannot run code or write files (issue 19, item 2): every way in
that was found (spill.yaml, a project group file, a swept group option, the command line, a
search path) is refused at compose time with one line naming the key, exit 1, and the victim
file keeps its bytes. The first test shows the repro is live: Hydra alone truncates the file."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from spill.errors import EXIT_USER
from spill.project.config import ConfigError
from tests.conftest import run_spill

ROOT = Path(__file__).resolve().parents[2]
BYTES = b"committed work, not to be truncated\n"
FAST = ["tune.steps=8", "tune.ckpt_every=4"]


@pytest.fixture
def toy(tmp_path) -> Path:
    dst = tmp_path / "toy"
    shutil.copytree(ROOT / "projects" / "toy", dst, ignore=shutil.ignore_patterns(".spill"))
    (tmp_path / "victim").write_bytes(BYTES)
    return dst


def edit(toy: Path, hydra: dict | None = None, defaults: list | None = None) -> None:
    """Merge ``hydra`` into spill.yaml's hydra tree; put ``defaults`` entries before _self_."""
    doc = yaml.safe_load((toy / "spill.yaml").read_text())
    doc["hydra"].update(hydra or {})
    doc["defaults"][-1:-1] = defaults or []
    (toy / "spill.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))


def refused(proc: subprocess.CompletedProcess, toy: Path, key: str) -> str:
    """One error line naming ``key``, exit 1, the victim's bytes unchanged, no job started."""
    victim = toy.parent / "victim"
    assert victim.read_bytes() == BYTES, proc.stderr
    assert proc.returncode == EXIT_USER == ConfigError.exit_code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("spill: error: "), proc.stderr
    assert "/toy/spill.yaml: " in lines[0] and f": {key}: " in lines[0], lines[0]
    assert not (toy / ".spill" / "sweep").exists() and not (toy / ".spill" / "hydra").exists()
    return lines[0]


def pwn(toy: Path) -> None:
    victim = str(toy.parent / "victim")
    edit(toy, {"callbacks": {"pwn": {"_target_": "builtins.open", "_args_": [victim, "w"]}}})


def test_the_repro_is_live_under_hydra_alone(toy):
    """Hydra's own multirun on the same project (no spill in between) truncates the victim."""
    pwn(toy)
    code = textwrap.dedent(f"""
        from hydra import initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra
        with initialize_config_dir(config_dir={str(toy)!r}, version_base="1.3"):
            GlobalHydra.instance().hydra.multirun(
                config_name="spill", task_function=lambda cfg: None,
                overrides=["hydra.sweep.dir={toy.parent / "hydra"}", "tune.lr=1e-3,2e-3"])
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (toy.parent / "victim").read_bytes() == b""


def test_the_issue_repro_is_refused_on_every_path(toy):
    pwn(toy)
    proc = run_spill("build", str(toy), "-m", "tune.lr=1e-3,2e-3")  # the issue's command
    line = refused(proc, toy, "hydra.callbacks.pwn")
    assert line.endswith(
        "Hydra callbacks run code; spill.yaml is data, so spill refuses them; remove the key"
    )
    refused(run_spill("build", str(toy), "--dry-run"), toy, "hydra.callbacks.pwn")  # no -m
    bundle = toy.parent / "toy.spillbundle"
    refused(run_spill("bundle", str(toy), str(bundle)), toy, "hydra.callbacks.pwn")
    assert not bundle.exists()


def _group_launcher(toy: Path) -> list[str]:
    (toy / "hydra" / "launcher").mkdir(parents=True)
    other = toy.parent / "other"
    other.write_bytes(b"x")
    evil = {"_target_": "shutil.copyfile", "src": str(other), "dst": str(toy.parent / "victim")}
    (toy / "hydra" / "launcher" / "evil.yaml").write_text(yaml.safe_dump(evil))
    edit(toy, defaults=[{"override hydra/launcher": "evil"}])
    return []


def _file_handler(toy: Path) -> list[str]:
    victim = str(toy.parent / "victim")
    handler = {"class": "logging.FileHandler", "filename": victim, "mode": "w"}
    edit(toy, {"job_logging": {"handlers": {"f": handler}, "root": {"handlers": ["f"]}}})
    return []


def _logging_factory(toy: Path) -> list[str]:
    victim = str(toy.parent / "victim")
    handler = {"()": "builtins.open", "file": victim, "mode": "w"}
    edit(toy, {"hydra_logging": {"handlers": {"f": handler}, "root": {"handlers": ["f"]}}})
    return []


def _swept_global_group(toy: Path) -> list[str]:
    """A tune option whose package header writes into hydra: only the job that picks it has
    the FileHandler, so only composing each job finds it."""
    victim = toy.parent / "victim"
    body = {
        "tune": {"lr": 0.003},
        "hydra": {
            "job_logging": {
                "handlers": {
                    "f": {"class": "logging.FileHandler", "filename": str(victim), "mode": "w"}
                },
                "root": {"handlers": ["f"]},
            }
        },
    }
    (toy / "tune").mkdir()
    (toy / "tune" / "evil.yaml").write_text("# @package _global_\n" + yaml.safe_dump(body))
    return ["tune=default,evil"]


def _search_path(toy: Path) -> list[str]:
    """``python -m spill`` from a folder holding a package: Hydra would import it to load."""
    pkg = toy.parent / "evilpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(f"open({str(toy.parent / 'victim')!r}, 'w').close()\n")
    edit(toy, {"searchpath": ["pkg://spill.conf", "pkg://evilpkg"]})
    return []


CASES = {  # name: (set-up returning extra overrides, overrides, the key the error names)
    "launcher-group-file": (_group_launcher, [], "hydra.launcher._target_"),
    "launcher-on-command-line": (
        None,
        ["hydra.launcher._target_=shutil.copyfile"],
        "hydra.launcher._target_",
    ),
    "job-logging-file-handler": (_file_handler, [], "hydra.job_logging.handlers.f.class"),
    "hydra-logging-factory": (_logging_factory, [], "hydra.hydra_logging.handlers.f.()"),
    "callback-override": (None, ["hydra.callbacks.x._target_=builtins.open"], "hydra.callbacks.x"),
    "callback-override-added": (
        None,
        ["+hydra.callbacks.x._target_=builtins.open", "+hydra.callbacks.x._args_=[VICTIM,w]"],
        "hydra.callbacks.x",
    ),
    "swept-group-option": (_swept_global_group, [], "hydra.job_logging.handlers.f.class"),
    "search-path": (_search_path, [], "hydra.searchpath"),
    "search-path-override": (
        None,
        ["hydra.searchpath=[pkg://spill.conf,pkg://evilpkg]"],
        "hydra.searchpath",
    ),
    "env-set": (None, ["+hydra.job.env_set.LD_PRELOAD=VICTIM"], "hydra.job.env_set.LD_PRELOAD"),
    "output-subdir": (None, ["hydra.output_subdir=OUT"], "hydra.output_subdir"),
    "sweep-subdir": (None, ["hydra.sweep.subdir=OUT"], "hydra.sweep.subdir"),
    "target-in-tune": (None, ["+tune._target_=builtins.open"], "tune._target_"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hydra_tree_that_runs_code_or_writes_files_is_refused(toy, case):
    setup, overrides, key = CASES[case]
    extra = setup(toy) if setup else ["tune.lr=1e-3,2e-3"]
    out = toy.parent / "elsewhere"
    given = [
        o.replace("VICTIM", str(toy.parent / "victim")).replace("OUT", str(out)) for o in overrides
    ]
    proc = run_spill("build", str(toy), "-m", *FAST, *extra, *given, cwd=toy.parent)
    line = refused(proc, toy, key)
    assert not out.exists()
    if case == "swept-group-option":
        assert "spill.yaml: job tune.steps=8,tune.ckpt_every=4,tune=evil: hydra." in line


def test_what_spill_allows_still_sweeps(toy):
    """Hydra's stdout job logging, a joblib launcher with settings, env_copy and a sweep folder
    moved on the command line: the plan comes back for both jobs."""
    edit(toy, {"job": {"env_copy": ["HOME"]}}, [{"override hydra/launcher": "joblib"}])
    args = [
        "hydra/job_logging=stdout",
        "hydra.launcher.n_jobs=2",
        "+hydra.job.env_set.SPILL_LEASE=60",
    ]
    proc = run_spill(
        "build",
        str(toy),
        "-m",
        "tune.lr=1e-3,2e-3",
        *args,
        "--dry-run",
        f"hydra.sweep.dir={toy.parent / 'logs'}",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count(" planned ") == 2, proc.stdout
