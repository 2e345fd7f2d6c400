"""Named crash points in the store's publication protocol, for kill drills.

The store (and the tune loop) calls ``at(<boundary>)`` at each point where a dying writer would leave a distinct
state behind:

=====================  ===================================================================
``ckpt-between-files``  ``params.safetensors`` written, ``opt.safetensors`` not yet
``ckpt-before-commit``  all three checkpoint files written, ``COMMIT`` not yet
``ckpt-after-commit``   ``COMMIT`` written and the pointer moved to it, older folders not yet removed
``seg-before-commit``   a segment payload's ``rows.jsonl`` written, its ``COMMIT`` not yet
``put-before-rename``   a local temporary file written and fsynced, not yet renamed
``tune-before-forward`` a tune step about to run its first forward pass
``tune-after-backward`` a tune step's gradients accumulated, the optimizer not yet applied
``tune-after-optimizer`` a tune step applied in memory, nothing of it committed yet
``control-acquire``     a run's control object names this process its owner; nothing else done
``control-renew``       the lease renewed by the heartbeat
``control-publish``     a pointer of the control object moved to a new payload (fenced)
``control-complete``    the run marked complete (read-only from now on)
``control-rebuild``     a missing ``runs/current.json`` rebuilt from the control objects, no
                        run acquired yet
``move-<step>``         a move's step done (quiesce, take, copy, verify, incoming, fence,
                        activate; ``spill.control.transfer``)
``move-checked``        a move's destination checked (empty, names, space), nothing written
``move-claim``          the destination claimed (``incoming``), the source not changed yet
``move-abort``          an aborted move's source returned (a new generation), its
                        destination claim not yet removed
``chat-token``          a chat reply's token shown, the next one not chosen yet
=====================  ===================================================================

Two ways to act there, both off unless asked for:

* ``SPILL_DRILL=<boundary>[@<k>][:<action>]`` in the environment of a real process (a CLI job,
  a test's subprocess). At the ``k``-th time (default the first) the process reaches that
  boundary it sends itself ``SIGKILL`` (action ``kill``, the default) or ``SIGSTOP`` (action
  ``stop``: the driver inspects the paused writer, then continues or kills it). Several
  drills may be given separated by commas. An unknown boundary name is an error, so a drill
  with a typo cannot pass by never firing.
* ``with drill.hooked(fn):`` calls ``fn(boundary)`` at every boundary in this process, for
  in-process tests that need to raise, count or block there.

The environment is read at each boundary, so a driver may also set ``SPILL_DRILL`` in
``os.environ`` between two saves. Nothing is mocked: the kill is a real signal to a real process.
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
BOUNDARIES = (
    CKPT_BETWEEN_FILES,
    CKPT_BEFORE_COMMIT,
    CKPT_AFTER_COMMIT,
    SEG_BEFORE_COMMIT,
    PUT_BEFORE_RENAME,
    TUNE_BEFORE_FORWARD,
    TUNE_AFTER_BACKWARD,
    TUNE_AFTER_OPTIMIZER,
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
