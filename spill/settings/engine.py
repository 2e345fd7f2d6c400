"""``engine:``, where the stages compute; nothing here changes what a stage means.

``LoadOptions`` is how an engine holds a model (the engine seam's options): the group less the
engine's name and ``procs``. Each field is the setting's one definition: its schema fragment,
its flag (``spill.cli.options.engine_options``: ``--engine``, ``--ring K``, ...) and its help.
The defaults here are conf/engine/auto.yaml's (a test keeps them so): the seam's options are
built without reading conf/.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from spill.ground.sizes import parse_size
from spill.settings.field import setting

ENGINE_NAMES = ("auto", "torch", "mlx")
DTYPES = ("float32", "bfloat16")  # what base weights are computed in


@dataclass(frozen=True)
class LoadOptions:
    """How an engine holds a model: the engine group less the engine's name."""

    device: str | None = setting(  # "cpu", "cuda", "cuda:1"; None: the engine's best
        {"type": ["string", "null"]},
        "device for the engine, e.g. cpu or cuda (default: the best available)",
        decides=False,
        default=None,
    )
    dtype: str | None = setting(  # for base weights; None: measured choice
        {"enum": [*DTYPES, None]},
        "base-weight numerics (default: measured choice)",
        decides=False,
        default=None,
    )
    ring: int | None = setting(  # force this many layer slots (2 = the streaming test case)
        {"type": ["integer", "null"], "minimum": 1},
        "stream decoder layers through K slots (2 streams hardest)",
        decides=False,
        metavar="K",
        default=None,
    )
    resident: bool = setting(  # load every layer once and keep it
        {"type": "boolean"}, "load every layer once and keep it", decides=False, default=False
    )
    memory: int | str | None = setting(  # bytes, or "8G"; None: a cgroup's limit, else free RAM
        {
            "type": ["string", "integer", "null"],
            "pattern": "^\\s*\\d+(\\.\\d+)?\\s*[kKmMgGtT]?[iI]?[bB]?\\s*$",  # parse_size's
            "minimum": 1,
            "description": "e.g. 8G or 512M; null: a cgroup's limit less 384 MiB, else free RAM",
        },
        "what the job may hold beside a 384 MiB runtime, page cache included, e.g. 8G "
        "(default: a memory limit the process runs under, else free RAM; docs/memory.md)",
        decides=False,
        metavar="SIZE",
        parse=parse_size,
        default=None,
    )
    # 4-bit layers through torch's int4 weight-only matmul (CPU, bf16, no gradient), not a float
    # copy: other numbers than the dequantized path, named ``bfloat16+int4mm`` where recorded
    packed_matmul: bool = setting(
        {
            "type": "boolean",
            "description": "4-bit layers through torch's int4 matmul (CPU, bfloat16; row jobs)",
        },
        "compute 4-bit layers with torch's int4 matmul on a CPU (bfloat16, other numbers than "
        "the dequantized path; row jobs, not tune)",
        decides=False,
        default=False,
    )

    @property
    def budget(self) -> int | None:
        """``memory`` in bytes."""
        return parse_size(self.memory) if isinstance(self.memory, str) else self.memory


@dataclass(frozen=True, kw_only=True)
class EngineSettings(LoadOptions):
    """``engine:``: the engine's name and its processes, and how it holds a model."""

    name: str = setting(
        {"enum": list(ENGINE_NAMES)},
        "compute engine (default: %(default)s)",
        decides=False,
        flag="--engine",
        default="auto",
    )
    procs: int = setting(  # docs/procs.md
        {"type": "integer", "minimum": 1, "description": "processes; docs/procs.md"},
        decides=False,
        flag=False,
        default=1,
    )

    def load(self) -> LoadOptions:
        return LoadOptions(
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(LoadOptions)}
        )


def engine_flags() -> tuple[dataclasses.Field, ...]:
    """The engine settings the verbs take as flags, in spill.yaml's order: the name, then how
    the engine holds a model."""
    own = {f.name: f for f in dataclasses.fields(EngineSettings)}
    return tuple(f for f in (own["name"], *dataclasses.fields(LoadOptions)) if f.metadata["flag"])
