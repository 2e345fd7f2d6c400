"""Bundles as untrusted input: hand-made malicious and damaged bundles (tarfile here), each
refused in one line before anything is written to DIR or SPILL_HOME/models; a good one installs."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import shutil
import tarfile
from pathlib import Path

import pytest

from spill.project.bundle.format import MANIFEST, BundleError
from spill.project.bundle.install import install
from spill.project.bundle.read import open_bundle, verify

ROOT = Path(__file__).resolve().parents[4]
MODEL = "tiny/tiny-llama-9-2x64"
GOOD = {
    "project/spill.yaml": b"name: x\n",
    "project/data.csv": b"text,label\na,b\n",
    f"models/{MODEL}/config.json": b"{}\n",
    f"models/{MODEL}/model.safetensors": bytes(range(256)) * 64,
}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def real_tiny() -> dict[str, bytes]:
    """GOOD with the files tiny:llama:9:2x64 really has (its seed makes the same bytes here)."""
    import tempfile

    from spill.models.sources.tiny import write_tiny

    with tempfile.TemporaryDirectory() as d:
        write_tiny(Path(d), "llama", 9, 2, 64)
        model = {
            f"models/{MODEL}/{p.name}": p.read_bytes()
            for p in sorted(Path(d).iterdir())
            if p.name != "spill-source.json"
        }
    return {k: v for k, v in GOOD.items() if not k.startswith("models/")} | model


def manifest(files: dict[str, bytes], **edit) -> dict:
    model = [
        {"name": n.rsplit("/", 1)[1], "size": len(d), "sha256": _sha(d)}
        for n, d in files.items()
        if n.startswith("models/")
    ]
    doc = {
        "schema_version": 1,
        "kind": "spill-bundle",
        "created": "2026-01-01T00:00:00Z",
        "spill": "0.1.0",
        "project": {"name": "x", "id": None},
        "bytes": sum(len(d) for d in files.values()),
        "files": [
            {
                "path": n,
                "role": "model" if n.startswith("models/") else n.split("/")[0],
                "size": len(d),
                "sha256": _sha(d),
            }
            for n, d in files.items()
        ],
        "models": [
            {
                "name": "tiny:llama:9:2x64",
                "used_by": ["model.name"],
                "folder": MODEL,
                "source": {"kind": "tiny", "family": "llama", "seed": 9},
                "files": model,
            }
        ]
        if model
        else [],
        "run": None,
    }
    doc.update(edit)
    return doc


def make(
    path: Path,
    files: dict[str, bytes] | None = None,
    doc: dict | None = None,
    extra: list[tuple[tarfile.TarInfo, bytes | None]] = (),
    skip: tuple[str, ...] = (),
) -> Path:
    """A bundle file: the manifest first, then ``files`` (less ``skip``), then ``extra``."""
    files = dict(GOOD if files is None else files)
    raw = json.dumps(doc if doc is not None else manifest(files)).encode()
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        info = tarfile.TarInfo(MANIFEST)
        info.size = len(raw)
        tf.addfile(info, io.BytesIO(raw))
        for name, data in files.items():
            if name in skip:
                continue
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        for info, data in extra:
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


@pytest.fixture
def place(tmp_path, spill_home):
    """DIR, and ``watch()``: records the tmp folder and SPILL_HOME/models now and returns a
    check that neither changed since."""
    dest, models = tmp_path / "dest", spill_home / "models"
    models.mkdir(parents=True)
    (models / "keep").write_text("x")

    def watch():
        before = (tree(tmp_path), tree(models))

        def unchanged() -> None:
            assert (tree(tmp_path), tree(models)) == before

        return unchanged

    return dest, watch


def _entry(name: str, kind: bytes, link: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info, None


def _file(name: str, data: bytes = b"evil") -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


MALICIOUS = {
    "dotdot": ([_file("project/../evil")], "'..'"),
    "absolute": ([_file("/tmp/evil")], "absolute"),
    "symlink": ([_entry("project/link", tarfile.SYMTYPE, "/etc/passwd")], "symbolic link"),
    "hardlink": ([_entry("project/hard", tarfile.LNKTYPE, "project/spill.yaml")], "hard link"),
    "device": ([_entry("project/dev", tarfile.CHRTYPE)], "character device"),
    "fifo": ([_entry("project/fifo", tarfile.FIFOTYPE)], "fifo"),
    "folder": ([_entry("project/sub", tarfile.DIRTYPE)], "a folder"),
    "hidden": ([_file("project/.git/hooks/post-checkout")], "hidden"),
    "outside": ([_file("elsewhere/x")], "outside project/"),
    "unlisted": ([_file("project/unlisted.txt")], "not in its manifest"),
    "backslash": ([_file("project/a\\..\\b")], "backslash"),
    "twice-by-case": ([_file("project/SPILL.yaml")], "twice"),
}


@pytest.mark.parametrize("case", list(MALICIOUS), ids=list(MALICIOUS))
def test_malicious_entries_are_refused_before_anything_is_written(tmp_path, place, case):
    extra, why = MALICIOUS[case]
    path = make(tmp_path / "b.spb", extra=extra)
    dest, watch = place
    unchanged = watch()
    for call in (lambda: open_bundle(path), lambda: install(path, dest)):
        with pytest.raises(BundleError, match="b.spb") as e:
            call()
        assert why in str(e.value) and "\n" not in str(e.value)
    unchanged()


def _bad_manifests() -> dict[str, tuple[dict, str]]:
    m = manifest(GOOD)
    out = {}
    out["missing-file"] = (
        {**m, "files": [*m["files"], {**m["files"][0], "path": "project/x"}]},
        "missing",
    )
    out["newer-format"] = ({**m, "schema_version": 2, "files": "anything"}, "newer spill")
    out["off-schema"] = ({**m, "files": [{**m["files"][0], "size": "big"}]}, "schema")
    out["model-folder-escapes"] = (
        {**m, "models": [{**m["models"][0], "folder": "../../etc"}]},
        "schema",
    )
    out["role-mismatch"] = (
        {**m, "files": [{**m["files"][0], "role": "state"}, *m["files"][1:]]},
        "state file",
    )
    out["unpinned-model-file"] = ({**m, "models": []}, "no model pins")
    out["not-a-manifest"] = ({"hello": 1}, "not a spill-bundle manifest")
    return out


@pytest.mark.parametrize("case", list(_bad_manifests()))
def test_bad_manifests_are_refused_before_anything_is_written(tmp_path, place, case):
    doc, why = _bad_manifests()[case]
    path = make(tmp_path / "b.spb", doc=doc)
    dest, watch = place
    unchanged = watch()
    with pytest.raises(BundleError, match=why):
        install(path, dest)
    unchanged()


def test_manifest_not_first_is_refused(tmp_path, place):
    path = tmp_path / "b.spb"
    raw = json.dumps(manifest(GOOD)).encode()
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in [*GOOD.items(), (MANIFEST, raw)]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    unchanged = place[1]()
    with pytest.raises(BundleError, match="first entry"):
        install(path, place[0])
    unchanged()


def _flip(path: Path, needle: bytes) -> None:
    data = bytearray(path.read_bytes())
    at = data.index(needle, 1024)  # past the manifest
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


CORRUPT = {
    "project-byte": (lambda p: _flip(p, b"text,label"), "project/data.csv: damaged"),
    "model-byte": (lambda p: _flip(p, bytes(range(40, 60))), "model.safetensors: damaged"),
    "truncated": (
        lambda p: p.write_bytes(p.read_bytes()[: p.read_bytes().index(bytes(range(256))) + 100]),
        "model.safetensors: cut short",
    ),
}


@pytest.mark.parametrize("case", list(CORRUPT))
def test_corruptions_are_named_by_verify_and_install(tmp_path, place, case):
    damage, line = CORRUPT[case]
    path = make(tmp_path / "b.spb")
    damage(path)
    unchanged = place[1]()
    problems = verify(open_bundle(path))
    assert len(problems) == 1 and line in problems[0]
    with pytest.raises(BundleError, match=line):
        install(path, place[0])
    unchanged()


def test_missing_model_file_is_named(tmp_path, place):
    path = make(tmp_path / "b.spb", skip=(f"models/{MODEL}/model.safetensors",))
    unchanged = place[1]()
    problems = verify(open_bundle(path))
    assert problems == [
        f"models/{MODEL}/model.safetensors: missing from the bundle (the manifest names it)"
    ]
    with pytest.raises(BundleError, match="model.safetensors: missing"):
        install(path, place[0])
    unchanged()


def test_good_bundle_installs_and_keeps_model_files_already_there(tmp_path, spill_home):
    files = real_tiny()
    path = make(tmp_path / "b.spb", files)
    assert verify(open_bundle(path)) == []
    out = install(path, tmp_path / "a")
    assert (tmp_path / "a" / "data.csv").read_bytes() == GOOD["project/data.csv"]
    folder = spill_home / "models" / MODEL  # its bytes are the seed's: it takes its own name
    for name, data in files.items():
        if name.startswith("models/"):
            assert (folder / name.rsplit("/", 1)[1]).read_bytes() == data
    marker = json.loads((folder / "spill-source.json").read_text())
    cfg = files[f"models/{MODEL}/config.json"]
    assert marker["source"] == "tiny" and marker["files"]["config.json"]["sha256"] == _sha(cfg)
    assert out["model_files_written"] == 5 and out["models_own"] == []
    record = json.loads((tmp_path / "a" / ".spill-bundle.json").read_text())
    assert record["models"] == {} and record["bundle"] == "b.spb"
    again = install(path, tmp_path / "b")  # the same model files: kept, not copied again
    assert (again["model_files_written"], again["model_files_kept"]) == (0, 5)
    hidden = [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert hidden == [] and not any(p.name.startswith(".") for p in folder.parent.iterdir())
    assert sorted(p.name for p in (spill_home / "models").iterdir()) == ["tiny"]


def test_bytes_unlike_the_seeds_install_under_a_folder_of_their_own(tmp_path, spill_home):
    """GOOD's model files are not what tiny:llama:9:2x64 is: they never take its folder."""
    from spill.models.resolve import resolve_model
    from spill.project.bundle.models import key

    out = install(make(tmp_path / "b.spb"), tmp_path / "a")
    models = spill_home / "models"
    assert out["models_own"] == ["tiny:llama:9:2x64"] and not (models / MODEL).exists()
    files = {n.rsplit("/", 1)[1]: _sha(d) for n, d in GOOD.items() if n.startswith("models/")}
    own = models / "bundled" / key(files)[:16]
    assert (own / "model.safetensors").read_bytes() == GOOD[f"models/{MODEL}/model.safetensors"]
    record = json.loads((tmp_path / "a" / ".spill-bundle.json").read_text())
    pin = record["models"]["tiny:llama:9:2x64"]
    assert pin["folder"] == f"bundled/{key(files)[:16]}" and "differ" in pin["why"]
    marker = json.loads((own / "spill-source.json").read_text())
    assert marker["source"] == "bundle" and marker["bundle"]["source"]["kind"] == "tiny"
    # every other project naming the model gets the seed's bytes, generated afresh
    resolved = resolve_model("tiny:llama:9:2x64", progress=lambda _: None)
    assert resolved.folder == models / MODEL
    assert (resolved.folder / "model.safetensors").read_bytes() != GOOD[
        f"models/{MODEL}/model.safetensors"
    ]


