"""TensorBoard event files, written and read back with tensorboard's own writer and reader.

Each process that logs writes a new event file in the run's folder (``EventFileWriter`` names
it by time, host and pid); on open the folder's existing files are read back with TensorBoard's
``EventAccumulator``, so a resumed run knows, per tag, the newest step it holds and writes only
later steps: no step twice, none skipped. A record a killed writer left half-written is dropped
by the reader, so it is written again. No torch: the MLX engine may run without it.
"""

from __future__ import annotations

import time
from pathlib import Path

from spill.errors import SpillError


def logged(logdir: str | Path) -> dict[str, int]:
    """Per scalar tag, the newest step the folder's event files hold (TensorBoard's reader)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not Path(logdir).is_dir():
        return {}
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})  # 0: keep every value
    acc.Reload()
    return {tag: max(e.step for e in acc.Scalars(tag)) for tag in acc.Tags()["scalars"]}


class TensorBoard:
    """One run's folder of event files."""

    name = "tensorboard"

    def __init__(self, logdir: str | Path) -> None:
        self.logdir = Path(logdir)
        try:
            self.logdir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SpillError(
                f"TensorBoard folder {self.logdir} cannot be made ({e.strerror}); "
                "give a writable state or drop tensorboard from --log"
            ) from None
        self.last = logged(self.logdir)
        self._writer = None  # made on the first write: a run with nothing new adds no file

    def write(self, points: list[tuple[int, str, float]]) -> None:
        """``(step, tag, value)`` in step order, flushed to disk before it returns."""
        if not points:
            return
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        if self._writer is None:
            self._writer = EventFileWriter(str(self.logdir))
        now = time.time()
        for step, tag, value in points:
            value = summary_pb2.Summary.Value(tag=tag, simple_value=float(value))
            summary = summary_pb2.Summary(value=[value])
            self._writer.add_event(event_pb2.Event(wall_time=now, step=step, summary=summary))
        self._writer.flush()

    def close(self, status: str | None) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
