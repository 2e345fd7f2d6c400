"""The one check of an output a person names (``--out``, ``-o``, ``spill export``'s OUT), made by
every verb that writes one before anything runs (``refuse_output``): a usage error (exit 2) when the
output would overwrite what spill keeps (a project's ``spill.yaml``, its data file, its other config
files, everything under its state folder), or is not something a file can be written to (a folder, a
block device or a socket). A FIFO or a character device is an output (``/dev/stdout``, a pipe a
reader waits on): ``spill.store.output.put_output`` writes into it and never renames a file over it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from spill.errors import UsageError
from spill.ground.paths import STATE_DIR
from spill.store.disk import same_file
from spill.store.fs import kind_of
from spill.store.location import on_disk
from spill.store.output import STREAMS

FILE = "spill.yaml"


# What spill keeps: a project's ``spill.yaml``, its data file (``data.file`` as spill.yaml names
# it), its other config files (an existing ``*.yaml`` beside spill.yaml or in a group folder under
# it, such as ``tune/mine.yaml``, and ``spill.schema.json``) and everything under its state folder
# (``.spill/``, or a ``--state`` the command names). The projects are every folder above the output
# that holds a spill.yaml, and those the command names (``spill predict DIR``, ``spill report
# DIR``); files are compared by inode as well as by resolved path, so a symlink or a hard link to a
# project's file is refused as the file is. Any folder named ``.spill`` above the output is a state
# (a project's whose spill.yaml is elsewhere, or spill's own home), wherever it lies.
def refuse_output(
    out: str | os.PathLike | None,
    flag: str,
    *,
    projects: Iterable[str | os.PathLike | None] = (),
    states: Iterable[str | None] = (),
    folder: bool = False,
) -> None:
    """Raise ``UsageError`` when ``out`` is kept by spill or cannot take a file (see the comment
    above); ``folder``: the output is a folder to fill (export), so an existing one is no refusal."""
    path = None if out is None else on_disk(out)
    if path is None:
        return  # a URI: no file on this disk to compare it with
    real = os.path.realpath(path)
    what = kind_of(real)
    if not folder and what and what not in STREAMS:
        raise UsageError(f"{flag} {out} is {what}, not a file; name a file to write")
    named = [Path(p) for d in projects if d is not None and (p := on_disk(d)) is not None]
    kept = _kept(path, real, named, states)
    if kept:
        raise UsageError(f"{flag} {out} is {kept}; write the results elsewhere")


def _kept(path: str, real: str, named: list[Path], states: Iterable[str | None]) -> str | None:
    """What ``path`` (resolved: ``real``) is of what spill keeps, else None."""
    above = [Path(real), *Path(real).parents]
    for d in above:
        if d.name == STATE_DIR and d.is_dir():
            return _in("the state folder", d, real)
    roots = [d for d in above[1:] if (d / FILE).is_file()]
    for root in dict.fromkeys([*roots, *(p.resolve() for p in named)]):
        if same_file(path, root / FILE):
            return f"the spill.yaml of the project {root}"
        data = data_file(root)
        if data is not None and same_file(path, data):
            return f"the data file of the project {root} (data.file)"
        if _config_file(Path(real), root):
            return f"a config file of the project {root}"
        state = os.path.realpath(root / STATE_DIR)
        if _inside(real, state):
            return _in("the state folder", Path(state), real)
    for where in states:
        if where is not None and (here := on_disk(where)) is not None:
            state = os.path.realpath(here)
            if _inside(real, state):
                return _in("the state location", Path(state), real)
    return None


def data_file(root: Path) -> Path | None:
    """The data file ``root/spill.yaml`` names (None when it names none it can be read for)."""
    import yaml  # lazy: PyYAML, when used

    try:
        doc = yaml.safe_load((root / FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        return None
    data = doc.get("data") if isinstance(doc, dict) else None
    name = data.get("file") if isinstance(data, dict) else None
    return root / name if isinstance(name, str) and name and "\0" not in name else None


def _config_file(real: Path, root: Path) -> bool:
    """An existing config file of the project at ``root``: its schema copy, or a YAML file
    beside spill.yaml or one folder down (Hydra reads group options from there)."""
    if not real.is_file() or not _inside(str(real), str(root)):
        return False
    depth = len(real.relative_to(root).parts)
    return real.name == "spill.schema.json" or (real.suffix in (".yaml", ".yml") and depth <= 2)


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _in(what: str, folder: Path, real: str) -> str:
    return f"{what} {folder}" if real == str(folder) else f"inside {what} {folder}"
