"""Turn what the user typed (a name and maybe ``--weights <uri>``) into a checked model folder
(``resolve_model``). Every answer is checked (config.json readable, every shard present and whole),
so a broken folder fails here in one line, not mid-run. The ``spill models`` verbs that start from a
name (import, quantize, verify) and ``--quantize``'s copy (``quantized_copy``) resolve it here, then
call the source that writes the folder.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from spill.errors import ModelError, ModelNotFound
from spill.ground.hashing import file_sha256
from spill.ground.paths import models_dir
from spill.models.cache import imported, list_models, read_marker, write_marker
from spill.models.config import load_config
from spill.models.integrity import Verified, verify
from spill.models.names import (
    ALIASES,
    FLOAT_TAG,
    Alias,
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
from spill.models.quant import Spec
from spill.models.sources import hub
from spill.models.sources.offline import (
    genuine_marker,
    gguf_tag,
    import_offline,
    offline_folder,
    refuse_other_bytes,
)
from spill.models.sources.quantize import identity, make_copy, quantized_folder, tag
from spill.models.sources.staging import stage
from spill.models.sources.tiny import generate_tiny, tiny_folder
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
    label = name if name and "://" not in name else uri.rstrip("/").rsplit("/", 1)[-1]
    digest = hashlib.sha256(uri.encode()).hexdigest()[:8]  # one folder per source, never mixed
    dest = models_dir() / "staged" / f"{safe_name(label)}-{digest}"
    stage(uri, dest, progress=progress)
    write_marker(dest, name=label)
    alias = lookup(name)
    model_id = alias.model_id if alias else name.split("@")[0] if looks_like_hub_id(name) else None
    return _checked(ResolvedModel(name or label, model_id, None, dest, "staged"))


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
    marker = genuine_marker(alias, folder)
    return _checked(ResolvedModel(name, alias.model_id, None, folder, marker.get("source", "gguf")))


def _spill_quantized(base: str, tag: str, name: str) -> ResolvedModel:
    """``<name>@q<bits>g<group>``: the copy ``spill models quantize`` made, never made here."""
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


def _tiny(name: str, progress: Progress) -> ResolvedModel | None:
    """A generated tiny model, written to a temporary folder and renamed (never half-written)."""
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
        marker = genuine_marker(alias, local)
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
        marker = genuine_marker(alias, folder)
        return _checked(
            ResolvedModel(alias.name, alias.model_id, None, folder, marker.get("source", "gguf"))
        )
    snapshot = hub.download(alias.model_id, alias.revision, progress=progress)
    return _checked(ResolvedModel(alias.name, alias.model_id, alias.revision, snapshot, "hub"))


# Order: ``--weights`` (or a name that is itself a URI) is staged into ``models/staged`` (a folder
# of the cache itself, such as a bundle's, is used in place); an existing folder is used in place;
# ``tiny:<family>:<seed>[:<layers>x<hidden>]`` is generated on first use; an alias uses its cached
# folder, else imports its packaged GGUF (``smollm2:135m``), else downloads its pinned commit;
# ``org/name[@revision]`` goes to the hub.
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


def quantized_copy(
    model: ResolvedModel, spec: Spec, progress: Callable[[str], object]
) -> ResolvedModel:
    """``model`` as ``--quantize``/``model.quantize`` ask for it: a float model's ``spec`` copy
    ``<name>@q<bits>g<group>``, made on first use (one line says so); an already quantized
    model only when it is that ``spec`` (a copy of a copy would not be the source's values)."""
    if (known := identity(model.folder)) is not None:
        have = Spec(known["bits"], known["group_size"])
        if have == spec:
            return model
        raise ModelError(
            f"{model.name} is already quantized ({known['format']}), so it cannot "
            f"be made {spec.bits}-bit g{spec.group_size}: ask for what it is (--quantize "
            f"{have.bits} --group-size {have.group_size}), or quantize its float model"
        )
    label = f"{model.name}@{tag(spec.bits, spec.group_size)}"
    dest = quantized_folder(model.name, spec.bits, spec.group_size)
    if (dest / "config.json").is_file() and read_marker(dest).get("uri") != str(model.folder):
        # the name's copy came from another folder (a bundle's own weights, a staged copy)
        digest = hashlib.sha256(str(model.folder).encode()).hexdigest()[:8]
        dest = quantized_folder(f"{model.name}-{digest}", spec.bits, spec.group_size)
    if not (dest / "config.json").is_file():
        what = f"the {spec.bits}-bit g{spec.group_size} copy of {model.name}"
        progress(f"making {label}, {what}, in {dest} (first use only)")
        make_copy(model.folder, model.name, model.model_id, spec, dest, lambda line: None)
    check_shapes(load_config(dest), weight_files(dest))  # a damaged copy fails here, in one line
    return replace(model, name=label, revision=None, folder=dest, source="quantized", files=None)


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
    from spill.models.gguf.importer import find_smollm2_gguf, import_gguf

    path = find_smollm2_gguf() if alias is not None else Path(source).expanduser()
    if not path.is_file():
        raise ModelNotFound(f"{source}: no such GGUF file; give a .gguf path or smollm2:135m")
    tag = gguf_tag(path) if keep else "f"
    label = name or (f"{path.stem}@{tag}" if tag != "f" else path.stem)
    dest = models_dir() / safe_name(label)
    digest, fields = file_sha256(path), {"name": label, "source": "gguf", "gguf": str(path)}
    owner = alias_of_folder(dest.name)
    if owner is not None:  # the alias's own folder: its pinned bytes, in their own place, only
        refuse_other_bytes(owner, path, digest, f"would import into {dest}, {owner.name}'s folder")
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


def quantize_model(
    name: str, bits: int, group_size: int = 64, *, progress: Callable[[str], object] = print
) -> Path:
    """``spill models quantize NAME``: its quantized copy in the cache (made once), its folder."""
    model = resolve_model(name, progress=progress)
    dest = quantized_folder(model.name, bits, group_size)
    if (dest / "config.json").is_file():
        progress(f"{model.name}@{tag(bits, group_size)} is already in the cache at {dest}")
        return dest
    make_copy(model.folder, model.name, model.model_id, Spec(bits, group_size), dest, progress)
    progress(f"wrote {model.name}@{tag(bits, group_size)} to {dest}")
    return dest


def verify_models(
    name: str | None, progress: Callable[[str], object]
) -> list[tuple[str, Verified]]:
    """``spill models verify [NAME]``: (the name, ``verify``'s result) for ``name`` (as ``spill
    run`` takes it) or for every cached model."""
    if name:
        targets = [(name, Path(resolve_model(name, progress=progress).folder))]
    else:
        targets = [(m["name"], Path(m["folder"])) for m in list_models()]
    return [(label, verify(folder)) for label, folder in targets]
