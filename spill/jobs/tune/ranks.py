"""What a rank of ``spill tune`` does beyond its share of each step (``spill.jobs.tune.job.run``).

``Leader`` (rank 0, the only one in a world of one) holds the run: it refuses a checkpoint of
another run, starts from the newest committed one, hands the others what it starts from, commits
checkpoints, measures the validation loss, logs to the trackers and publishes the adapter.
``Follower`` (every other rank) starts where rank 0 says and commits nothing. The drill points
differ too: rank 0's are the ``tune-*`` ones, the others' ``rank-step``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from spill.console import note
from spill.engines.base import Runner, Trainer
from spill.errors import SpillError
from spill.jobs import producer, track
from spill.jobs.adapter_files import publish_adapter
from spill.jobs.authority import Held
from spill.jobs.group import Group
from spill.jobs.preempt import Guard
from spill.jobs.tune.data import data_fingerprint
from spill.jobs.tune.identity import identity, refuse_mismatch
from spill.jobs.tune.options import TuneOptions
from spill.jobs.tune.validation import Validation
from spill.models.config import ModelConfig
from spill.models.lora import init_params
from spill.models.resolve import ResolvedModel
from spill.models.sources.quantize import identity as quantization_identity
from spill.models.tokenizer import Tokenizer
from spill.payloads.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, settle
from spill.store import drill
from spill.store.fs import exists, join

State = tuple[dict, dict, dict]  # the adapter, the AdamW first and second moments, by name


@dataclass(frozen=True)
class Found:
    """The model every rank found: its name (a quantized copy's own), files and fingerprint."""

    name: str
    resolved: ResolvedModel
    fingerprint: str
    cfg: ModelConfig
    tok: Tokenizer


class Role(Protocol):
    refs: np.ndarray | None  # a DPO run's reference log-probs, (pairs, 2), NaN: not yet known

    def begin(self, found: Found, opts: TuneOptions) -> tuple[int, State]:
        """The step the run starts at and the trainer's state there."""

    def opened(self, runner: Runner, trainer: Trainer) -> None: ...
    def before_forward(self) -> None: ...
    def after_backward(self) -> None: ...
    def applied(self, step: int, loss: float, metrics: dict[str, float]) -> None:
        """Step ``step`` is applied (under the guard's ``mutating``); ``metrics``: a preference
        tune's (TRL's names), empty for SFT."""

    def shown(self) -> dict[str, str]:
        """What the progress line shows beside the loss."""

    def stepped(self, step: int, rate: float, bar) -> None:
        """After step ``step``, ``rate`` tokens/s so far."""

    def finish(
        self, step: int, loss: float | None, seconds: float, tokens: int, peaks: list | None
    ) -> dict:
        """The job's summary (``peaks``: every rank's peak RSS, in a group)."""


class Follower:
    """A rank other than 0: starts where rank 0 says (``begin``: its ``Group.start`` payload)."""

    def __init__(self, group: Group, begin: dict) -> None:
        self.group, self.start = group, begin

    def begin(self, found: Found, opts: TuneOptions) -> tuple[int, State]:
        fingerprint = self.start["fingerprint"]
        if found.fingerprint != fingerprint:  # every node needs the model rank 0 found
            raise SpillError(
                f"rank {self.group.rank} found other weights for {found.name} (fingerprint "
                f"{found.fingerprint[7:19]}..) than rank 0 ({fingerprint[7:19]}..); give every "
                "node the same model (its cache, or --weights URI)"
            )
        self.steps = opts.tune.steps
        self.refs = self.start.get("refs")  # rank 0's, continuing; None: computed by every rank
        return self.start["step"], self.start["state"]

    def opened(self, runner: Runner, trainer: Trainer) -> None:
        pass

    def before_forward(self) -> None:
        drill.at(drill.RANK_STEP)

    def after_backward(self) -> None:
        pass

    def applied(self, step: int, loss: float, metrics: dict[str, float]) -> None:
        pass

    def shown(self) -> dict[str, str]:
        return {}

    def stepped(self, step: int, rate: float, bar) -> None:
        pass

    def finish(
        self, step: int, loss: float | None, seconds: float, tokens: int, peaks: list | None
    ) -> dict:
        # the keys a build's tune stage reads, as rank 0's summary has them
        return {"rank": self.group.rank, "step": step, "steps": self.steps, "loss": loss}


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


class Leader:
    """Rank 0: holds the run (``held``), logs to ``logs``, names the job ``name``."""

    def __init__(
        self,
        guard: Guard,
        held: Held,
        logs: track.Session,
        group: Group,
        name: str,
        train_path: Path,
    ) -> None:
        self.guard, self.held, self.logs, self.group = guard, held, logs, group
        self.name, self.train_path = name, train_path
        self.place = held.place
        self.root = self.place.uri
        self.rates: dict[int, float] = {}  # step -> tokens/s so far, for the trackers
        self.refs: np.ndarray | None = None

    def begin(self, found: Found, opts: TuneOptions) -> tuple[int, State]:
        """Refuses a checkpoint of another run, then starts from the newest committed one (or
        a new adapter) and hands that to the other ranks."""
        t, self.found, self.opts = opts.tune, found, opts
        folder = Path(found.resolved.folder)
        data = data_fingerprint(self.train_path)
        want = identity(found.name, found.fingerprint, data, opts, quantization_identity(folder))
        self.valid = Validation.open(opts.valid, found.tok, opts) if opts.valid else None
        if found.resolved.files:  # per-file sha256, so a refusal can name the file that changed
            want["model"]["files"] = found.resolved.files
        self.want = want
        ckpt = latest_checkpoint(self.place)
        if ckpt is not None:
            refuse_mismatch(ckpt.state, want, ckpt.uri, folder)
        if (ckpt.step if ckpt else 0) < (opts.stop_after or t.steps):  # steps to commit
            newest = f"its newest good checkpoint is step {ckpt.step if ckpt else 0}"
            self.place = self.held.writable(newest)
        self.guard.boundary()  # a stop before anything ran saves nothing and exits 75
        self.resumed = ckpt.state if ckpt is not None else None
        if ckpt is not None:
            params, opt, state = load_checkpoint(ckpt)
            m = {k[3:]: v for k, v in opt.items() if k.startswith("m::")}
            v = {k[3:]: x for k, x in opt.items() if k.startswith("v::")}
            step, self.losses = state["step"], list(state["losses"])
            self.producers = list(state["producers"])
            self.metrics = list(state.get("metrics", []))
            if "reference" in state:
                ref = state["reference"]
                both = [
                    [np.nan if x is None else x for x in ref[k]] for k in ("chosen", "rejected")
                ]
                self.refs = np.array(both, dtype=np.float64).T
            if self.valid is not None:
                self.valid.restore(state, opt)
            note(
                f"continuing {self.name} from {ckpt.uri}: step {step} of {t.steps}, cursor "
                f"{state['cursor']}"
            )
        else:
            params, m, v = init_params(found.cfg, opts.lora, opts.seed), {}, {}
            step, self.losses, self.producers, self.metrics = 0, [], [], []
        if self.group.world > 1:  # the other ranks start from the same adapter, moments, step
            self.group.start(
                {
                    "fingerprint": found.fingerprint,
                    "step": step,
                    "state": (params, m, v),
                    "refs": self.refs,
                }
            )
        self.step = self.started = step
        self.saved_at = step if ckpt is not None else None
        return step, (params, m, v)

    def opened(self, runner: Runner, trainer: Trainer) -> None:
        self.runner, self.trainer = runner, trainer
        self.me = producer.describe(runner.info) | {"procs": self.group.world}
        self.logs.start(self.me, self.opts.tune, self.resumed)  # back-fills what it lacks
        self.guard.save = self.save

    def save(self) -> str:
        """Commits the step reached (a preemption's save too: the guard calls it)."""
        t, step = self.opts.tune, self.step
        if self.saved_at == step:
            return f"step {step}"
        p, mm, vv = self.trainer.state()
        opt = {f"m::{k}": a for k, a in mm.items()} | {f"v::{k}": a for k, a in vv.items()}
        valid = self.valid
        state = (valid.state() if valid else {}) | {
            **self.want,
            "step": step,
            "cursor": step * (t.batch // t.micro_batch),
            "losses": [_finite(x) for x in self.losses],
            **self._preference(),
            "producers": producer.extend(self.producers, self.me, self.started, step),
            "train_file": self.train_path.name,
        }
        save_checkpoint(self.place, step, p, opt | (valid.arrays() if valid else {}), state)
        self.saved_at = step
        self.logs.committed(state, self.rates)
        return f"step {step} (committed)"

    def _preference(self) -> dict:
        """A preference tune's state: every step's metrics, and DPO's reference log-probs (JSON
        keeps a float64 exactly, so a continuation uses the values every step used)."""
        if self.opts.tune.method == "sft":
            return {}
        out = {"metrics": [{k: _finite(x) for k, x in m.items()} for m in self.metrics]}
        if self.refs is not None:  # null: a pair no step has taken yet
            out["reference"] = {
                k: [None if np.isnan(x) else float(x) for x in self.refs[:, i]]
                for i, k in enumerate(("chosen", "rejected"))
            }
        return out

    def before_forward(self) -> None:
        drill.at(drill.TUNE_BEFORE_FORWARD)

    def after_backward(self) -> None:
        drill.at(drill.TUNE_AFTER_BACKWARD)

    def applied(self, step: int, loss: float, metrics: dict[str, float]) -> None:
        self.losses.append(loss)
        if metrics:
            self.metrics.append(dict(metrics))
        self.step = step
        if self.valid is not None and self.valid.due(step):
            params = self.trainer.state()[0]
            self.valid.measure(self.runner, self.opts.lora, params, step)
        drill.at(drill.TUNE_AFTER_OPTIMIZER)

    def shown(self) -> dict[str, str]:
        last = self.valid.last() if self.valid else None
        return {"valid": f"{last:.4f}"} if last is not None else {}

    def stepped(self, step: int, rate: float, bar) -> None:
        self.rates[step] = rate
        if step % self.opts.tune.ckpt_every == 0 or step == (
            self.opts.stop_after or self.opts.tune.steps
        ):
            with self.guard.mutating():
                self.save()
                bar.checkpoint("checkpoint committed")

    def finish(
        self, step: int, loss: float | None, seconds: float, tokens: int, peaks: list | None
    ) -> dict:
        t, valid, group, found = self.opts.tune, self.valid, self.group, self.found
        settle(self.place)  # the last save's removal of older checkpoints ends with the tune
        summary = {
            "name": self.name,
            "step": step,
            "steps": t.steps,
            "loss": round(self.losses[-1], 6) if self.losses else None,
            **({"method": t.method, **self.metrics[-1]} if self.metrics else {}),
            **(valid.summary() if valid else {}),
            "tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
            "seconds": round(seconds, 2),
            "state": self.root,
            "engine": self.runner.info.engine,
            "numerics": self.runner.info.numerics,
            **self.runner.stats.routed(),
        }
        if group.world > 1:
            summary["procs"] = group.world
            summary["communication_s"] = round(group.waited, 2)  # waiting for ranks too
            summary["peak_rss_mb"] = peaks  # by rank
        ranges = producer.extend(self.producers, self.me, self.started, step)
        if len({(p["engine"], p["machine"], p["numerics"]) for p in ranges}) > 1:
            moved = "; ".join(
                f"steps {p['from_step']}-{p['to_step']} {p['engine']} {p['numerics']} on "
                f"{p['machine']}"
                for p in ranges
            )
            note(f"this run moved: {moved}")
            summary["moved"] = moved
        self.guard.boundary()
        root = self.root
        if (
            step == t.steps
            and self.place.run is None
            and exists(join(root, "adapter", "adapter.json"))
        ):
            summary["adapter"] = join(root, "adapter")  # a completed run, read only: already there
            note(f"run complete; its adapter is {summary['adapter']}")
        elif step == t.steps:
            p = valid.kept(self.trainer.state()[0]) if valid else self.trainer.state()[0]
            # the ring's slots and the resident weights go before the adapter's three layouts
            # and its plot are written: inside a memory limit they would share it (report 021)
            self.runner.close()
            summary["adapter"] = publish_adapter(
                root, p, self.opts.lora, found.name, found.fingerprint,
                found.cfg.num_hidden_layers, self.losses, found.resolved.files,
                self.want["model"].get("quantization"), valid.record() if valid else None,
            )  # fmt: skip
            best = valid.best if valid and t.keep_best else None
            kept = f" of step {best['step']} (the lowest validation loss)" if best else ""
            note(
                f"adapter{kept} written to {summary['adapter']} (spill, PEFT and MLX-LM layouts, "
                "loss.png)"
            )
        else:
            note(
                f"stopped after step {step} of {t.steps} (--stop-after) with a committed "
                "checkpoint; to continue, run it again without --stop-after or with a later one"
            )
        return summary
