"""Preemption, once for the whole process: stop at a boundary, save, say ``preempted``, exit 75.

SIGTERM, SIGINT and ``request_stop()`` go to the innermost scope running: a job's ``Guard`` finishes
the quantum in progress and saves (its use: the comment above ``Guard``); ``stops_at_once()`` (a
build between its jobs) raises ``Interrupted`` at once, except inside ``critical()``. The grace, the
deadline and who saves: docs/design.md, "Preemption".
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from spill.console import speaking
from spill.control.control import Superseded
from spill.errors import EXIT_PREEMPTED, EXIT_USER, SpillError

GRACE = 15.0
DEADLINE = 30.0
GRACE_ENV = "SPILL_PREEMPT_GRACE"
DEADLINE_ENV = "SPILL_PREEMPT_DEADLINE"
SIGNALS = (signal.SIGTERM, signal.SIGINT)

SaveFn = Callable[[], "str | None"]


class Preempted(SpillError):
    """The job or build stopped on a request, its state committed; rerun it to continue."""

    exit_code = EXIT_PREEMPTED
    said = True


class Interrupted(BaseException):  # noqa: N818 - like KeyboardInterrupt, which it replaces
    """A stop request where stopping is immediate; ``args[0]`` is the reason (``"SIGINT"``)."""


def _seconds(value: float | None, env: str, default: float) -> float:
    if value is not None:
        return float(value)
    text = os.environ.get(env)
    if not text:
        return default
    try:
        out = float(text)
    except ValueError:
        raise SpillError(f"{env}={text!r} is not a number of seconds") from None
    if out < 0:
        raise SpillError(f"{env}={text!r} must be zero or more seconds")
    return out


def _say(line: str) -> None:
    """One line on stderr, unbuffered; safe in a signal handler and right before ``_exit``."""
    data = (line.rstrip("\n") + "\n").encode("utf-8", "replace")
    try:
        while data:
            data = data[os.write(2, data) :]
    except OSError:
        pass


def preempted(
    reason: str,
    committed: str | None,
    *,
    who: str = "",
    took: float | None = None,
    detail: str = "",
    say: bool = True,
) -> Preempted:
    """The one ``preempted`` line (printed unless ``say`` is false) as the error to raise.

    ``committed`` is what was saved (None: nothing new; ``""``: the save did not finish, the last
    committed state stands); ``who`` names a build; ``took`` is the time the stop waited for a
    quantum; ``detail`` says what was abandoned or failed.
    """
    head = f"spill: {who + ' ' if who else ''}preempted by {reason}"
    parts = [head + (f" after {took:.1f} s" if took is not None else "")]
    parts += [detail] if detail else []
    if committed is None:
        parts.append("nothing new to commit")
    else:
        parts.append(f"committed: {committed}" if committed else "the last committed state stands")
    parts.append(f"exit {EXIT_PREEMPTED}; run the same command to continue")
    line = "; ".join(parts)
    if say and speaking():
        _say(line)
    return Preempted(line.removeprefix("spill: "))


class _Switch:
    """The process's one stop request and the stack of scopes it is handed to."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.at: float | None = None  # time.monotonic() of the request
        self.scopes: list[object] = []  # Guards and _AtOnce scopes, innermost last
        self.previous: dict[int, object] = {}
        self.installer: object | None = None  # the scope that installed the handlers
        self.depth = 0  # critical sections open
        self.deferred = False  # a request that must raise Interrupted when they close
        self.echoed = False  # later requests are a launcher handing the stop on: no note
        self.lock = threading.RLock()  # a signal may land while the main thread holds it

    def enter(self, scope: object, install: bool) -> None:
        self.scopes.append(scope)
        main = threading.current_thread() is threading.main_thread()
        if install and main and self.installer is None:
            for sig in SIGNALS:
                self.previous[sig] = signal.signal(sig, self._on_signal)
            self.installer = scope

    def leave(self, scope: object) -> None:
        self.scopes.remove(scope)
        if self.installer is scope:
            # once stopping, later signals only print a note until the process has gone
            for sig, old in self.previous.items():
                signal.signal(sig, self._on_signal if self.reason else old)
            self.previous, self.installer = {}, None

    def top(self) -> object | None:
        return self.scopes[-1] if self.scopes else None

    def request(self, reason: str) -> bool:
        """Record the request; False (after a note) when one was already made."""
        with self.lock:
            if self.reason is not None and speaking() and not self.echoed:
                left = max(0.0, _deadline(self.top()) - (time.monotonic() - (self.at or 0.0)))
                _say(f"spill: {reason} again; already stopping, exit within {left:.0f} s")
            if self.reason is not None:
                return False
            self.reason, self.at = reason, time.monotonic()
        top = self.top()
        threading.Thread(
            target=_hard_stop, args=(reason, self.at, _deadline(top)), daemon=True
        ).start()
        if isinstance(top, Guard):
            top._requested()
        else:  # outside a job: acted on at once, or when the critical section ends
            self.deferred = True
        return True

    def _on_signal(self, signum: int, frame) -> None:
        first = self.request(signal.Signals(signum).name)
        if first and isinstance(self.top(), _AtOnce) and self.depth == 0:
            self.deferred = False
            raise Interrupted(self.reason)


