"""A location seen from this machine's disk: for the tools and checks that need a file here.

``same_file`` (two locations are one local file), ``local_copy`` (a folder of a location as a
local folder: itself on a disk, else its named files copied), ``local_folder`` (a folder to
write at a location, written on this disk: itself, else a scratch folder uploaded after),
``put_file`` (a file written on this disk published at a location, unless it is already there).
``Location.on_disk`` is the local path below a location where there is one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from spill.store.fs import get_bytes, put_bytes
from spill.store.location import location


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two locations name one local file: the same inode when both exist (hard links,
    symlinks), else the same resolved path; never for an object store's."""
    a, b = location(a), location(b)
    if not (a.local and b.local):
        return False
    try:
        return os.path.samefile(a.path, b.path)
    except OSError:  # one of them does not exist (yet)
        return os.path.realpath(a.path) == os.path.realpath(b.path)


def local_copy(uri: str | os.PathLike, names: tuple[str, ...], into: Path | None = None) -> Path:
    """The folder at ``uri`` as a local folder: itself on a disk, else ``names`` copied from it
    into the folder ``into`` (made if missing; a new temporary folder when None)."""
    if (here := location(uri).on_disk()) is not None:
        return Path(here)
    into = into or Path(tempfile.mkdtemp(prefix="spill-adapter-"))
    into.mkdir(exist_ok=True)
    for name in names:
        (into / name).write_bytes(get_bytes(location(uri).join(name)))
    return into


@contextmanager
def local_folder(uri: str | os.PathLike, scratch: Path, *, last: str) -> Iterator[Path]:
    """A local path to write the flat folder at ``uri`` through: its own path on a disk, else
    ``scratch``, whose files are put at ``uri`` when the block ends (``last`` last: the file
    that says the folder is whole) and which is then removed. A block that raises puts nothing."""
    where = location(uri)
    if (here := where.on_disk()) is not None:
        yield Path(here)
        return
    yield scratch
    names = sorted(p.name for p in scratch.iterdir())
    for name in [n for n in names if n != last] + [last]:
        put_bytes(where.join(name), (scratch / name).read_bytes())
    shutil.rmtree(scratch)


def put_file(path: Path, uri: str | os.PathLike) -> None:
    """Publish the local file ``path`` at ``uri``, unless it is that file already."""
    if not same_file(path, uri):
        put_bytes(uri, path.read_bytes())
