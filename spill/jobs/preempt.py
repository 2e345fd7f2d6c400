"""Preemption for any job made of quanta: stop at a boundary, save, say ``preempted``, exit 75.

A job (a tune loop, a row job) wraps its loop in a ``Guard``::

    with Guard(save=save, unit="step") as guard:
        for ...:
            guard.boundary()            # stops here when asked: save, print, raise Preempted
            result = compute()          # the quantum's work; nothing committed changes here
            with guard.mutating():
                apply(result)           # committed state changes only under this lock

On SIGTERM or SIGINT the handler only records the request and starts a watchdog; nothing is
raised into the loop, so no frame is left half-run. Then, counting from the signal:

* within ``grace`` (15 s): if the loop reaches ``boundary()`` the main thread calls ``save()``
  and raises ``Preempted`` (exit code 75) after printing one ``preempted`` line;
* at ``grace`` the quantum in progress is abandoned: the watchdog takes the mutation lock (so it
  never sees a half-applied quantum), calls ``save()`` from its own thread, prints the line and
  ends the process with ``os._exit(75)``; the state saved is the previous quantum's;
* at ``deadline`` (30 s) the process ends with ``os._exit(75)`` whatever it is doing (a save
  that hangs on the network, say); what was committed before stands.

Exactly one of the main thread and the watchdog saves (a claim lock decides). ``save`` must
read only state that ``mutating()`` protects; it returns a short description of what it
committed (``"step 120"``, ``"37 of 60 rows"``), which goes into the ``preempted`` line. A
second signal only prints a note: the save under way is never interrupted. A loop that
finishes all its quanta after a signal ends normally (the hard deadline stays armed: the
process was told to go).

``SPILL_PREEMPT_GRACE`` and ``SPILL_PREEMPT_DEADLINE`` (seconds) override the defaults; tests
set them short. Messages are written with ``os.write`` on fd 2: a signal handler that printed
through ``sys.stderr`` while the main thread was printing would hit a reentrant-buffer error.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from spill.errors import EXIT_PREEMPTED, SpillError

GRACE = 15.0
DEADLINE = 30.0
GRACE_ENV = "SPILL_PREEMPT_GRACE"
DEADLINE_ENV = "SPILL_PREEMPT_DEADLINE"
SIGNALS = (signal.SIGTERM, signal.SIGINT)

SaveFn = Callable[[], "str | None"]

_requested: list[str] = []  # the reasons any Guard in this process was asked to stop


def stop_requested() -> str | None:
    """Why a Guard in this process was asked to stop (``"SIGINT"``), or None; a caller that runs
    several jobs (a build) checks it after a job that finished all its quanta anyway."""
    return _requested[0] if _requested else None


class Preempted(SpillError):
    """The job stopped at a boundary after SIGTERM/SIGINT and saved; rerun it to continue."""

    exit_code = EXIT_PREEMPTED


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


class Guard:
    """Turns SIGTERM/SIGINT into a save at the next quantum boundary, within hard time limits.

    ``save`` may be given later (``guard.save = fn``) but must be set before a signal can be
    acted on; without one, stopping saves nothing. ``unit`` names a quantum in messages.
    With ``signals=()`` no handler is installed (``request_stop`` still works), which is what a
    job without a state location uses.
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
        self.signal_name: str | None = None
        self.requested_at: float | None = None  # time.monotonic() of the stop request
        self._stop = threading.Event()
        self._settled = threading.Event()  # the main thread saved, or the loop ended
        self._claim = threading.Lock()  # held by whichever thread saves
        self._lock = threading.RLock()  # held while committed state changes
        self._previous: dict[int, object] = {}
        self._installed = False

    # --- the loop's side -------------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @contextmanager
    def mutating(self) -> Iterator[None]:
        """Hold this while committed state changes; the watchdog's save waits for it."""
        with self._lock:
            yield

    def boundary(self) -> None:
        """Between quanta: when a stop was requested, save and raise ``Preempted``."""
        if not self._stop.is_set():
            return
        if not self._claim.acquire(blocking=False):
            self._park()  # the watchdog is saving and will end the process
        try:
            with self._lock:
                what = self._save()
        except Exception as e:
            self._settled.set()
            line = self._failed(e)
            _say(line)
            raise Preempted(line.removeprefix("spill: ")) from e
        self._settled.set()
        line = self._line(what, abandoned=False)
        _say(line)
        raise Preempted(line.removeprefix("spill: "))

    def request_stop(self, reason: str = "a stop request") -> None:
        """What a signal does (``reason`` is its name); callable directly (tests, a controller)."""
        if self._stop.is_set():
            left = max(0.0, self.deadline - (time.monotonic() - (self.requested_at or 0.0)))
            _say(f"spill: {reason} again; already stopping, exit within {left:.0f} s")
            return
        self.requested_at = time.monotonic()
        self.signal_name = reason
        _requested.append(reason)
        self._stop.set()
        _say(
            f"spill: {reason}; finishing the current {self.unit} (up to {self.grace:g} s), "
            "then saving"
        )
        threading.Thread(target=self._watch, name="spill-preempt", daemon=True).start()
        threading.Thread(target=self._hard_stop, name="spill-deadline", daemon=True).start()

    # --- context manager -------------------------------------------------------------------

    def __enter__(self) -> Guard:
        if self.signals and threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._on_signal)
            self._installed = True
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._stop.is_set() and not self._settled.is_set():
            # The loop ended on its own after the request (all quanta done, or an error): the
            # watchdog must not save over it. If it already claimed the save, it ends the process.
            if not self._claim.acquire(blocking=False):
                self._park()
            self._settled.set()
        if self._installed:
            for sig, old in self._previous.items():
                # once stopping, later signals only print a note until the process has gone
                signal.signal(sig, self._on_signal if self._stop.is_set() else old)
            self._installed = False

    # --- internals -------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame) -> None:
        self.request_stop(signal.Signals(signum).name)

    def _save(self) -> str | None:
        if self.save is None:
            return None
        return self.save()

    def _line(self, what: str | None, abandoned: bool) -> str:
        took = time.monotonic() - (self.requested_at or time.monotonic())
        parts = [f"spill: preempted by {self.signal_name} after {took:.1f} s"]
        if abandoned:
            parts.append(f"the {self.unit} in progress was abandoned after {self.grace:g} s")
        parts.append(f"committed: {what}" if what else "nothing new to commit")
        parts.append(f"exit {EXIT_PREEMPTED}; run the same command to continue")
        return "; ".join(parts)

    def _failed(self, e: BaseException) -> str:
        return (
            f"spill: preempted by {self.signal_name}; saving failed ({type(e).__name__}: {e}); "
            f"the last committed state stands; exit {EXIT_PREEMPTED}"
        )

    def _park(self) -> None:
        """The other thread owns the stop; wait for it to end the process."""
        threading.Event().wait()

    def _watch(self) -> None:
        assert self.requested_at is not None
        if self._settled.wait(max(0.0, self.requested_at + self.grace - time.monotonic())):
            return
        if not self._claim.acquire(blocking=False):
            return  # the main thread is saving; the hard deadline still stands
        # Abandon the quantum: wait for any mutation under way, then save from here.
        left = self.requested_at + self.deadline - time.monotonic()
        if not self._lock.acquire(timeout=max(0.0, left)):
            return  # _hard_stop ends the process
        try:
            line = self._line(self._save(), abandoned=True)
        except BaseException as e:  # the process ends here either way
            line = self._failed(e)
        _say(line)
        os._exit(EXIT_PREEMPTED)

    def _hard_stop(self) -> None:
        assert self.requested_at is not None
        time.sleep(max(0.0, self.requested_at + self.deadline - time.monotonic()))
        _say(
            f"spill: preempted by {self.signal_name}; not finished {self.deadline:g} s after the "
            f"request, stopping now; the last committed state stands; exit {EXIT_PREEMPTED}"
        )
        os._exit(EXIT_PREEMPTED)
