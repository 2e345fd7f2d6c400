"""A state location parsed once: ``location(text)`` -> ``Location``, which every layer takes: the
text a user gave (a ``str``) plus its scheme (``""`` for a local path), the local path it names
(``file:///p`` and ``~`` resolved), the fsspec filesystem of a remote one (made once, on first use)
and how its control keys are written conditionally (``writes``). A scheme that is no place for runs
(``ftp://``, ``http://``) is refused when parsed, before any backend is made or connects.
``on_disk(text)`` is the local path of text not taken as a state (an output, an adapter folder):
None for any URI.
"""

from __future__ import annotations

import os
from functools import cached_property
from pathlib import PurePosixPath

from spill.errors import StoreError

# fsspec's names of the stores spill keeps runs on (the cloud ones through the cloud extra)
# A new store changes this module (its scheme in ``SCHEMES``; how its control keys are written,
# ``WRITES``) and ``spill.store.cas.objects`` (its answers; its probe, run once per bucket, refuses
# a store whose conditional writes do not hold).
SCHEMES = frozenset({"memory", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})
WHERE = "use a local path, s3://, gs://, az:// or memory://"
CLOUD_HINT = 'pip install "streamweights[cloud]"'
# how a location's control keys are written conditionally (``spill.store.cas``)
WRITES = {"": "flock", "memory": "process"}  # every other scheme: "object" (If-Match, probed)


class BackendMissing(StoreError):
    """A URI scheme whose fsspec backend is not installed."""


def scheme_of(text: str) -> str:
    head, sep, _ = text.partition("://")
    return head.lower() if sep and "/" not in head else ""


def local_path(text: str) -> str:
    """The local path a local location's text names: ``file:///p`` and ``file://localhost/p``
    are ``/p``; a ``file://`` URI naming another host is refused in one line."""
    if text[:7].lower() == "file://":
        rest = text[7:]
        if rest.lower().startswith("localhost/"):
            rest = rest[len("localhost") :]
        if not rest.startswith("/"):
            raise StoreError(
                f"{text}: a file:// URI names an absolute local path (file:///path); give the "
                "path itself"
            )
        return rest
    return os.path.expanduser(text)


