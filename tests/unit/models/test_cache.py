import os
import shutil

import pytest

from spill.models import cache
from spill.models.cache import MARKER, cached_fingerprint, list_models, read_marker
from spill.models.staging import stage
from spill.models.tiny import write_tiny
from spill.models.weights import fingerprint
from spill.paths import models_dir
from tests.unit.models.test_hub import SHA, lay_out_snapshot


def folder_bytes(folder):
    return sum(p.stat().st_size for p in folder.iterdir() if p.name != MARKER)


@pytest.fixture
def populated(tiny_models):
    """One model from each writer: tiny, staged, hub snapshot; plus a broken one and leftovers."""
    root = models_dir()
    tiny = write_tiny(root / "tiny-llama", family="llama", seed=3)
    staged = root / "staged" / "qwen-abc"
    stage(str(tiny_models["qwen2"]), staged, progress=lambda _: None)
    snap = lay_out_snapshot("org/tiny", SHA, tiny_models["llama"])
    broken = root / "broken"
    shutil.copytree(tiny_models["qwen2"], broken)
    (broken / "model.safetensors").unlink()
    shutil.copytree(tiny_models["qwen2"], root / ".smollm2-135m.123.partial")  # unfinished import
    return {"tiny": tiny, "staged": staged, "hub": snap, "broken": broken}


def test_list_models_shows_name_size_source_and_fingerprint(populated):
    by_folder = {row["folder"]: row for row in list_models()}
    assert set(by_folder) == {str(p) for p in populated.values()}

    tiny = by_folder[str(populated["tiny"])]
    assert (tiny["name"], tiny["source"], tiny["error"]) == ("tiny-llama", "tiny", None)
    staged = by_folder[str(populated["staged"])]
    assert (staged["name"], staged["source"]) == ("staged/qwen-abc", "staged")
    hub = by_folder[str(populated["hub"])]
    assert (hub["name"], hub["source"]) == ("org/tiny@0123456789ab", "hub")  # read from the path
    for key in ("tiny", "staged", "hub"):
        row = by_folder[str(populated[key])]
        assert row["bytes"] == folder_bytes(populated[key]) > 0
        assert row["fingerprint"] == fingerprint(populated[key])

    broken = by_folder[str(populated["broken"])]
    assert broken["fingerprint"] is None and "no *.safetensors" in broken["error"]


def test_a_resolved_hub_snapshot_lists_under_its_id(populated):
    from spill.models import hub

    hub.download("org/tiny", SHA, progress=pytest.fail)
    assert read_marker(populated["hub"])["name"] == "org/tiny@0123456789ab"
    (row,) = [r for r in list_models() if r["folder"] == str(populated["hub"])]
    assert (row["name"], row["source"]) == ("org/tiny@0123456789ab", "hub")


def test_fingerprint_is_cached_in_the_marker_until_a_file_changes(populated, monkeypatch):
    folder = populated["tiny"]
    value = cached_fingerprint(folder)
    assert read_marker(folder)["fingerprint"]["value"] == value
    assert read_marker(folder)["source"] == "tiny"  # the writer's fields are kept

    real = fingerprint

    def boom(path):
        if path == folder:
            raise AssertionError("fingerprint recomputed although nothing changed")
        return real(path)

    monkeypatch.setattr("spill.models.weights.fingerprint", boom)
    assert cached_fingerprint(folder) == value
    assert {r["fingerprint"] for r in list_models() if r["folder"] == str(folder)} == {value}
    monkeypatch.undo()

    config = folder / "config.json"
    config.write_text(config.read_text().replace('"rope_theta": 10000.0', '"rope_theta": 20000.0'))
    os.utime(config, ns=(1, 1))
    changed = cached_fingerprint(folder)
    assert changed != value and changed == fingerprint(folder)


def test_a_read_only_marker_still_lists(populated, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError("read-only")

    monkeypatch.setattr(cache, "write_marker", refuse)
    (populated["tiny"] / MARKER).unlink()
    rows = [r for r in list_models() if r["folder"] == str(populated["tiny"])]
    assert rows[0]["fingerprint"] == fingerprint(populated["tiny"])


def test_empty_cache_lists_nothing():
    assert list_models() == []