_switch = _Switch()


def request_stop(reason: str = "a stop request") -> None:
    """What SIGTERM and SIGINT do, from any thread: a job stops at its next boundary; other code
    at the end of its ``critical()`` section or when it next checks ``stop_requested()``."""
    _switch.request(reason)


def stop_agreed() -> None:
    """A process group agreed on the stop and rank 0 committed: the signals still to come are a
    launcher ending the other ranks, not a person asking again, so they print no note (the
    exit stays bounded by the first request's deadline)."""
    _switch.echoed = True


def stop_requested() -> str | None:
    """Why this process was asked to stop (``"SIGINT"``), or None."""
    return _switch.reason


def _deadline(scope: object | None) -> float:
    if isinstance(scope, Guard):
        return scope.deadline
    return _seconds(None, DEADLINE_ENV, DEADLINE)


def _hard_stop(reason: str, at: float, deadline: float) -> None:
    time.sleep(max(0.0, at + deadline - time.monotonic()))
    detail = f"not finished {deadline:g} s after the request, stopping now"
    preempted(reason, "", detail=detail)
    os._exit(EXIT_PREEMPTED)


class _AtOnce:
    """The scope of ``stops_at_once``: a request raises ``Interrupted`` in the main thread."""


@contextmanager
def stops_at_once(who: str = "build") -> Iterator[None]:
    """Outside jobs (a build planning, or between its jobs) a request stops at once.

    ``Interrupted`` that leaves this scope becomes ``Preempted`` with nothing new committed; a
    caller that committed something catches ``Interrupted`` first and says what.
    """
    scope = _AtOnce()
    _switch.enter(scope, install=True)
    try:
        yield
    except Interrupted as e:
        raise preempted(str(e), None, who=who) from None
    finally:
        _switch.leave(scope)


@contextmanager
def critical() -> Iterator[None]:
    """A short write that must land whole: a request during it is acted on when it ends."""
    _switch.depth += 1
    try:
        yield
    finally:
        _switch.depth -= 1
    if _switch.depth == 0 and _switch.deferred and isinstance(_switch.top(), _AtOnce):
        _switch.deferred = False
        raise Interrupted(_switch.reason)