# A ``str``, so messages, ``join`` and comparisons read it as before. ``location`` of a ``Location``
# is the same object, and ``join`` of a ``Location`` is one without parsing again, so a state walks
# down the layers parsed once.
class Location(str):
    """The text of a location, and what it is (see the module doc)."""

    scheme: str
    path: str  # the local path (local) or the text itself (a URI)

    def __new__(cls, text: str, scheme: str, path: str) -> Location:
        self = super().__new__(cls, text)
        self.scheme, self.path = scheme, path
        return self

    @property
    def local(self) -> bool:
        return self.scheme == ""

    @property
    def uri(self) -> bool:
        """Whether it was given as a URI (``file://`` included), not as a path."""
        return scheme_of(self) != ""

    @property
    def plain(self) -> Location:
        """It spelled for a tool that takes paths (Hydra's sweep folder among them): a
        ``file://`` URI as the absolute path it names, any other as given."""
        if self.local and self.uri:
            path = os.path.abspath(self.path)
            return Location(path, "", path)
        return self

    @property
    def writes(self) -> str:
        """How its control keys are written conditionally: ``flock`` (a local file system),
        ``process`` (``memory://``: one store per process), ``object`` (If-None-Match/If-Match)."""
        return WRITES.get(self.scheme, "object")

    @cached_property
    def remote(self):
        """``(fsspec filesystem, path)`` of a remote location; a missing backend is one line."""
        assert not self.local, "a local location is read with os"
        import fsspec  # lazy: fsspec, only for a remote location

        try:
            return fsspec.core.url_to_fs(str(self))
        except ImportError:
            raise BackendMissing(
                f"{self}: the {self.scheme}:// backend is not installed; {CLOUD_HINT}"
            ) from None
        except ValueError as e:
            raise StoreError(f"{self}: unsupported location ({e}); {WHERE}") from None

    def __reduce__(self):  # pickled whole (a build's followers get it across processes)
        return (Location, (str(self), self.scheme, self.path))

    @property
    def absolute(self) -> Location:
        """Its one spelling with links kept: a local one as an absolute path (``file://`` and
        ``~`` resolved), a URI without its trailing ``/``."""
        if self.local:
            path = os.path.abspath(self.path)
            return Location(path, "", path)
        text = self.rstrip("/")
        return Location(text, self.scheme, text)

    @property
    def canonical(self) -> str:
        """Its one spelling: a local one's real path (links resolved), a URI without a final ``/``."""
        return os.path.realpath(self.path) if self.local else self.rstrip("/")

    def parents(self) -> list[Location]:
        """The locations holding it, nearest first, spelled as ``canonical`` (a URI's down to
        its bucket)."""
        if self.local:
            return [Location(str(p), "", str(p)) for p in PurePosixPath(self.canonical).parents]
        scheme, _, rest = self.canonical.partition("://")
        parts = rest.split("/")
        up = (f"{scheme}://" + "/".join(parts[:i]) for i in range(len(parts) - 1, 0, -1))
        return [Location(u, self.scheme, u) for u in up]

    def home(self, host: str) -> str:
        """Where it is, as runs record it (``home``): ``host:/real/path``, or the URI."""
        return f"{host}:{self.canonical}" if self.local else self.canonical

    @property
    def requests(self) -> int:
        """Requests worth having in flight at once: 1 on a disk (one stream is as fast as the
        disk), 4 on an object store (each waits on the network)."""
        return 1 if self.local else 4

    def on_disk(self, *parts: str) -> str | None:
        """The local path of ``parts`` below it (for a tool that writes only to a disk), or
        None for an object store's."""
        return self.join(*parts).path if self.local else None

    def check(self) -> None:
        """Refuse now, in one line, a location whose backend is missing (nothing connects)."""
        if not self.local:
            self.remote  # noqa: B018  (made once, here: its errors)

    def join(self, *parts: str) -> Location:
        """This location with ``parts`` appended, ``/``-separated whatever the scheme."""
        text = self.rstrip("/") or "/"
        path = self.path.rstrip("/") or "/"
        for p in parts:
            text = text.rstrip("/") + "/" + p.strip("/")
            path = path.rstrip("/") + "/" + p.strip("/")
        return Location(text, self.scheme, path if self.local else text)


def location(where: str | os.PathLike) -> Location:
    """``where`` parsed (a ``Location`` is returned as it is)."""
    if isinstance(where, Location):
        return where
    text = os.fspath(where)
    scheme = scheme_of(text)
    if scheme in ("", "file"):
        return Location(text, "", local_path(text))
    if scheme not in SCHEMES:
        raise StoreError(
            f"{text}: unsupported location ({scheme}:// is not a store spill keeps runs on); "
            f"{WHERE}"
        )
    return Location(text, scheme, text)


def on_disk(where: str | os.PathLike) -> str | None:
    """The local path ``where`` names (``file://`` and ``~`` resolved), or None for a URI of any
    scheme: not parsed as a state, so a scheme no store takes is not refused here (for a check of
    local files that leaves a URI to whoever reads or writes it)."""
    if isinstance(where, Location):
        return where.path if where.local else None
    text = os.fspath(where)
    return local_path(text) if scheme_of(text) in ("", "file") else None


def from_home(home: str, host: str) -> Location | None:
    """The location a recorded ``home`` names, where ``host`` can read it (parsed): the URI, or
    the path of a home on ``host``; None for a path on another machine."""
    if "://" in home:
        return location(home)
    name, _, path = home.partition(":")
    return location(path) if name == host else None


def shown_home(home: str) -> str:
    """A recorded ``home`` as a person names it: the URI, or the path without its host."""
    return home if "://" in home else home.split(":", 1)[-1]
