import os
import shutil

import pytest

from spill.ground.paths import models_dir
from spill.models import cache
from spill.models.cache import MARKER, cached_fingerprint, list_models, read_marker
from spill.models.sources.staging import stage
from spill.models.sources.tiny import write_tiny
from spill.models.weights import fingerprint
from tests.unit.models.sources.test_hub import SHA, lay_out_snapshot


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
    from spill.models.sources import hub

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

    def boom(path, hashes=None):
        if path == folder:
            raise AssertionError("fingerprint recomputed although nothing changed")
        return real(path, hashes)

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


def _flip_middle(path) -> None:
    """One byte in the middle of a shard changed in place, its size and mtime set back."""
    st = path.stat()
    assert st.st_size > 4 * 64 * 1024  # far from the 64 KiB ends the old fingerprint sampled
    with open(path, "r+b") as f:
        f.seek(st.st_size // 2)
        byte = f.read(1)
        f.seek(st.st_size // 2)
        f.write(bytes([byte[0] ^ 1]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_the_fingerprint_changes_with_any_byte_of_the_weights(tmp_path):
    """A folder without records (a user's own): a byte in the middle of a shard, same size and
    mtime, gives another fingerprint (its cached value is keyed by the ctime that moved); the
    same bytes elsewhere give the same one. (A recorded folder's changed byte is refused at job
    start by ``integrity.check``, before any fingerprint is taken.)"""
    folder = write_tiny(tmp_path / "m", "llama", seed=1, layers=2, hidden=256)
    twin = write_tiny(tmp_path / "twin", "llama", seed=1, layers=2, hidden=256)
    (folder / MARKER).unlink(missing_ok=True)
    before = cached_fingerprint(folder)
    assert before == fingerprint(folder) == fingerprint(twin)
    _flip_middle(folder / "model.safetensors")
    after = cached_fingerprint(folder)
    assert after != before and after == fingerprint(folder)


def test_a_recorded_folder_is_fingerprinted_from_its_records_without_hashing(tmp_path, monkeypatch):
    """Recorded sha256 stand in for the shards' bytes (the job-start check holds them to the
    files): the value equals a full hash's, and no shard is read to get it."""
    from spill.models.integrity import record

    folder = write_tiny(tmp_path / "m", "llama", seed=1, layers=2, hidden=256)
    record(folder, source="tiny")
    full = fingerprint(folder)

    def no_hashing(path):
        raise AssertionError(f"{path} hashed although its sha256 is recorded")

    monkeypatch.setattr("spill.models.weights.checked_sha256", no_hashing)
    assert "fingerprint" not in read_marker(folder)  # no cached value to reuse
    assert cached_fingerprint(folder) == full
