"""``spill example relay``: the written folder's ``relay.sh`` run for real on the toy project
(leg a on torch, leg b on MLX where it is installed), through a local folder and through an S3
server, and as two "machines" (``--two-machines``, then ``--finish``); and the checks failing
when the relay does not match its reference, its legs or a measured tolerance."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_spill

SECOND = "mlx" if importlib.util.find_spec("mlx") else "torch"


def relay_sh(folder: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``relay.sh`` with this interpreter's ``spill`` first on PATH."""
    bin_dir = str(Path(sys.executable).parent)
    full = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **(env or {}))
    return subprocess.run(
        ["bash", str(folder / "relay.sh"), *args],
        capture_output=True,
        text=True,
        env=full,
        timeout=600,
    )


def written(tmp_path: Path) -> Path:
    folder = tmp_path / "relay"
    out = run_spill("example", "relay", str(folder), "--project", "toy")
    assert out.returncode == 0, out.stderr
    return folder


def check_json(folder: Path, relay: str, **replace: str) -> tuple[int, dict]:
    work = folder / "work"
    args = {
        "--reference": str(work / "reference.json"),
        "--relay": relay,
        "--legs": str(work / "legs.json"),
        "--noise-floor": str(folder / "noise-floor.json"),
        "--stop": "100",
    } | replace
    flat = [x for kv in args.items() for x in kv]
    out = run_spill("example", "relay-check", *flat, "--json")
    assert out.returncode in (0, 1), out.stderr
    return out.returncode, json.loads(out.stdout)


def failing(doc: dict) -> dict[str, dict]:
    return {c["check"]: c for c in doc["checks"] if c["ok"] != "ok"}


def test_relay_on_one_machine_passes_and_each_check_can_fail(tmp_path):
    folder = written(tmp_path)
    out = relay_sh(folder)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "relay passed every check" in out.stdout
    relay = str(folder / "work" / "relay-moved")
    code, doc = check_json(folder, relay)
    assert code == 0 and doc["passed"]
    checks = {c["check"]: c for c in doc["checks"]}
    assert checks["tune steps 0-300 once"]["relay"] == f"0-100 torch, 100-300 {SECOND}"
    assert checks["eval ran on"]["relay"].startswith(f"{SECOND} on ")
    # the moved run's source is fenced: a build there refuses and names the destination
    again = run_spill("build", str(folder / "work" / "relay"))
    assert again.returncode != 0 and "relay-moved" in again.stderr

    # a reference that scored a row more than the tolerance away
    ref = json.loads((folder / "work" / "reference.json").read_text())
    ref["stages"]["eval"]["result"]["accuracy"] = 0.9
    (tmp_path / "ref.json").write_text(json.dumps(ref))
    code, doc = check_json(folder, relay, **{"--reference": str(tmp_path / "ref.json")})
    assert code == 1 and list(failing(doc)) == ["eval accuracy"]

    # legs that say leg b ran on another engine, and on another machine
    legs = json.loads((folder / "work" / "legs.json").read_text())
    legs["b"]["engine"] = "torch" if SECOND == "mlx" else "mlx"
    legs["a"]["machine"] = "somewhere-else"
    (tmp_path / "legs.json").write_text(json.dumps(legs))
    code, doc = check_json(folder, relay, **{"--legs": str(tmp_path / "legs.json")})
    assert code == 1 and set(failing(doc)) == {"eval:base ran on", "eval ran on", "tune ran on"}

    # a stop step the state's producer ranges do not have
    code, doc = check_json(folder, relay, **{"--stop": "50"})
    assert code == 1 and list(failing(doc)) == ["tune ran on"]

    # a noise floor that measured no tolerance for this project
    (tmp_path / "floor.json").write_text(json.dumps({"projects": {}}))
    code, doc = check_json(folder, relay, **{"--noise-floor": str(tmp_path / "floor.json")})
    assert code == 1 and set(failing(doc)) == {"eval:base accuracy", "eval accuracy"}
    assert failing(doc)["eval accuracy"]["tolerance"] == "not measured"

    # the unfinished relay (the fenced source) against the reference
    code, doc = check_json(folder, str(folder / "work" / "relay"))
    assert code == 1 and "both builds complete" in failing(doc)


def test_relay_through_s3_as_two_machines(tmp_path, s3_bucket):
    folder = written(tmp_path)
    dest = f"s3://{s3_bucket}/relay"
    first = relay_sh(folder, "--two-machines", "--s3", dest)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "relay.sh --finish" in first.stdout and "rsync" in first.stdout
    assert not (folder / "work" / "home-b").exists()  # leg b has not run
    second = relay_sh(folder, "--finish")  # the destination is remembered in work/
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "relay passed every check" in second.stdout
    assert (folder / "work" / "home-b" / "models").is_dir()  # its own model cache


def test_example_folder_refusals(tmp_path):
    folder = written(tmp_path)
    assert (folder / "project" / "spill.yaml").is_file() and not (
        folder / "project/.spill"
    ).exists()
    assert os.access(folder / "relay.sh", os.X_OK)
    script = (folder / "relay.sh").read_text()
    assert "@" not in script.split("HERE=")[0].replace("$@", "")  # every setting filled in
    out = run_spill("example", "relay", str(folder))
    assert out.returncode == 2 and "not empty" in out.stderr and "--force" in out.stderr
    (folder / "relay.sh").write_text("changed")
    out = run_spill("example", "relay", str(folder), "--force", "--project", "toy")
    assert out.returncode == 0 and (folder / "relay.sh").read_text() == script
    (tmp_path / "file").write_text("x")
    out = run_spill("example", "relay", str(tmp_path / "file"))
    assert out.returncode == 2 and "is a file" in out.stderr
    bad = relay_sh(folder, "--bogus")
    assert bad.returncode == 2 and "unknown option --bogus" in bad.stderr
    missing = run_spill(
        "example", "relay-check", "--reference", str(tmp_path / "none.json"),
        "--relay", str(folder), "--legs", "x", "--noise-floor", "y", "--stop", "1",
    )  # fmt: skip
    assert missing.returncode == 2 and "cannot read the reference" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1


@pytest.mark.slow  # (18 s; CI's 30-minute budget)
def test_relay_with_one_engine_passes_and_says_so(tmp_path):
    """Without MLX (here: ``--to torch``) both legs are one producer: the relay says so before
    it starts, and its checks hold what is true then (one range, a move between two places).
    ``--project`` naming the folder's own project is accepted, another is refused."""
    folder = written(tmp_path)
    other = relay_sh(folder, "--project", "tickets")
    assert other.returncode == 2 and "this folder relays toy" in other.stderr
    out = relay_sh(folder, "--project", "toy", "--to", "torch")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "leg b computes on torch too" in out.stderr
    code, doc = check_json(folder, str(folder / "work" / "relay-moved"))
    checks = {c["check"]: c for c in doc["checks"]}
    assert code == 0 and checks["tune steps 0-300 once"]["relay"] == "0-300 torch"
    assert "both legs" in checks["tune ran on"]["relay"]
    assert checks["moved between two places"]["relay"].startswith("from ")
