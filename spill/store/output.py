"""Writing a file a person named (``--out``, ``-o``), as opposed to a state's own files.

A new or regular file is written as every state file is (``fs.put_bytes``: a temporary, then a
rename), through a symlink to its target so the link stays a link. A FIFO or a character device
(a pipe a reader waits on, ``/dev/stdout``, ``/dev/null``) is written into as it is: a rename
would replace the node with a file (as root, ``--out /dev/full`` would remove the device). A
folder, a block device or a socket is refused (``fs.put_bytes`` never renames over one);
``spill.project.owned`` refuses them before a job starts.
"""

from __future__ import annotations

import os

from spill.errors import StoreError
from spill.store.fs import kind_of, put_bytes
from spill.store.location import location

STREAMS = ("a FIFO", "a character device")  # written into as they are, never replaced


def put_output(uri: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to the output ``uri``; see the module doc."""
    where = location(uri)
    if not where.local:
        return put_bytes(where, data)
    path = os.path.realpath(where.path)
    if kind_of(path) not in STREAMS:
        return put_bytes(path, data)
    try:
        fd = os.open(path, os.O_WRONLY)  # no O_CREAT: a node that vanished is not made a file
        with open(fd, "wb") as f:
            f.write(data)
    except OSError as e:
        raise StoreError(
            f"{uri}: cannot write ({e.strerror or e}); check the device, or the FIFO's reader"
        ) from None
