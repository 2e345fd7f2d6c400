"""The trackers of one run (``open_tracking``, ``Tracking``): what a committed checkpoint adds to
them, each step exactly once. Only committed steps are logged, read from the committed checkpoint's
state (``losses``, ``valid``, a preference tune's ``metrics``), never from the loop, so a killed and resumed run logs the same
numbers an uninterrupted one does. Logging is off the step's path: a tracker that hangs holds only
itself, and one that fails is dropped with a one-line warning, not the run (the next leg back-fills
what it missed). The run's end waits at most ``FLUSH_WITHIN`` seconds for the senders, then names,
in one line each, a tracker that did not finish. ``TRACK_LOGGED`` is a drill point after each
tracker's write (on its sender).
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from typing import Any, Protocol

from spill.console import note
from spill.jobs.schedule import cosine_lr
from spill.jobs.track.mlflow_runs import MLflowRun
from spill.jobs.track.spec import check, run_key
from spill.jobs.track.tensorboard_files import TensorBoard
from spill.store import drill

ORDER = ("valid/loss", "train/loss", "train/lr", "train/tokens_per_s")  # within one step
FLUSH_WITHIN = 30.0  # seconds the run's end waits for its trackers to take what is left


class Backend(Protocol):
    name: str
    last: dict[str, int]  # per metric, the newest step it holds

    def write(self, points: list[tuple[int, str, float]]) -> None: ...
    def close(self, status: str | None) -> None: ...


# The learning rate is recomputed (``spill.jobs.schedule.cosine_lr``): step ``s`` (1-based, as
# logged) applied ``cosine_lr(s - 1, ...)`` (``tune_steps.Steps.apply``). Tokens/s is known only for
# the steps this process computed (``rates``), so a back-filled step has none.
def series(state: dict, tune: Any, rates: dict[int, float]) -> dict[str, dict[int, float]]:
    """Every metric a committed ``state`` holds, by step: ``tune`` has ``lr, warmup, steps``
    (None: no learning rate)."""
    losses = state.get("losses") or []
    top = int(state.get("step", len(losses)))
    out: dict[str, dict[int, float]] = {
        "train/loss": {i + 1: x for i, x in enumerate(losses[:top]) if x is not None},
        "train/lr": {
            s: cosine_lr(s - 1, tune.lr, tune.warmup, tune.steps) for s in range(1, top + 1)
        }
        if tune is not None
        else {},
        "train/tokens_per_s": {s: r for s, r in rates.items() if 1 <= s <= top},
        "valid/loss": {int(s): v for s, v in state.get("valid") or [] if v is not None},
    }
    for i, step in enumerate((state.get("metrics") or [])[:top]):  # a preference tune's
        for name, v in (step or {}).items():
            if v is not None:
                out.setdefault(f"train/{name}", {})[i + 1] = v
    return {k: v for k, v in out.items() if v}


def metric_name(text: str) -> str:
    """A name MLflow and TensorBoard both take (``eval:base`` -> ``eval_base``)."""
    return re.sub(r"[^A-Za-z0-9_\-./ ]", "_", text)


# On open every tracker says, per metric, the newest step it holds (TensorBoard: its event files
# read back; MLflow: the run's metric history); each commit then logs, per metric, the steps after
# that. Steps a killed process committed but never logged are back-filled from the next state it
# sees (on open: the checkpoint it continues from).
class Tracking:
    """The open trackers of one run (none: every call does nothing)."""

    def __init__(self, backends: list[Backend], tune: Any = None) -> None:
        self.backends = list(backends)  # a tracker that fails leaves it (its sender's doing)
        self.tune = tune
        self.step = 0  # the newest committed step seen
        self._senders: dict[int, _Sender] = {}  # by id() of the backend
        self._closed = False

    def committed(self, state: dict, rates: dict[int, float] | None = None) -> None:
        """A checkpoint was committed: log every step of it no tracker holds yet."""
        self.step = max(self.step, int(state.get("step", 0)))
        if self.backends:
            self._log(series(state, self.tune, rates or {}))

    def metrics(self, values: dict[str, float], step: int = 0) -> None:
        """Results (an eval's scores) at ``step``; each name logged once at a step."""
        self._log({metric_name(k): {step: float(v)} for k, v in values.items() if _number(v)})

    def flush(self, within: float = FLUSH_WITHIN) -> bool:
        """Wait (at most ``within`` seconds in all) until every sender has written what was
        logged so far, or dropped its tracker; False when one has not."""
        deadline = time.monotonic() + within
        return all(s.flush(deadline) for s in list(self._senders.values()))

    def close(self, status: str | None = "FINISHED", within: float = FLUSH_WITHIN) -> None:
        """Send what is left, then close each tracker with ``status``: MLflow's (FINISHED,
        KILLED, FAILED; None: leave it); waits at most ``within`` seconds in all."""
        if self._closed:
            return
        self._closed = True
        senders = [self._sender(b) for b in list(self.backends)]
        for s in senders:
            s.end(status)
        deadline = time.monotonic() + within
        for s in senders:
            s.thread.join(max(0.0, deadline - time.monotonic()))
        for s in senders:
            s.abandon(within)

    def _log(self, found: dict[str, dict[int, float]]) -> None:
        if self._closed:
            return
        for b in list(self.backends):
            self._sender(b).want(found)

    def _sender(self, b: Backend) -> _Sender:
        if id(b) not in self._senders:
            self._senders[id(b)] = _Sender(b, self.backends)
        return self._senders[id(b)]


# Each tracker has a sender thread of its own, and a commit only merges its points into what each is
# still to send (per metric and step: bounded by what the state itself holds, so the commit never
# waits and nothing is dropped). One that fails (a server gone, or one that stops answering past
# MLflow's bounded timeout) is dropped as soon as it fails.
class _Sender:
    """One tracker's thread: it writes what is wanted, in step order, until closed. Daemon: a
    tracker that never answers does not hold the process's exit."""

    def __init__(self, backend: Backend, backends: list[Backend]) -> None:
        self.backend, self.backends = backend, backends  # the run's list, to leave on failure
        self.wanted: dict[str, dict[int, float]] = {}
        self.asked = self.done = 0  # batches merged into ``wanted``, and those written
        self.status: tuple[str | None] | None = None  # once set: close the tracker so
        self.said = False  # its one line (a failure, or not finishing) has been said
        self.stopped = False  # its tracker failed: nothing more is written
        self.cv = threading.Condition()
        self.thread = threading.Thread(target=self._run, name=f"spill-{backend.name}", daemon=True)
        self.thread.start()

    def want(self, found: dict[str, dict[int, float]]) -> None:
        with self.cv:
            for k, by in found.items():
                self.wanted.setdefault(k, {}).update(by)
            self.asked += 1
            self.cv.notify()

    def flush(self, deadline: float) -> bool:
        with self.cv:
            asked = self.asked
            return self.cv.wait_for(
                lambda: self.done >= asked or self.stopped,
                max(0.0, deadline - time.monotonic()),
            )

    def end(self, status: str | None) -> None:
        with self.cv:
            self.status = (status,)
            self.cv.notify()

    def abandon(self, within: float) -> None:
        """The run's end: a sender still at work is left behind, said once."""
        with self.cv:
            if self.thread.is_alive() and not self.said and not self.stopped:
                self.said = True
                note(
                    f"warning: logging to {self.backend.name} did not finish within "
                    f"{within:g} s; the next run of the same command back-fills what it lacks"
                )

    def _run(self) -> None:
        b = self.backend
        while True:
            with self.cv:
                self.cv.wait_for(lambda: self.wanted or self.status is not None)
                found, self.wanted, asked = self.wanted, {}, self.asked
            try:
                if found:
                    self._write(found)
                    drill.at(drill.TRACK_LOGGED)
            except Exception as e:  # never the run's end: the next leg back-fills
                with contextlib.suppress(ValueError):
                    self.backends.remove(b)
                self._say(
                    f"warning: logging to {b.name} failed ({_short(e)}); it stops for this leg"
                )
                with self.cv:
                    self.stopped = True
                    self.cv.notify_all()
                return
            with self.cv:
                self.done = asked
                self.cv.notify_all()
                if self.status is None or self.wanted:
                    continue
            try:
                b.close(self.status[0])
            except Exception as e:
                self._say(f"warning: closing {b.name} failed ({_short(e)})")
            return

    def _write(self, found: dict[str, dict[int, float]]) -> None:
        b, rank = self.backend, {k: i for i, k in enumerate(ORDER)}
        points = [
            (s, k, v) for k, by in found.items() for s, v in by.items() if s > b.last.get(k, -1)
        ]
        points.sort(key=lambda p: (p[0], rank.get(p[1], len(ORDER)), p[1]))
        b.write(points)
        for s, k, _ in points:
            b.last[k] = max(b.last.get(k, -1), s)

    def _say(self, line: str) -> None:
        with self.cv:
            if not self.said:  # (not after the run's end said it did not finish)
                self.said = True
                note(line)


def open_tracking(
    kinds: tuple[str, ...] | list[str],
    *,
    key: str,
    experiment: str,
    run_name: str,
    logdir: str | None,
    params: dict[str, Any],
    tags: dict[str, str],
    tune: Any = None,
) -> Tracking:
    """Open (or find again, by ``key``) the run in each tracker of ``kinds``."""
    check(kinds)
    backends: list[Backend] = []
    try:
        for kind in kinds:
            if kind == "tensorboard":
                assert logdir is not None, "a TensorBoard run needs its folder"
                backends.append(TensorBoard(logdir))
            else:
                backends.append(MLflowRun(run_key(key), experiment, run_name, params, tags))
    except BaseException:
        Tracking(backends).close("FAILED")
        raise
    return Tracking(backends, tune)


def where(tracking: Tracking) -> str:
    """The trackers as the pre-run line names them."""
    out = []
    for b in tracking.backends:
        out.append(f"{b.name} {getattr(b, 'logdir', None) or getattr(b, 'uri', '')}".strip())
    return ", ".join(out)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text[:200]
