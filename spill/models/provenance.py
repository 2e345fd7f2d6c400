"""Where a model name lives in the cache (``home``), and the files its own source gives for it here
(``genuine``). The cache folder is shared by every project on the machine, so bytes that arrive from
elsewhere (a bundle) may fill it only when they equal what the name's pinned source gives on this
machine; a name whose source cannot say is ``Unverifiable``, and such bytes never take the name. The
genuine files are written to a folder the caller names, on the cache's file system, with the record
a first use writes, so a caller whose bytes matched renames that folder into place.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from spill.errors import ModelError, ModelNotFound
from spill.ground.hashing import file_sha256
from spill.models.cache import read_marker
from spill.models.integrity import record, weight_hashes
from spill.models.names import (
    FLOAT_TAG,
    alias_for_model_id,
    looks_like_hub_id,
    lookup,
    parse_tiny,
    split_quant,
)
from spill.models.sources.hub import git_blob_id, hub_cache, reported_files
from spill.models.sources.offline import import_offline, offline_folder
from spill.models.sources.quantize import quantize_folder, quantized_folder
from spill.models.sources.tiny import generate_tiny, tiny_folder

# a tiny model is generated only when its size is near the bytes offered for it: a hostile name
# (tiny:llama:1:64x8192) must not make a check write gigabytes for a bundle of kilobytes
_TINY_SLACK = 4


class Unverifiable(ModelError):
    """A model whose source cannot say here which bytes it has."""


def _tiny(name: str):
    try:
        return parse_tiny(name)
    except ModelError:
        return None


def home(name: str, source: Mapping[str, Any]) -> Path | None:
    """The cache folder ``name`` resolves to on this machine for a model from ``source`` (the
    bundle manifest's pin: kind, model_id, revision), or None when no fixed folder is its."""
    spec = _tiny(name)
    if spec is not None:
        return tiny_folder(spec)
    kind = source.get("kind")
    base, tag = split_quant(name)
    if tag is not None and tag[2:3] == "g":  # spill's copy of a float model (q4g64)
        return _spill_copy(base, tag, kind)
    alias = lookup(base if tag else name)
    if alias is not None and alias.offline and kind == "gguf":
        return offline_folder(alias, tag)[0]
    if tag is not None:
        return None
    model_id, _, revision = name.strip().partition("@")
    if alias is not None:
        model_id, revision = alias.model_id, alias.revision
    elif not looks_like_hub_id(name):
        return None
    elif not revision:  # an alias's hub id means its pinned commit; anything else "main"
        pinned = alias_for_model_id(model_id)
        if pinned is None:
            return None
        revision = pinned.revision
    if kind != "hub" or source.get("revision") != revision or source.get("model_id") != model_id:
        return None
    return hub_cache() / f"models--{model_id.replace('/', '--')}" / "snapshots" / revision


def _spill_copy(base: str, tag: str, kind: Any) -> Path | None:
    """Where ``spill models quantize`` keeps ``<base>@q<bits>g<group>``, for a base whose own
    source is here (a tiny seed, the offline GGUF), else None."""
    spec, alias = _tiny(base), lookup(base)
    if kind != "imported" or (spec is None and (alias is None or not alias.offline)):
        return None
    bits, group = (int(x) for x in tag[1:].split("g"))
    return quantized_folder(spec.name if spec else alias.name, bits, group)


def _estimated_tiny_bytes(spec) -> int:
    # bf16 weights: about 11 h^2 per layer (attention 3.5, MLP 7.5) plus the embedding
    return 2 * (11 * spec.layers * spec.hidden**2 + 259 * spec.hidden)


# What each source gives here:
# - ``tiny:<family>:<seed>[:<layers>x<hidden>]`` is generated again from its seed (the same bytes on
#   every machine);
# - an alias served by an offline GGUF (``smollm2:135m``, ``@q4_1`` its quantization kept as the
#   bare name keeps it, ``@f32`` the float import) is imported again from the GGUF installed here,
#   when one is (the import of one GGUF always gives the same bytes);
# - ``spill models quantize``'s copy of either (``tiny:llama:1@q4g64``) is made again from that
#   source, then quantized (the quantizer is deterministic);
# - a hub snapshot at a pinned commit is compared with what the hub reports for that commit
#   (``hub_differs``: each LFS file's sha256, each small file's git blob id), when the hub can be
#   asked;
# - anything else (a user's own import, a folder outside the cache) has no source to ask: such bytes
#   never take the name.
def genuine(
    name: str,
    source: Mapping[str, Any],
    offered: int,
    tmp: Path,
    progress: Callable[[str], object],
) -> Path:
    """Write into the new folder ``tmp`` (on the cache's file system) the files the name's
    source gives here, with their cache record; raises ``Unverifiable`` (why, in words) when it
    cannot. ``offered``: the bytes offered for the model, which bounds what a tiny check makes."""
    where = home(name, source)
    if where is None:
        raise Unverifiable(f"{name} has no fixed folder in the model cache")
    base, tag = split_quant(name)
    bits = int(tag[1]) if tag and tag[2:3] == "g" else None  # spill's copy: quantized here
    spec, alias = _tiny(base), lookup(base)
    if spec is None and not (alias is not None and alias.offline):
        raise Unverifiable(f"{name}'s source (the hub) cannot be asked without the network")
    if bits is not None:
        offered *= 32 // bits  # its float32 form is at most this much larger
    if spec is not None and _estimated_tiny_bytes(spec) > _TINY_SLACK * offered + (8 << 20):
        raise Unverifiable(
            f"{spec.name} would be about {_estimated_tiny_bytes(spec) / 1e6:.0f} MB, far more "
            f"than the {offered / 1e6:.1f} MB offered for it"
        )
    float_dir = tmp.with_name(tmp.name + "-float") if bits is not None else tmp
    try:
        if spec is not None:
            float_dir.mkdir()
            generate_tiny(spec, float_dir)
        else:
            _offline_gguf(alias, source, float_dir, progress, FLOAT_TAG if bits else tag)
        if bits is not None:
            _quantized_here(spec.name if spec else alias.name, tag, float_dir, tmp, progress)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if float_dir != tmp:
            shutil.rmtree(float_dir, ignore_errors=True)
    return tmp


def _quantized_here(base: str, tag: str, float_dir: Path, tmp: Path, progress) -> None:
    """``spill models quantize``'s copy of the float model in ``float_dir``, written to ``tmp``
    with the record it writes (its source, the float folder of this cache)."""
    bits, group = (int(x) for x in tag[1:].split("g"))
    quantize_folder(float_dir, tmp, bits, group, progress)
    spec, alias = _tiny(base), lookup(base)
    origin = tiny_folder(spec) if spec else offline_folder(alias, FLOAT_TAG)[0]
    fields = {"name": f"{base}@{tag}", "source": "quantized", "uri": str(origin)}
    record(tmp, model_id=base if spec else alias.model_id, **fields)


def _offline_gguf(alias, source: Mapping[str, Any], tmp: Path, progress, tag: str | None) -> None:
    """The offline GGUF imported again into ``tmp`` as the name's tag asks (its quantization
    kept, or the float import); the source's ``gguf_sha256`` must be the installed file's."""
    from spill.models.gguf.importer import find_smollm2_gguf  # the gguf package: only when asked

    try:
        gguf = find_smollm2_gguf()
    except ModelNotFound:
        raise Unverifiable(f"the GGUF that serves {alias.name} is not installed here") from None
    want = source.get("gguf_sha256")
    if want and file_sha256(gguf) != want:
        raise Unverifiable(f"the GGUF installed here ({gguf.name}) is another file than its source")
    import_offline(alias, tmp, progress, keep=offline_folder(alias, tag)[1])


def hub_differs(
    name: str, source: Mapping[str, Any], files: Mapping[str, tuple[int, str]], read
) -> str:
    """``""`` when the hub reports exactly ``files`` (name -> size, sha256) for the commit the
    name pins, else the first difference in words; ``read(file name) -> bytes`` gives a small
    file's bytes (the hub names those by git blob id, not sha256). Raises ``Unverifiable`` when
    the hub cannot be asked."""
    if home(name, source) is None or source.get("kind") != "hub":
        raise Unverifiable(f"{name} is no hub snapshot at a pinned commit")
    try:
        reported = reported_files(source["model_id"], source["revision"])
    except ModelNotFound as e:
        raise Unverifiable(str(e)) from None
    if set(reported) != set(files):
        extra = sorted(set(files) ^ set(reported))[0]
        return f"the hub's file list differs ({extra})"
    for fname, (size, sha) in sorted(files.items()):
        want = reported[fname]
        if want["size"] is not None and want["size"] != size:
            return f"{fname} is {size} bytes, the hub's {want['size']}"
        if want["sha256"] is not None:
            if want["sha256"] != sha:
                return f"{fname}'s sha256 is not the hub's"
        elif want["oid"] is None or git_blob_id(read(fname)) != want["oid"]:
            return f"{fname} is not the hub's file"
    return ""


def describe_base(name: str, files: Mapping[str, str] | None) -> dict[str, Any]:
    """What a model name's weights are, for a note beside an export: the hub repository and
    commit the name pins (what PEFT can resolve), and, when ``files`` (the weight files' sha256
    a run recorded) are those of the GGUF import in this cache, that GGUF file and its sha256."""
    out: dict[str, Any] = {"name": name, "hub": None, "revision": None}
    alias = lookup(name)
    model_id, _, revision = name.strip().partition("@")
    if alias is not None:
        out.update(hub=alias.model_id, revision=alias.revision)
    elif _tiny(name) is None and looks_like_hub_id(name):
        pinned = alias_for_model_id(model_id)
        out.update(hub=model_id, revision=revision or (pinned.revision if pinned else None))
    base, tag = split_quant(name)
    offline = lookup(base) if tag is None or tag[2:3] != "g" else None
    if offline is not None and offline.offline and files:
        marker = read_marker(offline_folder(offline, tag)[0])
        if marker.get("source") == "gguf" and weight_hashes(marker.get("files")) == dict(files):
            out.update(gguf=marker.get("file"), gguf_sha256=marker.get("sha256"))
    return out
