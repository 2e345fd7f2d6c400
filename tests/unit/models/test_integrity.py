"""Per-file sha256 records: written by every source, checked at job start (re-hashing only what
changed on disk), re-hashed in full by verify; an invalid record is never trusted."""

import hashlib
import json
import os
import shutil

import pytest

from spill.ground.paths import models_dir
from spill.ground.validate import validate
from spill.models import integrity
from spill.models.cache import MARKER, MarkerInvalid, list_models, read_marker
from spill.models.integrity import ModelChanged, check, explain, record, verify, weight_hashes
from spill.models.sources.tiny import write_tiny


def sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def flip(path, at=0.5):
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0xFF
    with open(path, "r+b") as f:  # in place: same inode, same size
        f.write(data)


@pytest.fixture
def model(tmp_path, tiny_models):
    return shutil.copytree(tiny_models["llama"], tmp_path / "m")


def test_tiny_records_every_model_file_and_nothing_machine_specific(tmp_path):
    model = write_tiny(tmp_path / "fresh", family="llama", seed=7)  # not the shared one: jobs
    marker = read_marker(model)  # that used it have added this machine's stat keys
    validate(marker, "model-source")
    names = sorted(p.name for p in model.iterdir() if p.name != MARKER)
    assert sorted(marker["files"]) == names
    assert all(r["sha256"] == sha(model / n) for n, r in marker["files"].items())
    assert marker["verified"] == {}  # same arguments, same bytes: no stat keys
    assert weight_hashes(marker["files"]) == {
        n: sha(model / n) for n in ("config.json", "model.safetensors")
    }


def test_check_hashes_once_then_trusts_an_unchanged_stat(model, monkeypatch):
    files = check(model, "m")
    assert files == read_marker(model)["files"]
    assert set(read_marker(model)["verified"]) == set(files)

    def no_hashing(path):
        raise AssertionError(f"{path} re-hashed although its stat did not change")

    monkeypatch.setattr(integrity, "scan_file", no_hashing)
    assert check(model, "m") == files
    monkeypatch.undo()

    shard = model / "model.safetensors"
    os.utime(shard)  # a touch moves mtime and ctime: hashed again, still the same bytes
    hashed = []
    real = integrity.scan_file
    monkeypatch.setattr(integrity, "scan_file", lambda p: hashed.append(p.name) or real(p))
    assert check(model, "m") == files and hashed == ["model.safetensors"]


def test_a_same_size_flip_fails_the_check_in_one_line_naming_the_file(model):
    check(model, "m")  # stat keys recorded: the flip must still be seen
    shard = model / "model.safetensors"
    old = sha(shard)
    flip(shard)
    with pytest.raises(ModelChanged) as e:
        check(model, "tiny:llama:7")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"{shard} changed since the model entered the cache (sha256 {old[:12]}..")
    assert "spill models verify tiny:llama:7" in msg and f"delete {model}" in msg


@pytest.mark.parametrize(
    "damage, text",
    [
        (lambda m: (m / "tokenizer.json").unlink(), "tokenizer.json is missing"),
        (lambda m: (m / "chat_template.jinja").write_text("x"), "was not there"),
        (lambda m: (m / "config.json").write_text("{}"), "config.json changed since"),
    ],
    ids=["missing", "added", "resized"],
)
def test_missing_added_and_resized_files_are_named(model, damage, text):
    damage(model)
    with pytest.raises(ModelChanged, match=text):
        check(model, "m")
    report = verify(model)
    assert report.status == "1 changed" and len(report.problems) == 1 and text in report.problems[0]


def test_verify_rehashes_everything_and_finds_what_the_stat_cannot(model):
    check(model, "m")
    shard = model / "model.safetensors"
    st = shard.stat()
    flip(shard)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    # ctime moved, so even the job-start check sees it; verify re-hashes regardless
    report = verify(model)
    assert report.status == "1 changed" and report.files == 5
    assert report.problems[0].startswith(f"{shard} changed since the model entered the cache")
    flip(shard)  # back to the recorded bytes
    assert verify(model).status == "ok"


def test_a_folder_without_records_is_used_as_it_is_and_verify_says_so(model):
    (model / MARKER).unlink()
    assert check(model, "m") is None
    report = verify(model)
    assert (report.status, report.files, report.problems) == ("no hashes recorded", 0, [])
    assert not (model / MARKER).exists()


