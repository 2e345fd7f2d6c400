"""The row-job driver shared by run, eval, distill and predict: quanta of rows, committed segments,
resume (``execute``). A verb gives its rows (anything with an ``id``), the settings that decide its
results, and a ``prepare(loaded)`` that returns a ``Work``: ``compute(batch) -> [record, ...]`` (one
JSON record with an ``"id"`` per row, in the batch's order) and each row's length in tokens; the
driver hands every record, in input order, to the verb's ``finish``. With ``--state`` results are
committed in segments, a rerun writes the uninterrupted job's bytes, and SIGTERM/SIGINT exits 75.
``refuse_overlap`` is each verb's first check: an ``--out`` (or a local ``--state``) that is one of
the job's inputs is a usage error (exit 2) before anything is read.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from spill.console import note, progress
from spill.control.place import Place
from spill.engines.base import BatchPlan, EngineInfo
from spill.errors import DataError, StoreError, UsageError
from spill.ground.hashing import file_sha256
from spill.jobs.authority import Held, Writer, hold
from spill.jobs.group import Group
from spill.jobs.group import current as current_group
from spill.jobs.loading import LoadedModel, find_model, open_model
from spill.jobs.preempt import SIGNALS, Guard
from spill.jobs.producer import describe
from spill.models.integrity import same_weights
from spill.models.quant import Spec
from spill.models.sources.quantize import identity as quantization_identity
from spill.payloads.rows import SegmentWriter, commit_markers, pin_identity, restore
from spill.settings import EngineSettings
from spill.store import drill
from spill.store.disk import same_file
from spill.store.location import Location
from spill.store.output import put_output
from spill.store.probe import probe_writable

Record = dict[str, Any]
Compute = Callable[[list[Any]], list[Record]]


class HasId(Protocol):
    id: str | int


@dataclass(frozen=True, kw_only=True)
class RowOptions:
    """Where and how a row job computes; nothing here changes a row's result, so none of it is
    pinned. ``batch`` comes from the verb's conf group (``eval.batch``, ``teacher.batch``)."""

    batch: int | None  # rows computed together (speed; see ``execute``); None: from memory
    engine: EngineSettings = EngineSettings()
    weights: str | None = None
    stop_after: int | None = None  # stop when this many rows are done in all
    writer: Writer = Writer()  # without a state: nothing is committed, nothing continues
    batch_from: str = "--batch"  # where an explicit batch came from, for the pre-run line
    quantize: Spec | None = None  # the model's quantized copy instead (None: its float weights)

    @property
    def state(self) -> Location | None:
        return self.writer.state


@dataclass(frozen=True)
class Work:
    """What a verb's ``prepare`` returns."""

    compute: Compute
    tokens: Callable[[Any], int]  # a row's tokens at its longest (prompt + generated or scored)


@dataclass(frozen=True)
class RowJob:
    verb: str  # "run", "eval", "distill", "predict": part of the identity
    model: str
    input_path: Path
    rows: Sequence[HasId]
    settings: dict[str, Any]  # everything else that decides the results; pinned
    options: RowOptions


@dataclass
class Outcome:
    records: list[Record]  # one per row done, in input order
    total: int  # rows in the input
    restored: int  # rows taken from committed segments
    ran: int  # rows computed by this process
    seconds: float
    info: EngineInfo  # the engine that computed them
    routed: dict[str, str] = field(default_factory=dict)  # an MoE model's expert reads (Stats)

    @property
    def complete(self) -> bool:  # False: stopped at ``stop_after``; records holds the rows done
        return len(self.records) == self.total

    def summary(self, options: RowOptions) -> dict[str, Any]:
        """The keys every row job reports; a verb adds its own."""
        out: dict[str, Any] = {
            "rows": len(self.records),
            "seconds": round(self.seconds, 2),
            "engine": self.info.engine,
            "numerics": self.info.numerics,
            **self.routed,
        }
        if options.state:
            out.update(state=options.state, restored=self.restored, ran=self.ran)
        if not self.complete:
            out.update(complete=False, total=self.total)
        return out


