"""What a ``spill tune`` job is asked to do: the tune group's settings, the seed, the engine
group, where it writes, and the checks that refuse a bad combination before anything loads."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from spill.engines.base import ACTIVATIONS
from spill.errors import SpillError, UsageError
from spill.ground.paths import spill_home
from spill.jobs import track
from spill.jobs.authority import Writer
from spill.models.config import LINEARS, load_config
from spill.models.lora import KNOWN, LoraConfig
from spill.models.quant import Spec
from spill.settings import METHODS, EngineSettings, TuneSettings
from spill.store.location import Location, location


@dataclass(frozen=True, kw_only=True)
class TuneOptions:
    """A tune job: the ``tune`` group's settings (``spill.settings.TuneSettings``; every default
    in ``conf/tune/default.yaml``), the project seed, the engine group, and where it writes."""

    tune: TuneSettings
    seed: int
    engine: EngineSettings = field(default_factory=EngineSettings)
    stop_after: int | None = None
    weights: str | None = None
    writer: Writer = field(default_factory=Writer)
    quantize: Spec | None = None  # the model group's quantization (None: the float weights)
    valid: Path | None = None  # validation rows (JSONL, as the training file); None: none
    track: track.TrackSpec | None = None  # the trackers rank 0 logs to (tune.log)
    linears: tuple[str, ...] = LINEARS  # the model's (ModelConfig.linears), once it is read
    family: str | None = None
    experts: bool = False  # the model routes to experts: gate_proj, up_proj, down_proj target them

    @property
    def lora(self) -> LoraConfig:
        t = self.tune
        targets = LoraConfig.parse_targets(t.targets, self.linears, self.family, self.experts)
        return LoraConfig(t.rank, t.alpha, t.dropout, targets)

    def on(self, folder: Path) -> TuneOptions:
        """These options on the model in ``folder``: its linears are the targets' choice."""
        cfg = load_config(folder)
        return replace(self, linears=cfg.linears, family=cfg.family, experts=cfg.experts > 0)

    def check(self) -> None:
        t = self.tune
        if t.steps < 1 or t.ckpt_every < 1 or t.seq_len < 2:
            raise SpillError("--steps and --ckpt-every must be at least 1, --seq-len at least 2")
        if t.micro_batch < 1 or t.batch < 1:
            raise SpillError("--batch and --micro-batch must be at least 1")
        if why := t.problem(lambda key: "--" + key.replace("_", "-")):
            raise UsageError(why)
        if t.rank < 1 or not 0 <= t.dropout < 1:
            raise SpillError("--rank must be at least 1 and --dropout in [0, 1)")
        if t.alpha is not None and not t.alpha > 0:  # NaN too
            raise SpillError(f"--alpha {t.alpha}: a number above 0 (leave it out for 2 x --rank)")
        if not t.weight_decay >= 0:
            raise SpillError(f"--weight-decay {t.weight_decay}: zero or more")
        # no family's module fails here, in one line
        LoraConfig.parse_targets(t.targets, KNOWN, experts=True)
        if self.stop_after is not None and not 1 <= self.stop_after <= t.steps:
            raise SpillError(f"--stop-after must be between 1 and --steps ({t.steps})")
        if t.activations not in ACTIVATIONS:
            raise SpillError(f"--activations {t.activations!r}: use {', '.join(ACTIVATIONS)}")
        if t.method not in METHODS:
            raise UsageError(f"--method {t.method!r}: use {', '.join(METHODS)}")
        if not (0 < t.beta < math.inf):
            raise UsageError(f"--beta {t.beta}: a number above 0 (TRL's default is 0.1)")
        if t.warmup < 0:
            raise SpillError("--warmup must be zero or more")
        if t.eval_every < 1:
            raise SpillError("--eval-every must be at least 1")
        if t.keep_best and self.valid is None:
            raise SpillError("--keep-best picks by validation loss; give --valid FILE too")
        if self.track is not None:
            self.track.check()  # a missing tracker package fails before the model loads


def state_root(name: str, state: Location | None) -> Location:
    return location(state or str(spill_home() / "jobs" / name))
