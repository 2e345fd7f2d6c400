import hashlib
import re
import shutil
import uuid

import pytest

from spill.errors import ModelNotFound, StoreError
from spill.models.cache import is_model_file, read_marker
from spill.models.sources.staging import stage
from tests.conftest import bucket_uri


def model_files(folder):
    return sorted(p.name for p in folder.iterdir() if is_model_file(p.name))


def assert_same_bytes(dest, source):
    """``dest`` holds exactly ``source``'s model files, each equal byte for byte (not judged by
    spill's own weight fingerprint, which reads headers and sizes, not tensor bytes)."""
    assert model_files(dest) == model_files(source)
    for name in model_files(source):
        assert (dest / name).read_bytes() == (source / name).read_bytes(), name


@pytest.fixture
def source(tiny_models, tmp_path):
    """A private copy of a tiny model plus files staging must leave behind."""
    src = tmp_path / "src"
    shutil.copytree(tiny_models["llama"], src)
    (src / "README.md").write_text("not a model file\n")
    (src / "original").mkdir()
    (src / "original" / "consolidated.00.pth").write_bytes(b"x" * 10)
    return src


@pytest.fixture
def memory_uri(source):
    import fsspec

    fs = fsspec.filesystem("memory")
    root = f"/spill-test-{uuid.uuid4().hex[:8]}/tiny"
    fs.put(str(source), root, recursive=True)
    yield f"memory://{root}"
    fs.rm(root.rsplit("/", 1)[0], recursive=True)


def test_stage_local_folder_copies_model_files_once(source, tmp_path):
    dest = tmp_path / "dest"
    lines = []
    first = stage(str(source), dest, progress=lines.append)
    expected = model_files(source)
    assert model_files(dest) == expected
    assert not (dest / "README.md").exists() and not (dest / "original").exists()
    assert first.files_copied == len(expected) and first.files_skipped == 0
    assert first.bytes_copied == sum((source / n).stat().st_size for n in expected)
    assert_same_bytes(dest, source)
    marker = read_marker(dest)
    assert (marker["source"], marker["uri"]) == ("staged", str(source))
    assert {n: r["sha256"] for n, r in marker["files"].items()} == {
        n: hashlib.sha256((source / n).read_bytes()).hexdigest() for n in expected
    }  # hashed while copying
    assert set(marker["verified"]) == set(expected)
    assert re.fullmatch(
        rf"staged {len(expected)} files, \d+\.\d MB in \d+\.\d s \(0 skipped\)", lines[0]
    )
    assert not [p for p in dest.iterdir() if p.name.startswith(".")]  # no temp files left

    second = stage(str(source), dest, progress=lines.append)
    assert (second.files_copied, second.bytes_copied) == (0, 0)
    assert second.files_skipped == len(expected)
    assert (
        lines[1].startswith("staged 0 files, 0.0 MB") and f"({len(expected)} skipped)" in lines[1]
    )


def test_stage_from_memory_uri_copies_once(memory_uri, source, tmp_path):
    dest = tmp_path / "dest"
    first = stage(memory_uri, dest, progress=lambda _: None)
    assert first.files_copied == len(model_files(source)) and first.bytes_copied > 0
    assert_same_bytes(dest, source)
    second = stage(memory_uri, dest, progress=lambda _: None)
    assert (second.files_copied, second.bytes_copied) == (0, 0)


@pytest.mark.parametrize("store", ["s3", "gs", "az"])
def test_stage_from_a_bucket_against_a_real_server(request, store, source, tmp_path):
    """``--weights s3://`` (moto), ``gs://`` (fake-gcs-server), ``az://`` (Azurite)."""
    from spill.store.fs import filesystem

    bucket = bucket_uri(request, store)
    uri = f"{bucket}/models/tiny"
    fs, path = filesystem(uri)
    fs.put(str(source), path, recursive=True)
    dest = tmp_path / "dest"
    first = stage(uri, dest, progress=lambda _: None)
    assert first.files_copied == len(model_files(source))
    assert_same_bytes(dest, source)
    second = stage(uri, dest, progress=lambda _: None)
    assert (second.files_copied, second.bytes_copied) == (0, 0)

    with pytest.raises(ModelNotFound, match="no such folder"):
        stage(f"{bucket}/models/absent", tmp_path / "x", progress=lambda _: None)


def test_a_file_whose_size_changed_is_copied_again(source, tmp_path):
    dest = tmp_path / "dest"
    stage(str(source), dest, progress=lambda _: None)
    with open(source / "tokenizer.json", "a") as f:
        f.write("\n")
    (dest / "config.json").write_text("{}")  # a damaged local copy is repaired too
    report = stage(str(source), dest, progress=lambda _: None)
    assert report.files_copied == 2
    assert report.bytes_copied == sum(
        (source / n).stat().st_size for n in ("tokenizer.json", "config.json")
    )
    assert (dest / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    assert_same_bytes(dest, source)


def test_a_shard_the_source_no_longer_has_is_removed(tiny_models, tmp_path):
    from spill.models.sources.tiny import write_tiny

    src = write_tiny(tmp_path / "src", family="qwen2", seed=1, shards=2)
    dest = tmp_path / "dest"
    stage(str(src), dest, progress=lambda _: None)
    assert len(list(dest.glob("*.safetensors"))) == 2
    stage(str(tiny_models["qwen2"]), dest, progress=lambda _: None)  # same folder, new source
    assert model_files(dest) == model_files(tiny_models["qwen2"])
    assert_same_bytes(dest, tiny_models["qwen2"])


def test_missing_folder_or_config_is_one_line(source, tmp_path):
    with pytest.raises(ModelNotFound, match="no such folder"):
        stage(str(tmp_path / "absent"), tmp_path / "d1", progress=lambda _: None)
    (source / "config.json").unlink()
    with pytest.raises(ModelNotFound) as e:
        stage(str(source), tmp_path / "d2", progress=lambda _: None)
    assert "no config.json" in str(e.value) and "\n" not in str(e.value)


def test_unknown_scheme_is_a_store_error(tmp_path):
    with pytest.raises(StoreError):
        stage("nosuchscheme://bucket/model", tmp_path / "d", progress=lambda _: None)
