"""How a job holds the run it writes: one writer per state location (``hold``, ``own``, ``Held``).

A standalone job (``spill tune``, and ``run``/``eval``/``distill`` with ``--state``) acquires the
run at its state location before it loads anything, so a second writer fails at once with the owner
named (exit 75) or, with ``--wait``, waits for the lease. The run is released however the job ends,
and completed (read-only from then on) when the job finished its work; running the same command
again answers from it. Inside a build, the build holds the run and hands each stage its ``Place``;
the stage's job neither acquires nor completes.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from spill.console import note
from spill.control.control import Ownership, RunComplete, Superseded
from spill.control.owner import host
from spill.control.ownership import acquire
from spill.control.place import Place
from spill.errors import StoreError
from spill.ground.validate import parse_json, remember, validate, validate_once
from spill.jobs.preempt import request_stop
from spill.store.fs import get_bytes, join, put_bytes
from spill.store.location import Location


@dataclass(frozen=True)
class Writer:
    """Where a job commits and how it holds the run there: what every verb that writes a state
    (the jobs, a build) is given."""

    state: Location | None = None  # commit here and continue from what is committed there
    lease: float | None = None  # seconds; None: ``control.owner.lease_seconds`` decides
    wait: bool = False  # wait for another owner's lease instead of exiting 75
    command: tuple[str, ...] = ()  # the command line, recorded for `spill resume <state>`
    place: Place | None = field(default=None, compare=False)  # inside a build: the stage's


@dataclass
class Held:
    """A job's place in its run, and whether the job owns the run (and so completes it)."""

    place: Place
    run: Ownership | None = None
    reopen: Callable[[], Ownership] | None = None  # a completed run: start the next one

    @property
    def read_only(self) -> bool:
        return self.place.run is None

    def writable(self, why: str) -> Place:
        """The place to write to: a completed run is read-only, so a job that finds work left
        in one (its final payload damaged since) continues in the next run, which starts from
        the completed run's pointers and names it as its parent."""
        if self.place.run is None and self.reopen is not None:
            old = self.place.doc() or {}
            self.run = self.reopen()
            self.place = self.run.place(self.place.prefix)

            note(f"run {old.get('run')} is complete but {why}; continuing in run {self.run.id}")
        return self.place

    def finish(self) -> None:
        """The job did all its work: complete the run it owns."""
        if self.run is not None:
            self.run.complete()


# The heartbeat renews the lease; if another process takes the run over (this one was stopped past
# its lease), the heartbeat asks the job to stop, and the job's next publication fails with
# ``Superseded`` (exit 1).
def _stop_on_loss(lost: Superseded) -> None:
    request_stop(f"superseded ({lost})")


def _stop_for_move(doc: dict) -> None:
    request_stop(f"a move to {doc['transfer']['to']}")


COMMAND = "command.json"


def record_command(state: Location, argv: Sequence[str]) -> None:
    """Write ``<state>/command.json``: the command line that owns the run now."""
    words = [a for a in argv if not a.startswith("-")]
    doc = {
        "schema_version": 1,
        "kind": "spill-command",
        "verb": words[0] if words else "",
        "argv": list(argv),
        "cwd": os.getcwd(),
        "host": host(),
        "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    validate(doc, "command", where=join(state, COMMAND))
    raw = json.dumps(doc, indent=1, sort_keys=True).encode() + b"\n"
    put_bytes(join(state, COMMAND), raw, drilled=False)
    remember(raw, "command")


def read_command(state: Location) -> dict | None:
    """``<state>/command.json`` validated, or None when there is none."""
    uri = join(state, COMMAND)
    try:
        raw = get_bytes(uri)
    except FileNotFoundError:
        return None
    try:
        doc = parse_json(raw)
    except ValueError as e:
        raise StoreError(f"{uri} is not JSON ({e}); it was damaged") from None
    validate_once(raw, doc, "command", uri)
    return doc


@contextlib.contextmanager
def own(
    state: Location,
    *,
    lease: float | None = None,
    wait: bool = False,
    new_run: bool = False,
    command: Sequence[str] = (),
) -> Iterator[Ownership]:
    """This process's ownership of the run at ``state`` (a build's, or a job's), heartbeat
    included, released however the block ends; ``new_run``: after a completed run, start the
    next one (its lineage names the completed one); ``command``: the command line to record."""
    run = acquire(state, lease=lease, wait=wait, new_run=new_run)
    if command:
        record_command(state, command)
    run.on_quiesce = _stop_for_move
    run.start_heartbeat(_stop_on_loss)
    try:
        yield run
    finally:
        run.release()


@contextlib.contextmanager
def hold(state: Location, writer: Writer) -> Iterator[Held]:
    """The job's ``Held`` at ``state``: the writer's place as given (a build's stage), else this
    process's own run."""
    if writer.place is not None:
        yield Held(writer.place)
        return
    lease, wait, command = writer.lease, writer.wait, writer.command
    with contextlib.ExitStack() as stack:

        def take(new_run: bool) -> Ownership:
            return stack.enter_context(
                own(state, lease=lease, wait=wait, new_run=new_run, command=command)
            )

        try:
            run = take(False)
        except RunComplete:
            yield Held(Place(state), reopen=lambda: take(True))
            return
        yield Held(run.place(), run)
