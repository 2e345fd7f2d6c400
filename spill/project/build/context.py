"""One build as the stages see it: the project, its state, its prepared data, its run, and the
few services a stage's job needs (where a job writes a file of ``files/``, the tuned adapter as
a local folder, its scores in the build's trackers)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from spill.control.control import Ownership
from spill.jobs.track import TrackSpec, log_scores
from spill.jobs.track.tracking import metric_name
from spill.project.config import Project
from spill.project.data import Prepared
from spill.store.disk import local_copy, put_file
from spill.store.fs import get_bytes, join
from spill.store.location import Location


@dataclass
class BuildContext:
    project: Project
    root: Location  # the state location, parsed
    prepared: Prepared
    data_sha: str  # the data file's sha256 when the build read it
    key: str  # the compose key of the config being built
    run: Ownership | None = (
        None  # the build's ownership of its run: every publication goes through it
    )
    work: Path = field(default_factory=Path)  # the derived input files, local
    track: TrackSpec | None = None  # the build's run in its trackers (spill.project.build.tracking)

    def under_budget(self) -> bool:
        """Whether its jobs run under a memory budget: ``engine.memory``, or a cgroup's limit
        (``spill.engines.core.budget``)."""
        from spill.engines.core.budget import resolve

        return resolve(self.project.engine.budget).total is not None

    def output(self, name: str) -> Path:
        """Where a job writes a file of ``files/``: there directly on a local state."""
        here = self.root.on_disk("files", name)
        return Path(here) if here is not None else self.work / name

    def publish(self, path: Path) -> None:
        """A file a job wrote with ``output``, under ``files/`` (a no-op on a local state)."""
        put_file(path, join(self.root, "files", path.name))

    def fetch(self, rel: str) -> Path:
        """A published file of the state (``files/teacher.jsonl``) as a local file."""
        local = self.output(rel.rsplit("/", 1)[-1])
        if not local.is_file():
            local.write_bytes(get_bytes(join(self.root, rel)))
        return local

    def log_scores(self, stage: str, scores: dict, step: int) -> None:
        """An eval stage's scores as metrics ``<stage>/<score>`` of the build's run at ``step``
        (the tuned adapter's step; 0 for the base model, whose eval leaves the run RUNNING for
        the tune that follows); each once, rank 0 only. No trackers: nothing."""
        if self.track is None:
            return
        values = {f"{metric_name(stage)}/{k}": v for k, v in scores.items()}
        log_scores(self.track, values, step, "FINISHED" if step else None)

    def local_folder(self, rel: str, names: tuple[str, ...]) -> Path:
        """The state's folder ``rel`` (the tuned adapter) as a local folder holding ``names``."""
        return local_copy(join(self.root, rel), names, self.work / rel.rsplit("/", 1)[-1])