def write_jsonl(path: Path, records: Sequence[Record]) -> None:
    """The whole file at once through the store's atomic write (never half-written), or into a
    FIFO or character device as it is (``spill.store.output.put_output``)."""
    data = "".join(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records)
    put_output(str(path), data.encode("utf-8"))


def job_inputs(input_path: Path, model: str, adapter: Path | None = None) -> list[tuple[Path, str]]:
    """The local files a row job reads, each with the words a refusal names it by."""
    found = [(Path(input_path), "the input file")]
    for folder, what in ((adapter, "--adapter"), (model, "the model folder")):
        if folder is not None and Path(folder).is_dir():
            files = sorted(p for p in Path(folder).rglob("*") if p.is_file())
            found += [(p, f"a file of {what} {folder}") for p in files]
    return found


# An ``--out`` (or a local ``--state``) that is one of the job's inputs (the rows, an adapter's
# files, a local model folder's files) would destroy it, so it is a usage error (exit 2) before
# anything is read or run.
def refuse_overlap(
    inputs: list[tuple[Path, str]], out: Path | None, state: Location | None
) -> None:
    """A usage error when ``--out`` or a local ``--state`` is one of ``inputs`` or each other."""
    for path, what in inputs:
        if out is not None and same_file(out, path):
            raise UsageError(f"--out {out} is {what}; write the results elsewhere")
        if state is not None and same_file(state, path):
            raise UsageError(f"--state {state} is {what}; give the state a folder of its own")
    if out is not None and state is not None and same_file(out, state):
        raise UsageError(f"--out {out} is the --state location; write the results elsewhere")


def _open(job: RowJob, resolved, fp: str) -> LoadedModel:
    name = job.model if job.options.quantize is None else resolved.name  # the copy's own name
    return open_model(name, resolved, fp, job.options.engine.name, job.options.engine, job.verb)


def identity(job: RowJob, resolved, fp: str) -> dict[str, Any]:
    # A local folder's path differs between machines; its name and fingerprint do not.
    model_id = resolved.model_id or Path(resolved.folder).name
    model = {"id": model_id, "fingerprint": fp}
    if resolved.files:  # per-file sha256, so a refusal can name the file that changed
        model["files"] = resolved.files
    if quantization := quantization_identity(Path(resolved.folder)):  # float: none, as before
        model["quantization"] = quantization
    return {
        "job": job.verb,
        "model": model,
        "input": {"sha256": file_sha256(job.input_path)},
        "settings": job.settings,
    }


def _restore(place: Place, pinned: dict[str, Any], rows: Sequence[HasId], folder: Path) -> dict:
    uri, fp = place.uri, pinned["model"]["fingerprint"]
    pin_identity(uri, pinned, lambda old: same_weights(old, folder, fp, uri, "its next commit"))
    got = restore(place)
    ids = {r.id for r in rows}
    stray = [rid for rid in got.done if rid not in ids]
    if stray:
        raise StoreError(
            f"{uri} holds row {stray[0]!r}, which the input does not have; "
            "use a new --state location"
        )
    return dict(zip(got.done, got.rows, strict=True))


def batch_plan(
    opts: RowOptions, runner, work: Work, todo: Sequence[HasId], before: int | None = None
) -> BatchPlan:
    """``opts.batch`` when set, else ``before`` (the batch of the rows committed before) when
    the memory budget still fits it, else the runner's plan for the rows left."""
    if opts.batch is not None:
        return BatchPlan(opts.batch, f"({opts.batch_from})")
    longest = max(work.tokens(r) for r in todo)
    if before is not None:
        plan = runner.plan_batch(longest, max(before, len(todo)))
        if plan.rows >= before:
            return BatchPlan(before, "(as the rows committed before, which it continues)")
        return plan
    return runner.plan_batch(longest, len(todo))


def committed_batch(place: Place | None) -> int | None:
    """The batch that the newest committed segment at ``place`` was computed at (None: none
    committed, or made before segments named it)."""
    markers = commit_markers(place) if place is not None else []
    batch = markers[-1]["producer"].get("batch") if markers else None
    return batch if type(batch) is int and batch >= 1 else None