def test_install_into_a_non_empty_folder_needs_force(tmp_path, spill_home):
    path = make(tmp_path / "b.spb")
    dest = tmp_path / "d"
    dest.mkdir()
    (dest / "old.txt").write_text("old")
    with pytest.raises(BundleError, match="not empty"):
        install(path, dest)
    with pytest.raises(BundleError, match="only a project a bundle installed"):
        install(path, dest, force=True)  # a folder no install made is never replaced
    assert (dest / "old.txt").read_text() == "old"
    install(path, tmp_path / "e")
    (tmp_path / "e" / "mine.txt").write_text("mine")
    install(path, tmp_path / "e", force=True)  # a previous install: replaced
    assert sorted(p.name for p in (tmp_path / "e").iterdir()) == [
        ".spill-bundle.json",
        "data.csv",
        "spill.yaml",
    ]
    for where, says in (
        (spill_home.parent, "above SPILL_HOME"),
        (spill_home / "models", "inside SPILL_HOME"),
        (spill_home / "models" / "new", "inside SPILL_HOME"),
    ):
        with pytest.raises(BundleError, match=says):
            install(path, where, force=True)


# --- the fast paths (report 007): pack from the build's record, install's copy ----------------


def test_pack_takes_the_config_from_a_matching_build_record(tmp_path, monkeypatch):
    """A record whose compose key matches is used as is (no Hydra); any other is not."""
    from spill.project import config
    from spill.project.build import record
    from spill.project.bundle import pack as bundle_pack
    from spill.project.sources import compose_key

    root = tmp_path / "toy"
    shutil.copytree(ROOT / "projects" / "toy", root, ignore=shutil.ignore_patterns(".spill"))
    recorded = config.compose(root).to_dict()
    recorded["model"] = {"name": "tiny:llama:77"}  # tells the record from a fresh compose
    doc = {"compose_key": compose_key(root), "config": recorded}
    monkeypatch.setattr(record, "read", lambda state: doc)
    composed = []
    real = config.compose
    monkeypatch.setattr(config, "compose", lambda r: composed.append(r) or real(r))
    assert bundle_pack.project_config(root, str(root / ".spill")).model.name == "tiny:llama:77"
    assert composed == []
    doc["compose_key"] = "sha256:" + "0" * 64  # spill.yaml changed since the build
    assert bundle_pack.project_config(root, str(root / ".spill")).model.name != "tiny:llama:77"
    assert composed == [root]


