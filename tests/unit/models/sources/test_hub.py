"""The hub source, against snapshots laid out in the hub client's cache format; never the network.

Where a test lets the client go "online", the endpoint is a closed port on loopback.
"""

import shutil
from pathlib import Path

import pytest

from spill.errors import ModelNotFound
from spill.models.cache import is_model_file, read_marker
from spill.models.sources import hub
from spill.models.weights import fingerprint

SHA = "0123456789abcdef0123456789abcdef01234567"


def lay_out_snapshot(model_id: str, sha: str, src: Path, ref: str | None = "main") -> Path:
    """Put ``src``'s model files where the hub client caches ``model_id`` at commit ``sha``."""
    repo = hub.hub_cache() / ("models--" + model_id.replace("/", "--"))
    snap = repo / "snapshots" / sha
    snap.mkdir(parents=True)
    for f in src.iterdir():
        if is_model_file(f.name):
            shutil.copy2(f, snap / f.name)
    if ref:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(sha)
    return snap


@pytest.fixture
def unreachable_hub(monkeypatch):
    """Online mode with the hub at a closed loopback port: any request fails fast."""
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")


def test_offline_and_not_cached_is_one_line_saying_what_to_do():
    with pytest.raises(ModelNotFound) as e:
        hub.download("Qwen/Qwen2.5-0.5B-Instruct", SHA, progress=pytest.fail)
    msg = str(e.value)
    assert "\n" not in msg
    assert "not cached here" in msg and "HF_HUB_OFFLINE" in msg
    for hint in ("--weights <uri>", "local model folder", "spill models import", "go online"):
        assert hint in msg


def test_offline_resolves_a_cached_commit_and_marks_it(tiny_models):
    snap = lay_out_snapshot("org/tiny", SHA, tiny_models["qwen2"])
    folder = hub.download("org/tiny", SHA, progress=pytest.fail)
    assert folder == snap
    assert fingerprint(folder) == fingerprint(tiny_models["qwen2"])
    marker = read_marker(folder)
    assert marker["source"] == "hub" and marker["revision"] == SHA
    assert marker["model_id"] == "org/tiny" and marker["name"] == "org/tiny@0123456789ab"


def test_offline_resolves_a_branch_through_its_cached_ref(tiny_models):
    snap = lay_out_snapshot("org/tiny", SHA, tiny_models["llama"])
    assert hub.download("org/tiny", "main", progress=pytest.fail) == snap
    assert hub.cached("org/tiny", "v2") is None
    assert hub.cached("org/tiny", "f" * 40) is None


def test_a_cached_commit_needs_no_request_even_online(tiny_models, unreachable_hub):
    snap = lay_out_snapshot("org/tiny", SHA, tiny_models["llama"], ref=None)
    assert hub.download("org/tiny", SHA, progress=pytest.fail) == snap


def test_unreachable_hub_and_not_cached_is_one_line(unreachable_hub):
    lines = []
    with pytest.raises(ModelNotFound) as e:
        hub.download("org/absent", "main", progress=lines.append)
    assert lines == []  # one refused connection says so before the hub client's retries start
    msg = str(e.value)
    assert "\n" not in msg and "not cached here" in msg and "--weights <uri>" in msg
    assert "the hub cannot be reached: 127.0.0.1:9: " in msg and "HF_HUB_OFFLINE=1" in msg