def batches(todo: Sequence[HasId], index: dict, batch: int) -> list[list[HasId]]:
    """The rows left, in input order, cut where an uninterrupted job's batches are cut: row
    ``index[id]`` of the input is in batch ``index[id] // batch``."""
    out: list[list[HasId]] = []
    last = None
    for row in todo:
        at = index[row.id] // batch
        if at != last:
            out.append([])
            last = at
        out[-1].append(row)
    return out


# The driver:
# 1. resolves the model and hashes the input, and with ``--state`` pins ``rows/identity.json`` (job,
#    model id + fingerprint, input sha256, settings) before the engine opens, so another job is
#    refused in one line without loading anything;
# 2. restores the committed segments and runs only the rows left, in input order, ``batch`` at a
#    time; a row is done when its batch returns, and then goes to the ``SegmentWriter`` (pushes
#    every 25 rows or 60 s and on stop, each commit naming the producer). ``batch`` None (the conf
#    default) asks the runner for one from the memory budget and the longest row left
#    (``spill.engines.core.batching``: the rows share each walk over the layers); the line after the
#    pre-run line says which batch and why. Row ``i`` of the input is always in batch ``i // batch``
#    (``batches``), and a continued job whose batch is not set takes the batch its committed rows
#    name (``producer.batch``) while it fits, so a job stopped anywhere (a signal, a SIGKILL,
#    ``stop_after`` in the middle of a batch) continues beside the same neighbours and writes the
#    uninterrupted job's bytes. A row's log-probs do not depend on the batch (each row is scored
#    alone, ``StreamRunner.score``); a greedy token can (the padded decode moves logits within ~1e-5
#    in float32), only where two candidates tie that closely;
# 3. inside a preemption ``Guard`` (``spill.jobs.preempt``): SIGTERM/SIGINT finishes the batch in
#    flight if it returns within the grace period, else abandons it, pushes what is done, prints
#    ``preempted`` and exits 75;
# 4. hands every record, in input order, to the verb's ``finish`` (which writes ``--out`` whole).
# ``stop_after`` (a build's ``--stop-after distill:5``) stops once that many rows are done in all
# (committed before plus run now), pushes them and returns an incomplete ``Outcome`` without calling
# ``finish``; running the job again continues with the rest.
# Without ``--state`` nothing is pinned or pushed and signals keep their default meaning. With it,
# the location is first probed for writing, so a read-only state fails before the model loads, and
# the job holds the run there (``spill.jobs.authority``): one writer per state location.
def execute(
    job: RowJob,
    prepare: Callable[[LoadedModel], Work],
    finish: Callable[[list[Record]], None],
) -> Outcome:
    """Run the rows left and call ``finish(records in input order)``; see the comment above."""
    opts = job.options
    if opts.batch is not None and opts.batch < 1:
        raise DataError(f"{opts.batch_from} must be at least 1")
    group = current_group()
    group.new_job()
    try:
        if not opts.state or not group.leader:  # a rank other than 0 never holds the run
            return _execute(job, None, prepare, finish, group)
        probe_writable(opts.state)
        with hold(opts.state, opts.writer) as held:
            outcome = _execute(job, held, prepare, finish, group)
            if outcome.complete:
                held.finish()
    except BaseException as e:
        group.refuse(e)  # before the first batch the other ranks stop with rank 0's refusal
        raise
    return outcome


def _todo(job: RowJob, held: Held | None, group: Group, fp: str, pinned: dict, folder: Path):
    """The rows committed (by id) and the rows left, as rank 0 found them (and handed to the
    other ranks of a group); ``place`` is where rank 0 commits (None elsewhere); ``folder``:
    the model's."""
    opts, total = job.options, len(job.rows)
    if not group.leader:
        begin = group.start(None)
        if begin["fingerprint"] != fp:
            raise DataError(
                f"rank {group.rank} found other weights for {job.model} than rank 0; give "
                "every node the same model (its cache, or --weights URI)"
            )
        left = set(begin["todo"])
        return None, begin["results"], [r for r in job.rows if r.id in left]
    place = held.place if held else None
    results: dict = _restore(place, pinned, job.rows, folder) if place else {}
    todo = [r for r in job.rows if r.id not in results]
    if opts.stop_after is not None:
        todo = todo[: max(0, opts.stop_after - len(results))]
    if held and todo:
        place = held.writable(f"{len(todo)} of its rows are not committed")
    if opts.state:
        note(
            f"state {opts.state}: {len(results)} of {total} rows committed; "
            f"running the {len(todo)} left"
        )
    if group.world > 1:
        group.start({"fingerprint": fp, "results": results, "todo": [r.id for r in todo]})
    return place, results, todo