@pytest.mark.parametrize("kernel", [True, False], ids=["copy_file_range", "no-kernel-copy"])
def test_copy_into_hashes_the_bytes_written(tmp_path, monkeypatch, kernel):
    from spill.project.bundle import format as bf

    if not kernel:

        def refuse(*a, **k):
            raise OSError(errno.EXDEV, "cross-device")

        monkeypatch.setattr(os, "copy_file_range", refuse, raising=False)
    data = os.urandom(bf.CHUNK * 2 + 12345)
    src = tmp_path / "src"
    src.write_bytes(b"head" + data + b"tail")
    hasher = bf.Hasher()
    try:
        with open(src, "rb", buffering=0) as s, open(tmp_path / "out", "x+b", buffering=0) as o:
            got = hasher.copy_into(s, 4, o, len(data))
        with open(src, "rb", buffering=0) as s, open(tmp_path / "short", "x+b", buffering=0) as o:
            short = hasher.copy_into(s, len(data), o, 100)  # the source ends early
    finally:
        hasher.close()
    assert got == (len(data), _sha(data)) and (tmp_path / "out").read_bytes() == data
    assert short == (8, _sha(data[-4:] + b"tail"))
    with open(src, "rb", buffering=0) as s, open(tmp_path / "plain", "wb", buffering=0) as o:
        o.write(b"x")
        assert bf.copy_plain(s, o, 10) == 10
    assert (tmp_path / "plain").read_bytes() == b"x" + (b"head" + data)[:10]


