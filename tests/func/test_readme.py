"""The README's promises about the command line, checked against the real parser and CLI.

Every option the README's command list names is accepted by that verb; the engine options it
says every computing verb takes are taken by each of them; and each documented exit code
(0, 1, 2, 75) comes back for the case the README gives it.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spill.cli import build_parser
from tests.conftest import run_spill

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    return README.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def _command_list() -> dict[str, list[str]]:
    """``{"build": ["--state", ...], "models verify": [...]}`` from the Commands code block."""
    block = _section("Commands").split("```sh\n", 1)[1].split("```", 1)[0]
    found: dict[str, list[str]] = {}
    heads = list(re.finditer(r"spill ((?:models |example )?[a-z]+)", block))
    for head, nxt in zip(heads, [*heads[1:], None], strict=True):
        text = block[head.end() : nxt.start() if nxt else len(block)]
        found.setdefault(head.group(1), []).extend(re.findall(r"(?<![\w-])--?[a-z][\w-]*", text))
    return found


COMMANDS = _command_list()
# the engine options sentence: "... `--engine auto|torch|mlx`, `--device`, ... and `--weights URI`"
_ENGINE = _section("Commands").split("Every command that computes", 1)[1].split("\n\n", 1)[0]
ENGINE_OPTIONS = re.findall(r"`(--[a-z-]+)", _ENGINE)
COMPUTING = ("run", "eval", "distill", "tune")
PROJECT_VERBS = ("build", "resume")  # the engine options as engine.* shorthand, no --weights


def _subparser(verb: str):
    parser = build_parser()
    action = next(a for a in parser._actions if a.dest == "command")
    sub = action.choices[verb.split()[0]]
    if " " in verb:
        dest = {"models": "models_command", "example": "example"}[verb.split()[0]]
        inner = next(a for a in sub._actions if a.dest == dest)
        sub = inner.choices[verb.split()[1]]
    return sub


SAMPLES = {"--log": "tensorboard,mlflow"}  # options whose value is no number


def _accepts(verb: str, option: str) -> bool:
    """Whether ``spill VERB`` parses ``option`` (with a value if it takes one)."""
    sub = _subparser(verb)
    action = sub._option_string_actions.get(option)
    if action is None:
        return False
    if action.nargs == 0:
        return True
    value = (action.choices and next(iter(action.choices))) or SAMPLES.get(option, "2")
    return action.type is None or action.type(str(value)) is not None


def test_readme_lists_commands():
    assert {"build", "init", "status", "resume", "tune", "run", "eval", "distill"} <= set(COMMANDS)
    assert {"models import", "models tiny", "models list", "example relay"} <= set(COMMANDS)
    assert ENGINE_OPTIONS[:3] == ["--engine", "--device", "--dtype"]


@pytest.mark.parametrize(
    "verb,option",
    [(v, o) for v, opts in COMMANDS.items() for o in opts if o not in ("-m",) or v == "build"],
)
def test_every_documented_option_is_accepted(verb, option):
    assert _accepts(verb, option), f"README: `spill {verb} {option}` is not an option of {verb}"


@pytest.mark.parametrize("verb", COMPUTING + PROJECT_VERBS)
def test_engine_options_on_every_computing_verb(verb):
    options = [o for o in ENGINE_OPTIONS if verb in COMPUTING or o != "--weights"]
    missing = [o for o in options if not _accepts(verb, o)]
    assert not missing, f"spill {verb} does not take {missing}"


@pytest.mark.parametrize("verb", sorted(COMMANDS))
def test_every_verb_help_lists_its_documented_options(verb):
    proc = run_spill(*verb.split(), "--help")
    assert proc.returncode == 0, proc.stderr
    for option in COMMANDS[verb]:
        if option.startswith("--") and option != "--help":
            assert option in proc.stdout, f"`spill {verb} --help` does not mention {option}"


def test_readme_documents_each_exit_code():
    codes = _section("Commands").split("Exit codes:", 1)[1].split("\n\n", 1)[0]
    for code in ("0", "1", "2", "75"):
        assert re.search(rf"\b{code} ", codes), f"exit code {code} is not in the README"


# --- each exit code, through the real CLI -------------------------------------------------------


def _toy(tmp_path: Path) -> Path:
    import shutil

    dst = tmp_path / "toy"
    shutil.copytree(ROOT / "projects" / "toy", dst, ignore=shutil.ignore_patterns(".spill"))
    return dst


def test_exit_0_success(tmp_path):
    proc = run_spill("build", str(_toy(tmp_path)), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "eval:base" in proc.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["build", "{toy}", "--no-such-option"],
        ["build", "{toy}", "--stop-after", "nope"],
        ["build", "{toy}", "--stop-after", "tune:0"],
        ["build", "{toy}", "--memory", "lots"],
        ["build", "{toy}", "--engine", "tpu"],
        ["resume", "{toy}", "--bogus"],
        ["resume", "{toy}", "tune.lr=0.1"],
        ["run", "m", "in.jsonl"],  # --out missing
        ["tune", "m", "t.jsonl", "--name", "x", "--frobnicate"],
    ],
    ids=lambda a: " ".join(a),
)
def test_exit_2_usage_error(tmp_path, args):
    toy = _toy(tmp_path)
    proc = run_spill(*(a.format(toy=toy) for a in args))
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(("spill: error:", "spill ")), proc.stderr


def test_exit_1_input_problem(tmp_path, tiny_models):
    proc = run_spill(
        "run", str(tiny_models["llama"]), str(tmp_path / "missing.jsonl"), "--out", "o"
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("spill: error:")


def test_exit_75_preempted(tmp_path, tiny_models):
    train = tmp_path / "train.jsonl"
    rows = [{"prompt": f"say {i}", "completion": f" {i % 7}"} for i in range(64)]
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = [sys.executable, "-m", "spill", "tune", str(tiny_models["llama"]), str(train)]
    cmd += ["--name", "drill", "--state", str(tmp_path / "state"), "--steps", "100000"]
    cmd += ["--batch", "2", "--micro-batch", "2", "--seq-len", "16", "--dtype", "float32"]
    cmd += ["--ckpt-every", "100000"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    seen = ""
    while "spill tune ·" not in seen and proc.poll() is None:  # the pre-run line: model loaded
        seen += proc.stderr.readline()
    time.sleep(1.0)  # inside the steps
    proc.send_signal(signal.SIGTERM)
    _, rest = proc.communicate(timeout=60)
    assert proc.returncode == 75, seen + rest
    assert "preempted" in seen + rest
