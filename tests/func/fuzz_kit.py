"""Helpers of ``test_fuzz_files.py``: damage a file, run the real CLI on it, check the outcome.

``damage`` is a hypothesis strategy over one file's bytes: truncation, byte flips, bytes that are
not UTF-8 and, for JSON and YAML files, a deleted key, a value of the wrong type, an extra key or
a huge value (a megabyte string, a 10^30 integer, a long list, nesting 100 000 deep).

``run_cli`` runs ``spill.cli.main(argv)`` in a forked copy of the test process: as fast as
in-process (torch and spill are imported once, in the parent), yet each example gets a clean
process with its own stdout/stderr files, a memory cap and a timeout, so a hang or a runaway
allocation fails the example instead of the session. An exception that escapes ``main`` is
printed as a traceback and exits ``ESCAPED``.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from hypothesis import strategies as st

ESCAPED = 99
MEMORY_CAP = 6 << 30  # bytes of address space a child may add to what it inherits
DEEP = "DEEPFUZZMARKER"  # stands for nesting too deep for a recursive parser
SCALARS: list[Any] = [None, True, 0, -1, 42, 2**63, 1e308, "", "x", "\u2028", [], {}, [1], {"k": 1}]
HUGE: list[Any] = ["x" * 1_000_000, 10**30, -(10**30), [0] * 20_000, DEEP]
NOT_UTF8 = [b"\xff", b"\xc3(", b"\xed\xa0\x80", b"\x80", b"\xfe\xff"]


@dataclass
class Outcome:
    rc: int
    out: str
    err: str

    def __str__(self) -> str:
        return f"exit {self.rc}\n--- stdout\n{self.out[-3000:]}\n--- stderr\n{self.err[-6000:]}"


# --- running ------------------------------------------------------------------------------------


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def run_cli(
    argv: list[str],
    env: dict[str, str],
    tmp: Path,
    timeout: float = 120,
    before: Callable[[], None] | None = None,
) -> Outcome:
    """``main(argv)`` in a forked child with ``env`` set; ``before()`` runs in the child first."""
    out_path, err_path = tmp / "stdout.txt", tmp / "stderr.txt"
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = ESCAPED
        try:
            os.setpgid(0, 0)
            fds = [os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC) for p in (out_path, err_path)]
            os.dup2(fds[0], 1)
            os.dup2(fds[1], 2)
            # pytest's capture replaced sys.stdout/err with objects that do not write to 1 and 2
            # with the error handlers Python gives them
            sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
            cap = _vm_size() + MEMORY_CAP
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
            os.environ.update(env)
            if before is not None:
                before()
            from spill.cli import main

            try:
                code = main(argv)
            except SystemExit as e:  # argparse's usage errors
                code = e.code if isinstance(e.code, int) else 2
            if not isinstance(code, int):
                print(f"main returned {code!r}, not an int", file=sys.stderr)
                code = ESCAPED
        except BaseException:
            traceback.print_exc()
            code = ESCAPED
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"spill {' '.join(argv)} hung for {timeout} s")
        time.sleep(0.01)
    rc = os.waitstatus_to_exitcode(status)
    return Outcome(rc, out_path.read_text(errors="replace"), err_path.read_text(errors="replace"))


def log(line: str) -> None:
    """Append ``line`` to ``$FUZZ_LOG`` when set: what each example did and how it ended."""
    if path := os.environ.get("FUZZ_LOG"):
        with open(path, "a") as f:
            f.write(line.replace("\n", " ")[:300] + "\n")


def check_outcome(o: Outcome, strict: bool) -> bool:
    """True for success (exit 0), False for a one-line refusal (exit 1 or 2); anything else
    fails. ``strict``: a refusal is the only line on stderr (commands that print no progress)."""
    last = (o.err.strip().splitlines() or [""])[-1]
    log(f"  exit {o.rc}: {last}")
    assert o.rc != ESCAPED and "Traceback (most recent call last)" not in o.err, str(o)
    if o.rc == 0:
        return True
    assert o.rc in (1, 2), str(o)
    lines = [ln for ln in o.err.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("spill: error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], str(o)
    if strict:
        assert lines == errors, str(o)
    return False


# --- the tree ------------------------------------------------------------------------------------


def snapshot(*roots: Path) -> dict[str, str]:
    """sha256 of every file under ``roots`` (or of each root that is a file), by path."""
    out = {}
    for root in roots:
        paths = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for p in paths:
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def assert_untouched(before: dict, after: dict, *allowed: Path) -> None:
    """Every file of ``before`` is in ``after`` with the same bytes, and nothing was added,
    except under the ``allowed`` paths (the damaged file, what the command rewrites)."""
    free = tuple(str(a) for a in allowed)

    def kept(d: dict) -> dict:
        return {
            k: v for k, v in d.items() if not any(k == a or k.startswith(a + "/") for a in free)
        }

    a, b = kept(before), kept(after)
    changed = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    assert not changed, f"files changed that the command must not touch: {changed[:5]}"


# --- damage -------------------------------------------------------------------------------------


def _paths(doc: Any, here: tuple = ()) -> list[tuple]:
    out = [here]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*here, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*here, i))
    return out


def _replace(doc: Any, path: tuple, value: Any, delete: bool = False) -> Any:
    if not path:
        return value
    parent = doc
    for p in path[:-1]:
        parent = parent[p]
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return doc


def _dump(doc: Any, fmt: str) -> bytes:
    if fmt == "json":
        text = json.dumps(doc, indent=1)
        deep = "[" * 100_000 + "]" * 100_000
        return text.replace(json.dumps(DEEP), deep).encode()
    text = yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=10**9)
    return text.replace(DEEP, "[" * 20_000 + "]" * 20_000).encode()


class Damage:
    """The damaged bytes and what was done; shown (by hypothesis) as the latter only."""

    def __init__(self, what: str, raw: bytes):
        self.what, self.raw = what, raw

    def __repr__(self) -> str:
        return f"Damage({self.what!r}, {len(self.raw)} bytes)"


@st.composite
def damage(draw, raw: bytes, fmt: str | None = None) -> Damage:
    """A damaged copy of ``raw`` (a file's bytes; ``fmt``: json, yaml or None)."""
    return Damage(*draw(_damage(raw, fmt)))


@st.composite
def _damage(draw, raw: bytes, fmt: str | None = None) -> tuple[str, bytes]:
    kinds = ["truncate", "flip", "not-utf8"]
    doc = None
    if fmt is not None:
        doc = json.loads(raw) if fmt == "json" else yaml.safe_load(raw)
        kinds += ["delete", "retype", "extra", "huge"]
    kind = draw(st.sampled_from(kinds))
    if kind == "truncate":
        at = draw(st.integers(0, len(raw) - 1))
        return f"truncated at {at}", raw[:at]
    if kind == "flip":
        at, bits = draw(st.integers(0, len(raw) - 1)), draw(st.integers(1, 255))
        return f"byte {at} xor {bits}", raw[:at] + bytes([raw[at] ^ bits]) + raw[at + 1 :]
    if kind == "not-utf8":
        at, junk = draw(st.integers(0, len(raw))), draw(st.sampled_from(NOT_UTF8))
        return f"{junk!r} inserted at {at}", raw[:at] + junk + raw[at:]
    paths = _paths(doc)
    if kind == "delete":
        paths = [p for p in paths if p] or [()]
    if kind == "extra":
        paths = [p for p in paths if isinstance(_at(doc, p), dict)] or [()]
    path = draw(st.sampled_from(paths))
    if kind == "delete" and path:
        return f"deleted {path}", _dump(_replace(doc, path, None, delete=True), fmt)
    if kind == "extra":
        key = draw(st.sampled_from(["fuzz", "", "stages", "0", "status"]))
        value = draw(st.sampled_from(SCALARS))
        target = _at(doc, path)
        if isinstance(target, dict) and key not in target:
            target[key] = value
            return f"extra key {key!r} at {path}", _dump(doc, fmt)
    value = draw(st.sampled_from(HUGE if kind == "huge" else SCALARS))
    shown = value if not isinstance(value, (str, list)) or len(value) < 20 else type(value)
    return f"{path} set to {shown!r}", _dump(_replace(doc, path, value), fmt)


def _at(doc: Any, path: tuple) -> Any:
    for p in path:
        doc = doc[p]
    return doc