# Use:
#
#     with Guard(save=save, unit="step") as guard:
#         for ...:
#             guard.boundary()            # stops here when asked: save, raise Preempted
#             result = compute()          # the quantum's work; nothing committed changes here
#             with guard.mutating():
#                 apply(result)           # committed state changes only under this lock
class Guard:
    """A job's scope: a request saves at the next quantum boundary, within hard time limits.

    ``save`` may be given later (``guard.save = fn``) but must be set before a request can be
    acted on; without one, stopping saves nothing. ``unit`` names a quantum in messages. With
    ``signals=()`` the guard installs no handler (a job without a state location: Ctrl-C stays
    Python's), but a request still reaches it.
    """

    def __init__(
        self,
        save: SaveFn | None = None,
        *,
        grace: float | None = None,
        deadline: float | None = None,
        unit: str = "quantum",
        signals: tuple[signal.Signals, ...] = SIGNALS,
    ):
        self.save = save
        self.grace = _seconds(grace, GRACE_ENV, GRACE)
        self.deadline = max(self.grace, _seconds(deadline, DEADLINE_ENV, DEADLINE))
        self.unit = unit
        self.signals = signals
        self._nested = False  # inside a build, which words the stop
        self._watching = False
        self._settled = threading.Event()  # the main thread saved, or the loop ended
        self._claim = threading.Lock()  # held by whichever thread saves
        self._lock = threading.RLock()  # held while committed state changes

    # --- the loop's side -------------------------------------------------------------------

    @contextmanager
    def mutating(self) -> Iterator[None]:
        """Hold this while committed state changes; the watchdog's save waits for it."""
        with self._lock:
            yield

    def boundary(self) -> None:
        """Between quanta: when a stop was requested, save and raise ``Preempted``."""
        if _switch.reason is None:
            return
        if not self._claim.acquire(blocking=False):
            self._park()  # the watchdog is saving and will end the process
        took = time.monotonic() - (_switch.at or time.monotonic())
        try:
            with self._lock:
                what = self.save() if self.save is not None else None
        except Exception as e:
            self._settled.set()
            if _superseded(e):  # not a stop to retry: the run is someone else's now
                raise
            failed = f"saving failed ({type(e).__name__}: {e})"
            raise preempted(_switch.reason, "", detail=failed, say=not self._nested) from e
        self._settled.set()
        raise preempted(_switch.reason, what, took=took, say=not self._nested)

    def request_stop(self, reason: str = "a stop request") -> None:
        """``request_stop`` of this module (kept on the guard for callers that hold one)."""
        request_stop(reason)

    # --- context manager -------------------------------------------------------------------

    def __enter__(self) -> Guard:
        self._nested = bool(_switch.scopes)
        _switch.enter(self, install=bool(self.signals))
        if _switch.reason is not None:  # asked before the job began: its first boundary stops
            self._requested()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if _switch.reason is not None and not self._settled.is_set():
            # The loop ended on its own after the request (all quanta done, or an error): the
            # watchdog must not save over it. If it already claimed the save, it ends the process.
            if not self._claim.acquire(blocking=False):
                self._park()
            self._settled.set()
        _switch.leave(self)

    # --- internals -------------------------------------------------------------------------

    def _requested(self) -> None:
        if self._watching:
            return
        self._watching = True
        if speaking():
            _say(
                f"spill: {_switch.reason}; finishing the current {self.unit} (up to {self.grace:g} s), "
                "then saving"
            )
        threading.Thread(target=self._watch, name="spill-preempt", daemon=True).start()

    def _park(self) -> None:
        """The other thread owns the stop; wait for it to end the process."""
        threading.Event().wait()

    def _watch(self) -> None:
        start = time.monotonic()
        if self._settled.wait(max(0.0, start + self.grace - time.monotonic())):
            return
        if not self._claim.acquire(blocking=False):
            return  # the main thread is saving; the hard deadline still stands
        # Abandon the quantum: wait for any mutation under way, then save from here.
        at = _switch.at or start
        if not self._lock.acquire(timeout=max(0.0, at + self.deadline - time.monotonic())):
            return  # the hard stop ends the process
        reason = _switch.reason or "a stop request"
        try:
            what = self.save() if self.save is not None else None
            detail = f"the {self.unit} in progress was abandoned after {self.grace:g} s"
            preempted(reason, what, took=time.monotonic() - at, detail=detail)
        except BaseException as e:  # the process ends here either way
            if _superseded(e):
                _say(f"spill: error: {e}")
                os._exit(EXIT_USER)
            preempted(reason, "", detail=f"saving failed ({type(e).__name__}: {e})")
        from spill.payloads.checkpoint import settle  # numpy: not at import (planning loads this)

        settle()  # the save's removal of older checkpoints (the hard stop still bounds it)
        os._exit(EXIT_PREEMPTED)


def _superseded(e: BaseException) -> bool:
    """Whether a save failed because another process took the run over (exit 1, no retry)."""
    return isinstance(e, Superseded)
