"""Memory sizes as people write them (``8G``, ``512MiB``, ``1.5g``, ``1048576``), parsed once.

The CLI's ``--memory`` and a project's ``engine.memory`` both come through here; binary units
(``G`` is 1024**3), case-insensitive, an optional ``i`` and ``b``.
"""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)


def parse_size(value: str | int | None) -> int | None:
    """Bytes for ``value`` (None stays None); ``ValueError`` naming the text when it is no size."""
    if value is None or isinstance(value, int):
        return value
    m = _SIZE.match(value)
    if not m:
        raise ValueError(f"not a size: {value!r} (use e.g. 8G or 512M)")
    return int(float(m.group(1)) * 1024 ** "bkmgt".index((m.group(2) or "b").lower()))