def _execute(
    job: RowJob,
    held: Held | None,
    prepare: Callable[[LoadedModel], Work],
    finish: Callable[[list[Record]], None],
    group: Group,
) -> Outcome:
    """The rows left, ``batch`` at a time; in a group of N processes each round is N batches,
    rank ``r`` computing the ``r``-th, and every rank gets every record (rank 0 commits)."""
    opts = job.options
    signals = SIGNALS if held or (opts.state and group.world > 1) else ()
    with Guard(unit="batch", signals=signals) as guard:
        resolved, fp = find_model(job.model, opts.weights, opts.quantize)
        pinned = identity(job, resolved, fp)
        place, results, todo = _todo(job, held, group, fp, pinned, Path(resolved.folder))
        total = len(job.rows)
        loaded = _open(job, resolved, fp)
        try:
            work = prepare(loaded) if todo else None
            batch = 1
            if work is not None:
                plan = batch_plan(opts, loaded.runner, work, todo, committed_batch(place))
                batch = group.collect(plan.rows)[0] if group.world > 1 else plan.rows
                shared = f"; {group.world} processes, a batch each" if group.world > 1 else ""
                note(plan.line() + shared)
            producer = describe(loaded.runner.info) | {"batch": batch}
            if group.world > 1:
                producer["procs"] = group.world
            writer = SegmentWriter(place, pinned, producer) if place else None

            def save() -> str:
                writer.flush()
                return f"{len(writer.done)} of {total} rows in {opts.state}"

            if writer is not None:
                guard.save = save
            start = time.perf_counter()
            with progress(total, job.verb, initial=len(results)) as bar:
                try:
                    cut = batches(todo, {r.id: i for i, r in enumerate(job.rows)}, batch)
                    for lo in range(0, len(cut), group.world):  # a round: a batch per rank
                        group.boundary(guard)
                        if not group.leader:
                            drill.at(drill.RANK_STEP)
                        chunk = cut[lo : lo + group.world]
                        mine = chunk[group.rank] if group.rank < len(chunk) else []
                        records = work.compute(mine) if mine else []
                        assert [r["id"] for r in records] == [r.id for r in mine]
                        if group.world > 1:  # by rank: the round's rows in input order
                            records = [rec for got in group.collect(records) for rec in got]
                        with guard.mutating():
                            for rec in records:
                                results[rec["id"]] = rec
                                if writer is not None:
                                    writer.add(rec["id"], rec)
                            if writer is not None and writer.tick():
                                bar.checkpoint(f"{len(writer.done)} rows committed")
                        bar.update(sum(len(b) for b in chunk))
                except Exception:
                    # an engine or data error: the rows already finished are worth keeping
                    if writer is not None:
                        with guard.mutating(), contextlib.suppress(Exception):
                            writer.flush()
                    raise
            complete = len(results) == total
            with guard.mutating():
                if writer is not None:
                    writer.flush()
                ordered = [results[r.id] for r in job.rows if r.id in results]
                if complete and group.leader:  # rank 0 writes for the job
                    finish(ordered)
                else:
                    note(
                        f"stopped after {len(ordered)} of {total} rows, committed; run again to continue"
                    )
            seconds = time.perf_counter() - start
        finally:
            loaded.runner.close()
    ran = len(todo)
    routed = loaded.runner.stats.routed()
    return Outcome(ordered, total, len(ordered) - ran, ran, seconds, loaded.runner.info, routed)
