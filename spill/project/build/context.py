"""One build as the stages see it: the project, its state, its prepared data, its run, and the
few services a stage's job needs (where a job writes a file of ``files/``, the options of a job
that commits under the build's run, the tuned adapter as a local folder)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from spill.store.fs import get_bytes, join, put_bytes
from spill.store.location import location

if TYPE_CHECKING:
    from spill.control.control import Ownership
    from spill.jobs.track import TrackSpec
    from spill.project.build.stages.base import Stage
    from spill.project.config import Project
    from spill.project.data import Prepared


@dataclass
class BuildContext:
    project: Project
    root: str  # the state location
    prepared: Prepared
    data_sha: str  # the data file's sha256 when the build read it
    key: str  # the compose key of the config being built
    run: Ownership | None = (
        None  # the build's ownership of its run: every publication goes through it
    )
    work: Path = field(default_factory=Path)  # the derived input files, local
    track: TrackSpec | None = None  # the build's run in its trackers (spill.project.build.tracking)

    def output(self, name: str) -> Path:
        """Where a job writes a file of ``files/``: there directly on a local state."""
        where = join(self.root, "files")
        return Path(location(where).path) / name if location(where).local else self.work / name

    def publish(self, path: Path) -> None:
        """A file a job wrote with ``output``, under ``files/`` (a no-op on a local state)."""
        if not location(self.root).local:
            put_bytes(join(self.root, "files", path.name), path.read_bytes())

    def fetch(self, rel: str) -> Path:
        """A published file of the state (``files/teacher.jsonl``) as a local file."""
        local = self.output(rel.rsplit("/", 1)[-1])
        if not local.is_file():
            local.write_bytes(get_bytes(join(self.root, rel)))
        return local

    def job_options(self, batch: int | None, stop: int | None, stage: Stage, setting: str = ""):
        """A job's ``RowOptions``: the engine settings, the group's batch (``setting`` names it
        for the pre-run line; None: from the memory budget), the model folder a bundle install
        gave this project (None: the name's own), where it commits, and the quantized copy its
        model computes on (``model.quantize``)."""
        from spill.jobs.authority import Writer
        from spill.jobs.rows_job import RowOptions

        return RowOptions(
            batch=batch,
            batch_from=setting or "--batch",
            engine=self.project.engine,
            weights=self.weights(stage),
            stop_after=stop,
            writer=Writer(state=stage.uri(self.root), place=stage.place(self.root, self.run)),
            quantize=stage.quantization(self.project),
        )

    def weights(self, stage: Stage) -> str | None:
        """The model folder a bundle install gave this project for ``stage``'s model (None: the
        name's own)."""
        from spill.project.bundle.installed import model_folder

        return model_folder(self.project.root, stage.model(self.project))

    def log_scores(self, stage: str, scores: dict, step: int) -> None:
        """An eval stage's scores as metrics ``<stage>/<score>`` of the build's run at ``step``
        (the tuned adapter's step; 0 for the base model, whose eval leaves the run RUNNING for
        the tune that follows); each once, rank 0 only. No trackers: nothing."""
        if self.track is None:
            return
        from spill.jobs.track import log_scores
        from spill.jobs.track.tracking import metric_name

        values = {f"{metric_name(stage)}/{k}": v for k, v in scores.items()}
        log_scores(self.track, values, step, "FINISHED" if step else None)

    def local_folder(self, rel: str, names: tuple[str, ...]) -> Path:
        """The state's folder ``rel`` (the tuned adapter) as a local folder holding ``names``."""
        uri = join(self.root, rel)
        if location(uri).local:
            return Path(location(uri).path)
        local = self.work / rel.rsplit("/", 1)[-1]
        local.mkdir(exist_ok=True)
        for name in names:
            (local / name).write_bytes(get_bytes(join(uri, name)))
        return local