def test_install_without_kernel_copy_still_refuses_damage(tmp_path, spill_home, monkeypatch):
    def refuse(*a, **k):
        raise OSError(errno.EXDEV, "cross-device")

    monkeypatch.setattr(os, "copy_file_range", refuse, raising=False)
    install(make(tmp_path / "b.spb"), tmp_path / "a")
    assert (tmp_path / "a" / "data.csv").read_bytes() == GOOD["project/data.csv"]
    path = make(tmp_path / "bad.spb")
    raw = bytearray(path.read_bytes())
    raw[raw.index(GOOD["project/data.csv"])] ^= 1  # the model files are cached now: kept
    path.write_bytes(raw)
    with pytest.raises(BundleError, match="data.csv: damaged"):
        install(path, tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_a_path_too_long_under_dir_is_refused_before_anything_is_written(tmp_path, place):
    """Each name fits, but DIR's own path plus a deep entry passes PATH_MAX (4096 here)."""
    deep = "project/" + "/".join(["p" * 200] * 4) + "/f"
    path = make(tmp_path / "b.spb", {**GOOD, deep: b"x"})
    dest = tmp_path.joinpath(*["d" * 200] * 19)  # ~3.9 kB of folders
    unchanged = place[1]()
    with pytest.raises(BundleError, match="longer than this file system takes"):
        install(path, dest)
    unchanged()


def test_a_damaged_model_file_is_refused_even_when_the_cache_holds_it(tmp_path, spill_home):
    """Issue 21: every byte of a bundle is hashed on install, also the model files the cache
    already holds (which are not copied): the damaged one is named, the good copy kept."""
    files = real_tiny()
    install(make(tmp_path / "good.spb", files), tmp_path / "a")
    cached = spill_home / "models" / MODEL / "model.safetensors"
    before = cached.read_bytes()
    path = make(tmp_path / "bad.spb", files)
    raw = bytearray(path.read_bytes())
    raw[raw.index(before[-4096:])] ^= 1  # inside the model file's bytes, as the bundle holds them
    path.write_bytes(bytes(raw))
    with pytest.raises(BundleError, match=f"models/{MODEL}/model.safetensors: damaged"):
        install(path, tmp_path / "b")
    assert cached.read_bytes() == before and not (tmp_path / "b").exists()