@pytest.mark.parametrize(
    "text",
    [
        '{"files": {"model.safetensors": {"size": 1, "sha256": "zz"}}}',
        '{"files": {"model.safetensors": 3}}',
        '{"verified": {"config.json": [1, 2]}}',
        "[1, 2]",
        '{"files": ',
        b"\xff\xfe{}",
    ],
    ids=["bad-hash", "wrong-type", "short-key", "not-object", "truncated", "not-utf8"],
)
def test_an_invalid_record_is_refused_never_trusted_never_rewritten(model, text):
    path = model / MARKER
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    before = path.read_bytes()
    for call in (lambda: read_marker(model), lambda: check(model, "m")):
        with pytest.raises(MarkerInvalid) as e:
            call()
        assert "\n" not in str(e.value) and str(path) in str(e.value)
        assert "delete it" in str(e.value)
    assert verify(model).status == "invalid record"
    with pytest.raises(MarkerInvalid):
        record(model)
    assert path.read_bytes() == before


def test_listing_shows_an_invalid_record_as_a_problem(tiny_models):
    folder = shutil.copytree(tiny_models["qwen2"], models_dir() / "q")
    (folder / MARKER).write_text('{"source": 5}')
    (row,) = list_models()
    assert row["fingerprint"] is None and "not a spill model record" in row["error"]
    assert row["hashes"] == 0 and row["bytes"] > 0


def test_a_hub_snapshot_records_the_sha256_its_blobs_are_named_by(tiny_models):
    from spill.models.sources import hub

    src = tiny_models["llama"]
    repo = hub.hub_cache() / "models--org--tiny"
    snap, blobs = repo / "snapshots" / ("0" * 40), repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in src.iterdir():
        if f.name == MARKER:
            continue
        # LFS files are stored under their sha256, git files under their sha1
        big = f.suffix == ".safetensors"
        blob = blobs / (sha(f) if big else hashlib.sha1(f.read_bytes()).hexdigest())
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    folder = hub.download("org/tiny", "0" * 40, progress=pytest.fail)
    files = read_marker(folder)["files"]
    assert files["model.safetensors"] == {
        "size": (src / "model.safetensors").stat().st_size,
        "sha256": sha(src / "model.safetensors"),
        "from": "hub",
    }
    assert files["config.json"]["from"] == "local"
    assert "model.safetensors" not in read_marker(folder)["verified"]  # hashed at first use
    assert check(folder, "org/tiny") == files
    assert "model.safetensors" in read_marker(folder)["verified"]


def test_resolving_a_tiny_name_records_its_files(tmp_path):
    from spill.models.resolve import resolve_model

    folder = resolve_model("tiny:qwen2:3", progress=lambda _: None).folder
    assert read_marker(folder)["files"]["model.safetensors"]["sha256"] == sha(
        folder / "model.safetensors"
    )
    again = write_tiny(tmp_path / "again", "qwen2", 3)
    assert read_marker(again)["files"] == read_marker(folder)["files"]


def test_explain_names_the_first_changed_weight_file():
    a, b = "a" * 64, "b" * 64
    assert explain({"x.safetensors": a}, {"x.safetensors": a}) is None
    assert explain(None, {"x.safetensors": a}) is None
    assert explain({"x.safetensors": a}, {"x.safetensors": b}) == (
        f"the model's file x.safetensors changed since this run started (sha256 {a[:12]}.. -> {b[:12]}..)"
    )
    gone = explain({"y.safetensors": a, "z.safetensors": a}, {"z.safetensors": a})
    assert gone == "the model's file y.safetensors was removed since this run started"


def test_a_marker_written_by_a_source_validates(model):
    doc = json.loads((model / MARKER).read_text())
    validate(doc, "model-source")


def test_a_legacy_fingerprint_names_the_same_weights_only_while_the_records_hold(
    tmp_path, model, capsys
):
    """A state recorded before the fingerprint covered every byte holds the old value: it still
    names these weights while their files pass the records (one note says so), never another
    model's, never a folder without records, never a folder whose middle bytes changed (which
    the old value cannot see)."""
    from spill.models.cache import cached_fingerprint
    from spill.models.integrity import _legacy_fingerprint, same_weights
    from spill.models.weights import fingerprint

    now = cached_fingerprint(model)
    legacy = _legacy_fingerprint(model)
    assert legacy.startswith("sha256:") and legacy != now
    assert same_weights(now, model, now, "S", "its next checkpoint")
    assert capsys.readouterr().err == ""
    assert same_weights(legacy, model, now, "S", "its next checkpoint")
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        "S was recorded with spill's older weight fingerprint; the weights match it (and their "
        "recorded sha256); its next checkpoint records the new one"
    )
    other = write_tiny(tmp_path / "other", family="llama", seed=8)
    assert not same_weights(_legacy_fingerprint(other), model, now, "S", "x")
    assert not same_weights(None, model, now, "S", "x")

    own = shutil.copytree(model, tmp_path / "own")
    (own / MARKER).unlink()
    assert not same_weights(legacy, own, fingerprint(own), "S", "x")  # nothing to hold it to

    flip(model / "model.safetensors")  # the middle: the old value is blind to it
    assert _legacy_fingerprint(model) == legacy
    assert not same_weights(legacy, model, now, "S", "x")
    assert capsys.readouterr().err == ""
