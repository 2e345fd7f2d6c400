"""TensorBoard event files, written and read back with tensorboard's own record writer and reader.

Each process that logs writes a new event file in the run's folder (``TensorBoard``); on open the
folder's existing files are read back (``logged``), so a resumed run knows, per tag, the newest step
it holds and writes only later steps: no step twice, none skipped. A file that cannot be written (a
read-only folder) is one ``OSError``, which the tracking turns into its one-line warning. No torch:
the MLX engine may run without it.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from pathlib import Path

from spill.errors import SpillError

_files = itertools.count()  # this process's event files, for unique names


# Read with TensorBoard's ``EventAccumulator``. A record a killed writer left half-written is
# dropped by the reader, so it is written again.
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
        from tensorboard.compat.proto import event_pb2, summary_pb2  # lazy: an optional tracker

        if self._writer is None:
            self._writer = self._open()
        now = time.time()
        for step, tag, value in points:
            value = summary_pb2.Summary.Value(tag=tag, simple_value=float(value))
            summary = summary_pb2.Summary(value=[value])
            event = event_pb2.Event(wall_time=now, step=step, summary=summary)
            self._writer.write(event.SerializeToString())
        self._writer.flush()

    # Named as TensorBoard's ``EventFileWriter`` names it (time, host, pid, a counter) and begun
    # with the same version record; the records go through TensorBoard's ``RecordWriter`` onto a
    # file opened here, on the tracking sender's thread, not through ``EventFileWriter``'s own
    # thread, which prints a traceback of its own when the file cannot be written (a read-only
    # folder).
    def _open(self):
        """A new event file, its version record written (what ``EventFileWriter`` begins with)."""
        from tensorboard.compat.proto import event_pb2  # lazy: an optional tracker
        from tensorboard.summary.writer.record_writer import RecordWriter

        now = time.time()
        name = f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}.{os.getpid()}"
        writer = RecordWriter(open(self.logdir / f"{name}.{next(_files)}", "xb"))  # noqa: SIM115
        version = event_pb2.Event(wall_time=now, file_version="brain.Event:2")
        writer.write(version.SerializeToString())
        return writer

    def close(self, status: str | None) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
