"""Whether a file this process writes stays in the page cache once it is on disk.

By default it does (the kernel's business). Under a memory budget (``--memory``, a cgroup's
limit: ``engines.core.budget``) the cache a job's writes cause counts against it, so the opener
calls ``drop_written`` and every durable write in ``store`` (``synced``) drops its file's pages
once they are synced: the bytes are on disk, and a later read reads them from there.
"""

from __future__ import annotations

import os

_DROP_WRITTEN = False  # drop_written(): files leave no page cache once synced


def drop_written(drop: bool = True) -> None:
    """From now on this process's written files leave no page cache behind (``drop``; False:
    they stay, the default): each is dropped from the cache once it is synced. A budget counts
    the cache its job's writes cause (``engines.core.budget``); the bytes are on disk, a later
    read reads them from there. Every engine open sets it, so the last runner opened decides."""
    global _DROP_WRITTEN
    _DROP_WRITTEN = drop


def synced(fd: int) -> None:
    """``fsync(fd)``, then its cached pages dropped where ``drop_written`` asked for that."""
    os.fsync(fd)
    if _DROP_WRITTEN and hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:  # a folder, a file system without it: nothing cached to speak of
            pass
