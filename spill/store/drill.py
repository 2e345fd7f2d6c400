"""Named crash points in the store's publication protocol, for kill drills. The store, the tune
loop, the control objects and ``spill move`` call ``at(boundary)`` wherever a dying writer would
leave a distinct state behind; ``BOUNDARIES`` names them all, and docs/design.md ("Kill drills")
says what each leaves. Both ways to act there are off unless asked: -
``SPILL_DRILL=<boundary>[@<k>][:kill|stop][,...]`` in a real process's environment: at the ``k``-th
arrival (default the first) it sends itself ``SIGKILL`` (default) or ``SIGSTOP``. The variable is
read at each boundary; an unknown boundary is an error, so a typo cannot pass. - ``with
hooked(fn):`` calls ``fn(boundary)`` at every boundary, for in-process tests.
"""

from __future__ import annotations

import os
import signal
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

ENV = "SPILL_DRILL"

CKPT_BETWEEN_FILES = "ckpt-between-files"
CKPT_BEFORE_COMMIT = "ckpt-before-commit"
CKPT_AFTER_COMMIT = "ckpt-after-commit"
SEG_BEFORE_COMMIT = "seg-before-commit"
PUT_BEFORE_RENAME = "put-before-rename"
TUNE_BEFORE_FORWARD = "tune-before-forward"
TUNE_AFTER_BACKWARD = "tune-after-backward"
TUNE_AFTER_OPTIMIZER = "tune-after-optimizer"
RANK_STEP = "rank-step"  # a rank other than 0 of a process group, before each quantum
GROUP_LOST = "group-lost"  # a rank of a process group that found another gone, before it says so
CONTROL_ACQUIRE = "control-acquire"
CONTROL_RENEW = "control-renew"
CONTROL_PUBLISH = "control-publish"
CONTROL_COMPLETE = "control-complete"
CONTROL_REBUILD = "control-rebuild"
MOVE_STEPS = ("quiesce", "take", "copy", "verify", "incoming", "fence", "activate")
MOVE_QUIESCE, MOVE_TAKE, MOVE_COPY, MOVE_VERIFY, MOVE_INCOMING, MOVE_FENCE, MOVE_ACTIVATE = (
    f"move-{s}" for s in MOVE_STEPS
)
MOVE_CHECKED, MOVE_CLAIM, MOVE_ABORT = "move-checked", "move-claim", "move-abort"
CHAT_TOKEN = "chat-token"
TRACK_LOGGED = "track-logged"  # one tracker has a commit's steps, the next not yet
EXPORT_WRITTEN = "export-written"  # a format's folder in place, its commit not made yet
BOUNDARIES = (
    CKPT_BETWEEN_FILES,
    CKPT_BEFORE_COMMIT,
    CKPT_AFTER_COMMIT,
    SEG_BEFORE_COMMIT,
    PUT_BEFORE_RENAME,
    TUNE_BEFORE_FORWARD,
    TUNE_AFTER_BACKWARD,
    TUNE_AFTER_OPTIMIZER,
    RANK_STEP,
    GROUP_LOST,
    CONTROL_ACQUIRE,
    CONTROL_RENEW,
    CONTROL_PUBLISH,
    CONTROL_COMPLETE,
    CONTROL_REBUILD,
    *(f"move-{s}" for s in MOVE_STEPS),
    MOVE_CHECKED,
    MOVE_CLAIM,
    MOVE_ABORT,
    CHAT_TOKEN,
    TRACK_LOGGED,
    EXPORT_WRITTEN,
)
_ACTIONS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}

_hooks: list[Callable[[str], None]] = []
_reached: Counter[str] = Counter()


def _parse(spec: str) -> list[tuple[str, int, str]]:
    drills = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        rest, _, action = item.partition(":")
        name, _, nth = rest.partition("@")
        if (
            name not in BOUNDARIES
            or (action or "kill") not in _ACTIONS
            or not (nth or "1").isdigit()
        ):
            raise ValueError(
                f"{ENV}={spec!r}: expected <boundary>[@<k>][:kill|stop] with a boundary among "
                f"{', '.join(BOUNDARIES)}"
            )
        drills.append((name, int(nth or 1), action or "kill"))
    return drills


def at(boundary: str) -> None:
    """Called by the store at ``boundary``; acts only when a drill or a hook asks for it."""
    assert boundary in BOUNDARIES, boundary
    _reached[boundary] += 1
    for fn in list(_hooks):
        fn(boundary)
    spec = os.environ.get(ENV)
    if not spec:
        return
    for name, nth, action in _parse(spec):
        if name == boundary and _reached[boundary] == nth:
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), _ACTIONS[action])


@contextmanager
def hooked(fn: Callable[[str], None]) -> Iterator[None]:
    """Call ``fn(boundary)`` at every boundary reached inside the ``with`` block."""
    _hooks.append(fn)
    try:
        yield
    finally:
        _hooks.remove(fn)
