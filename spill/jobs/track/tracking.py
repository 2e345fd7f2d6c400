"""The trackers of one run: what a committed checkpoint adds to them, each step exactly once.

Only committed steps are logged, and what is logged is read from the committed checkpoint's
state (``losses``, ``valid``), never from the loop: so a killed and resumed run logs the same
numbers an uninterrupted one does. On open every tracker says, per metric, the newest step it
holds (TensorBoard: its event files read back; MLflow: the run's metric history); each commit
then logs, per metric, the steps after that. Steps a killed process committed but never logged
are back-filled from the next state it sees (on open: the checkpoint it continues from).

The learning rate is recomputed (``spill.jobs.schedule.cosine_lr``): step ``s`` (1-based, as
logged) applied ``cosine_lr(s - 1, ...)`` (``tune_steps.Steps.apply``). Tokens/s is known only
for the steps this process computed (``rates``), so a back-filled step has none.

Logging is off the step's path: a commit only merges its points into what is still to be sent
(``_wanted``, per metric and step: bounded by what the state itself holds, so it never waits
nor drops) and one sender thread writes them, tracker after tracker, in order. A tracker that
fails (a server gone, or one that stops answering past MLflow's bounded timeout) is dropped
with a one-line warning as soon as it fails, not the run: the next leg back-fills what it
missed. The run's end waits at most ``FLUSH_WITHIN`` seconds for the sender, then says which
tracker did not finish. ``TRACK_LOGGED`` is a drill point between two trackers (on the sender).
"""

from __future__ import annotations

import re
import threading
from typing import Any, Protocol

from spill.console import note
from spill.jobs.schedule import cosine_lr
from spill.store import drill

ORDER = ("valid/loss", "train/loss", "train/lr", "train/tokens_per_s")  # within one step
FLUSH_WITHIN = 30.0  # seconds the run's end waits for its trackers to take what is left


class Backend(Protocol):
    name: str
    last: dict[str, int]  # per metric, the newest step it holds

    def write(self, points: list[tuple[int, str, float]]) -> None: ...
    def close(self, status: str | None) -> None: ...


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
    return {k: v for k, v in out.items() if v}


def metric_name(text: str) -> str:
    """A name MLflow and TensorBoard both take (``eval:base`` -> ``eval_base``)."""
    return re.sub(r"[^A-Za-z0-9_\-./ ]", "_", text)


class Tracking:
    """The open trackers of one run (none: every call does nothing)."""

    def __init__(self, backends: list[Backend], tune: Any = None) -> None:
        self.backends = list(backends)
        self.tune = tune
        self.step = 0  # the newest committed step seen
        self._wanted: dict[str, dict[int, float]] = {}  # points the sender has not taken yet
        self._asked = self._done = 0  # batches handed to the sender, and sent (or dropped)
        self._status: tuple[str | None] | None = None  # set once: close the trackers so
        self._busy = ""  # the tracker the sender is writing to
        self._cv = threading.Condition()
        self._sender: threading.Thread | None = None

    def committed(self, state: dict, rates: dict[int, float] | None = None) -> None:
        """A checkpoint was committed: log every step of it no tracker holds yet."""
        self.step = max(self.step, int(state.get("step", 0)))
        if self.backends:
            self._log(series(state, self.tune, rates or {}))

    def metrics(self, values: dict[str, float], step: int = 0) -> None:
        """Results (an eval's scores) at ``step``; each name logged once at a step."""
        self._log({metric_name(k): {step: float(v)} for k, v in values.items() if _number(v)})

    def flush(self, within: float = FLUSH_WITHIN) -> bool:
        """Wait (at most ``within`` seconds) until the sender has taken everything logged so
        far; False when it has not."""
        with self._cv:
            asked = self._asked
            return self._cv.wait_for(lambda: self._done >= asked, within)

    def close(self, status: str | None = "FINISHED", within: float = FLUSH_WITHIN) -> None:
        """Send what is left, then close each tracker with ``status``: MLflow's (FINISHED,
        KILLED, FAILED; None: leave it); waits at most ``within`` seconds."""
        if not self.backends or self._status is not None:
            return
        with self._cv:
            self._status = (status,)
            self._cv.notify()
        sender = self._started()
        sender.join(within)
        if sender.is_alive():  # a daemon thread: it does not hold the process's exit
            note(
                f"warning: logging to {self._busy or 'the trackers'} did not finish within "
                f"{within:g} s; the next run of the same command back-fills what it lacks"
            )

    def _log(self, found: dict[str, dict[int, float]]) -> None:
        if not self.backends or self._status is not None:
            return
        with self._cv:
            for k, by in found.items():
                self._wanted.setdefault(k, {}).update(by)
            self._asked += 1
            self._cv.notify()
        self._started()

    def _started(self) -> threading.Thread:
        if self._sender is None:
            self._sender = threading.Thread(target=self._send, name="spill-tracking", daemon=True)
            self._sender.start()
        return self._sender

    def _send(self) -> None:
        """The sender thread: what is wanted, tracker after tracker, until closed."""
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._wanted or self._status is not None)
                found, self._wanted, asked = self._wanted, {}, self._asked
            if found:
                self._write(found)
            with self._cv:
                self._done = asked
                self._cv.notify_all()
                if self._status is None or self._wanted:
                    continue
            (status,) = self._status
            for b in list(self.backends):
                self._busy = b.name
                try:
                    b.close(status)
                except Exception as e:
                    note(f"warning: closing {b.name} failed ({_short(e)})")
            return

    def _write(self, found: dict[str, dict[int, float]]) -> None:
        rank = {k: i for i, k in enumerate(ORDER)}
        for b in list(self.backends):
            points = [
                (s, k, v) for k, by in found.items() for s, v in by.items() if s > b.last.get(k, -1)
            ]
            points.sort(key=lambda p: (p[0], rank.get(p[1], len(ORDER)), p[1]))
            self._busy = b.name
            try:
                b.write(points)
            except Exception as e:  # never the run's end: the next leg back-fills
                self.backends.remove(b)
                note(f"warning: logging to {b.name} failed ({_short(e)}); it stops for this leg")
                continue
            for s, k, _ in points:
                b.last[k] = max(b.last.get(k, -1), s)
            drill.at(drill.TRACK_LOGGED)


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
    from spill.jobs.track.spec import check, run_key

    check(kinds)
    backends: list[Backend] = []
    try:
        for kind in kinds:
            if kind == "tensorboard":
                from spill.jobs.track.tensorboard_files import TensorBoard

                assert logdir is not None, "a TensorBoard run needs its folder"
                backends.append(TensorBoard(logdir))
            else:
                from spill.jobs.track.mlflow_runs import MLflowRun

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
