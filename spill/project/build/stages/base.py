"""What every stage is: its name, job folder, output, the stages it reads, the model it loads,
its inputs and total in one build, the job it runs, and how its committed state is probed and
published again. Subclasses (``rows``, ``tune``) fill in what differs.

The classes are plain, not dataclasses: a finished ``spill build`` imports them to check each
stage's outputs, and that answer should not pay for ``dataclasses``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from spill.control.control import Ownership
from spill.control.place import Place
from spill.project.build import outputs
from spill.settings import stage_inputs
from spill.store.location import Location

if TYPE_CHECKING:  # types only: a finished build and `spill status` load none of these
    from spill.jobs.rows.job import RowOptions
    from spill.project.build.context import BuildContext
    from spill.project.build.stages.spec import StageSpec
    from spill.project.config import Project
    from spill.project.data import Prepared

PRODUCER_KEYS = ("engine", "numerics", "machine", "os", "hardware")


def distinct(producers: list[Mapping[str, Any]]) -> list[dict]:
    """Producers (engine, numerics, machine, os, hardware; ``procs`` when several processes
    computed together), each once, in order."""
    out: list[dict] = []
    for given in producers if isinstance(producers, list) else []:  # damaged: none known
        p = {k: given.get(k) for k in PRODUCER_KEYS} if isinstance(given, Mapping) else {}
        if (
            isinstance(given, Mapping)
            and isinstance(given.get("procs"), int)
            and given["procs"] > 1
        ):
            p["procs"] = given["procs"]
        if p not in out:
            out.append(p)
    return out


def common_inputs(p: Project, prepared: Prepared) -> dict[str, Any]:
    """The inputs every stage of the student shares: its model (and its quantized copy, named
    only when asked for, so a float build's records stay what they were), the split, the
    prompt."""
    return {
        **stage_inputs("model", p.model),
        "seed": p.seed,
        "data.input": p.data.input,
        "data.output": p.data.output,
        "data.task": prepared.task,
        "data.test_fraction": p.data.test_fraction,
        "prompt.template": p.prompt.template,
        "prompt.chat": p.prompt.chat,
    }


class Stage:
    """One stage of a build; subclasses say what decides its result, how its job runs and how
    its job's state and outputs look."""

    unit: ClassVar[str] = ""  # what its progress counts
    marker: ClassVar[str] = ""  # the file inside its output that stands for it in old records
    skipped: ClassVar[str] = "switched off"  # what the tables say when it is (``off``)

    def __init__(
        self,
        *,
        name: str,
        folder: str,  # its job state: stages/<folder>/ under the state location
        upstream: tuple[Stage, ...] = (),  # the stages whose output it reads
        model_key: str = "model.name",  # the setting naming the model it loads
    ) -> None:
        self.name, self.folder = name, folder
        self.upstream, self.model_key = upstream, model_key

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    @property
    def needs(self) -> tuple[str, ...]:
        """The names of the stages whose output it reads."""
        return tuple(s.name for s in self.upstream)

    # in one build -----------------------------------------------------------------------------

    def spec(
        self, project: Project, prepared: Prepared, earlier: Mapping[str, StageSpec]
    ) -> StageSpec:
        """What it is in this build: its inputs (key path -> value), total and whether it runs;
        ``earlier``: the specs of the stages before it."""
        from spill.project.build.stages.spec import StageSpec

        why_off = self.off(project)
        inputs = self.inputs(project, prepared, earlier) if not why_off else self.off_inputs()
        total = self.total(project, prepared)
        return StageSpec(self.name, inputs, total, self.needs, not why_off, why_off)

    def inputs(
        self, project: Project, prepared: Prepared, earlier: Mapping[str, StageSpec]
    ) -> dict[str, Any]:
        """Everything that decides its result: config values by the path a user edits,
        ``data:<file>`` hashes, ``stage:<name>`` fingerprints of the stages it reads."""
        raise NotImplementedError

    def total(self, project: Project, prepared: Prepared) -> int:
        """Its size: steps or rows."""
        raise NotImplementedError

    def off(self, project: Project) -> str:
        """Why it is switched off in this project (``""``: it runs)."""
        return ""

    def off_inputs(self) -> dict[str, Any]:
        return {}

    def execute(self, ctx: BuildContext, stop: int | None) -> tuple[dict[str, Any], bool]:
        """Run its job, stopping after ``stop`` steps or rows (None: to the end): (the result to
        record, whether it completed)."""
        raise NotImplementedError

    def job_options(
        self, ctx: BuildContext, batch: int | None, stop: int | None, setting: str = ""
    ) -> RowOptions:
        """Its job's ``RowOptions`` in build ``ctx``: the engine settings, the group's batch
        (``setting`` names it for the pre-run line; None: from the memory budget), the model
        folder a bundle install gave the project, where it commits, and the quantized copy its
        model computes on (``model.quantize``)."""
        from spill.jobs.authority import Writer
        from spill.jobs.rows.job import RowOptions

        return RowOptions(
            batch=batch,
            batch_from=setting or "--batch",
            engine=ctx.project.engine,
            weights=self.weights(ctx.project),
            stop_after=stop,
            writer=Writer(state=self.uri(ctx.root), place=self.place(ctx.root, ctx.run)),
            quantize=self.quantization(ctx.project),
        )

    def weights(self, project: Project) -> str | None:
        """The model folder a bundle install gave ``project`` for its model (None: the name's
        own)."""
        from spill.project.bundle.installed import model_folder

        return model_folder(project.root, self.model(project))

    # its state and outputs --------------------------------------------------------------------

    def uri(self, root: Location) -> Location:
        return root.join("stages", self.folder)

    def place(self, root: Location, run: Ownership | None = None) -> Place:
        """Its job's part of the build's run (read-only without ``run``)."""
        return Place(root, f"stages/{self.folder}", run)

    def output(self, project: str) -> str:
        """What it publishes, relative to the state location."""
        raise NotImplementedError

    def model(self, project: Project) -> str | None:
        """The model it loads (None when switched off)."""
        value: Any = project
        for part in self.model_key.split("."):
            value = getattr(value, part)
        return value

    def quantization(self, project: Project):
        """The quantization its model computes on (``spill.models.quant.Spec``; None: the float
        weights): the ``quantize`` of the group that names its model, where it has one."""
        from spill.models.quant import spec_of

        return spec_of(getattr(project, self.model_key.split(".")[0]))

    def summarize(self, result: Mapping[str, Any]) -> str:
        """Its result in a few words (the table and the plan's ``done`` reasons)."""
        raise NotImplementedError

    def count_name(self) -> str:
        """What its total counts, for a --stop-after past the end."""
        return f"{self.name}'s rows"

    def probe(self, root: Location) -> tuple[int, list[dict]]:
        """(steps or rows committed, distinct producers) from its job state; light: no hashing."""
        raise NotImplementedError

    def ranges(self, root: Location) -> list[dict[str, Any]]:
        """Who computed what, from its job state: ``{"from": a, "to": b, "producer": {...}}``
        for each run of steps or rows ``a..b`` one producer made, in order (``spill report``)."""
        raise NotImplementedError

    def pinned(self, root: Location) -> dict[str, Any] | None:
        """The model its job state is pinned to (``id``, ``fingerprint``, ``quantization``...),
        or None when it has no job state."""
        raise NotImplementedError

    def source(self, root: Location, total: int) -> str:
        """The committed state its outputs can be restored from, or ``""``."""
        done = self.probe(root)[0]
        return self._source(done) if done >= total else ""

    def _source(self, done: int) -> str:
        raise NotImplementedError

    def problem(self, root: Location, project: str, recorded: Mapping[str, Any] | None) -> str:
        """What is wrong with its recorded outputs (``adapters/toy missing``), or ``""``."""
        return outputs.problem(root, self.output(project), recorded, self.marker)

    def record(self, root: Location, project: str) -> dict[str, dict[str, Any]]:
        """What ``state.json`` keeps about its published outputs."""
        return outputs.record(root, self.output(project))

    def publish(self, root: Location, project: str) -> None:
        """After its job finished: publish what the job left in its folder (nothing by default)."""

    def restore(
        self, root: Location, project: str, inputs: Path, recorded: Mapping[str, Any] | None
    ) -> None:
        """Publish its outputs again from its committed state; ``inputs``: the build's derived
        input files (``test.jsonl``...)."""
        raise NotImplementedError
