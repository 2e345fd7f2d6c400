"""``spill tune``: a LoRA run made of optimizer steps, each one a quantum that can be the last.

The job's whole state is the adapter, the AdamW moments, the step and the data cursor; batches
are a pure function of (seed, micro-batch index). A checkpoint is committed every
``ckpt_every`` steps, at ``stop_after``, at the end and on preemption; running the same command
again (here or on any machine and engine with the same ``--state``) continues from the newest
committed checkpoint. A checkpoint made with other weights, data or hyperparameters is refused
in one line naming the difference; a state location that cannot be written is refused before the
model loads (a probe writes and removes a temporary object). On finish the adapter is written in
spill's layout, the PEFT layout and the MLX-LM layout, with a loss-curve PNG.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from spill.console import note, progress
from spill.engines.base import ACTIVATIONS
from spill.errors import SpillError, UsageError
from spill.ground.paths import spill_home
from spill.jobs import producer, track
from spill.jobs.authority import Held, Writer, hold
from spill.jobs.group import Group
from spill.jobs.group import current as current_group
from spill.jobs.loading import find_model, open_model
from spill.jobs.preempt import Guard
from spill.jobs.tune.data import data_fingerprint, load_examples
from spill.jobs.tune.identity import identity, refuse_mismatch
from spill.jobs.tune.steps import Steps, follow, peak_rss_mb
from spill.jobs.tune.validation import Validation
from spill.models.config import LINEARS, load_config
from spill.models.lora import KNOWN, LoraConfig, init_params
from spill.models.quant import Spec
from spill.models.quantize import identity as quantization_identity
from spill.models.tokenizer import Tokenizer
from spill.payloads.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, settle
from spill.settings import EngineSettings, TuneSettings
from spill.store import drill
from spill.store.disk import same_file
from spill.store.fs import exists, join
from spill.store.location import Location, location
from spill.store.probe import probe_writable


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

    @property
    def lora(self) -> LoraConfig:
        t = self.tune
        targets = LoraConfig.parse_targets(t.targets, self.linears, self.family)
        return LoraConfig(t.rank, t.alpha, t.dropout, targets)

    def on(self, folder: Path) -> TuneOptions:
        """These options on the model in ``folder``: its linears are the targets' choice."""
        cfg = load_config(folder)
        return replace(self, linears=cfg.linears, family=cfg.family)

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
        LoraConfig.parse_targets(t.targets, KNOWN)  # no family's module fails here, in one line
        if self.stop_after is not None and not 1 <= self.stop_after <= t.steps:
            raise SpillError(f"--stop-after must be between 1 and --steps ({t.steps})")
        if t.activations not in ACTIVATIONS:
            raise SpillError(f"--activations {t.activations!r}: use {', '.join(ACTIVATIONS)}")
        if t.warmup < 0:
            raise SpillError("--warmup must be zero or more")
        if t.eval_every < 1:
            raise SpillError("--eval-every must be at least 1")
        if t.keep_best and self.valid is None:
            raise SpillError("--keep-best picks by validation loss; give --valid FILE too")
        if self.track is not None:
            self.track.check()  # a missing tracker package fails before the model loads


def state_root(name: str, state: str | None) -> Location:
    return location(state or str(spill_home() / "jobs" / name))


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def tune(model: str, train_path: Path, name: str, opts: TuneOptions) -> dict:
    """Run (or continue) the job; SIGTERM/SIGINT anywhere in it saves what is done and exits 75.
    Started as one rank of several (torchrun, ``--procs``), rank 0 holds and commits the run
    and the others compute their share of each step (``spill.jobs.group``)."""
    opts.check()
    group = current_group()
    if not group.leader:
        with Guard(unit="step") as guard:
            return _tune(guard, None, model, Path(train_path), name, opts, group)
    group.new_job()
    try:
        return _lead(model, train_path, name, opts, group)
    except BaseException as e:
        group.refuse(e)  # before the first step the other ranks stop with rank 0's refusal
        raise


def _lead(model: str, train_path: Path, name: str, opts: TuneOptions, group: Group) -> dict:
    t, w = opts.tune, opts.writer
    if w.state is not None and same_file(w.state, train_path):
        raise UsageError(
            f"--state {w.state} is the training file; give the state a folder of its own"
        )
    root = state_root(name, w.state)
    probe_writable(root)  # a read-only state fails before any step
    with hold(root, w) as held, track.session(opts.track, root, name, t.steps) as logs:
        with Guard(unit="step") as guard:
            summary = _tune(guard, held, model, Path(train_path), name, opts, group, logs)
        if summary["step"] == t.steps:
            held.finish()
    return summary


def _tune(
    guard: Guard,
    held: Held | None,
    model: str,
    train_path: Path,
    name: str,
    opts: TuneOptions,
    group: Group,
    logs: track.Session = track.OFF,
) -> dict:
    """The job on one rank: ``held`` is rank 0's (None on the others, which never commit);
    ``logs`` its trackers (``spill.jobs.track``)."""
    t = opts.tune
    if held is None:
        return follow(guard, model, train_path, opts, group)
    place = held.place
    root = place.uri
    # Everything that can refuse the run is checked before an engine opens.
    resolved, fingerprint = find_model(model, opts.weights, opts.quantize)
    if opts.quantize is not None:
        model = resolved.name  # the copy's own name: tiny:llama:1:4x64@q4g64
    folder = Path(resolved.folder)
    cfg, tok, opts = load_config(folder), Tokenizer(folder), opts.on(folder)
    examples = load_examples(Path(train_path), tok, t.seq_len)
    data = data_fingerprint(train_path)
    want = identity(model, fingerprint, data, opts, quantization_identity(folder))
    valid = Validation.open(opts.valid, tok, opts) if opts.valid else None
    if resolved.files:  # per-file sha256, so a later refusal can name the file that changed
        want["model"]["files"] = resolved.files
    ckpt = latest_checkpoint(place)
    if ckpt is not None:
        refuse_mismatch(ckpt.state, want, ckpt.uri, folder)
    if (ckpt.step if ckpt else 0) < (opts.stop_after or t.steps):  # steps to commit
        place = held.writable(f"its newest good checkpoint is step {ckpt.step if ckpt else 0}")
    guard.boundary()  # a stop before anything ran saves nothing and exits 75
    if ckpt is not None:
        params, opt, state = load_checkpoint(ckpt)
        m = {k[3:]: v for k, v in opt.items() if k.startswith("m::")}
        v = {k[3:]: x for k, x in opt.items() if k.startswith("v::")}
        step, losses, producers = state["step"], list(state["losses"]), list(state["producers"])
        if valid is not None:
            valid.restore(state, opt)
        note(
            f"continuing {name} from {ckpt.uri}: step {step} of {t.steps}, cursor {state['cursor']}"
        )
    else:
        params, m, v = init_params(cfg, opts.lora, opts.seed), {}, {}
        step, losses, producers = 0, [], []
    if group.world > 1:  # the other ranks start from the same adapter, moments and step
        group.start({"fingerprint": fingerprint, "step": step, "state": (params, m, v)})
    loaded = open_model(model, resolved, fingerprint, opts.engine.name, opts.engine, "tune", True)
    runner = loaded.runner
    me = producer.describe(runner.info) | {"procs": group.world}
    logs.start(me, t, ckpt.state if ckpt is not None else None)  # back-fills what it lacks
    trainer = runner.trainer(opts.lora)
    trainer.set_state(params, m, v)
    # the longest micro-batch this run can make; the choice never changes the results
    plan = trainer.plan(t.micro_batch, t.seq_len, t.activations)
    per_rank = (
        f" · {group.world} processes, each its own ring and --memory" if group.world > 1 else ""
    )
    note(f"spill tune · {plan.line()}{per_rank}")
    started, saved_at = step, step if ckpt is not None else None
    t0, rates = time.perf_counter(), {}  # rates: step -> tokens/s so far, for the trackers

    def save() -> str:
        nonlocal saved_at
        if saved_at == step:
            return f"step {step}"
        p, mm, vv = trainer.state()
        opt_arrays = {f"m::{k}": a for k, a in mm.items()} | {f"v::{k}": a for k, a in vv.items()}
        state = (valid.state() if valid else {}) | {
            **want,
            "step": step,
            "cursor": step * (t.batch // t.micro_batch),
            "losses": [_finite(x) if x is not None else None for x in losses],
            "producers": producer.extend(producers, me, started, step),
            "train_file": Path(train_path).name,
        }
        save_checkpoint(place, step, p, opt_arrays | (valid.arrays() if valid else {}), state)
        saved_at = step
        logs.committed(state, rates)
        return f"step {step} (committed)"

    guard.save = save
    stop = opts.stop_after or t.steps
    steps = Steps(trainer, examples, tok.pad_id, opts, group, runner.info.device)
    with progress(stop, "tune", unit="step", initial=step) as bar:
        while step < stop:
            group.boundary(guard)
            drill.at(drill.TUNE_BEFORE_FORWARD)
            loss = steps.gradients(step)
            drill.at(drill.TUNE_AFTER_BACKWARD)
            with guard.mutating():
                steps.apply(step)
                losses.append(loss)
                step += 1
                if valid is not None and valid.due(step):
                    valid.measure(runner, opts.lora, trainer.state()[0], step)
                drill.at(drill.TUNE_AFTER_OPTIMIZER)
            rate = rates[step] = steps.tokens / (time.perf_counter() - t0)
            shown = {"valid": f"{valid.last():.4f}"} if valid and valid.last() is not None else {}
            bar.set_postfix(loss=f"{loss:.4f}", **shown, tok_s=f"{rate:.0f}")
            bar.update(1)
            if step % t.ckpt_every == 0 or step == stop:
                with guard.mutating():
                    save()
                    bar.checkpoint("checkpoint committed")
    seconds = time.perf_counter() - t0
    tokens = steps.tokens
    peaks = group.collect(peak_rss_mb()) if group.world > 1 else None
    settle(place)  # the last save's removal of older checkpoints ends with the tune
    summary = {
        "name": name,
        "step": step,
        "steps": t.steps,
        "loss": round(losses[-1], 6) if losses else None,
        **(valid.summary() if valid else {}),
        "tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
        "seconds": round(seconds, 2),
        "state": root,
        "engine": runner.info.engine,
        "numerics": runner.info.numerics,
    }
    if group.world > 1:
        summary["procs"] = group.world
        summary["communication_s"] = round(group.waited, 2)  # waiting for ranks too
        summary["peak_rss_mb"] = peaks  # by rank
    ranges = producer.extend(producers, me, started, step)
    if len({(p["engine"], p["machine"], p["numerics"]) for p in ranges}) > 1:
        moved = "; ".join(
            f"steps {p['from_step']}-{p['to_step']} {p['engine']} {p['numerics']} on {p['machine']}"
            for p in ranges
        )
        note(f"this run moved: {moved}")
        summary["moved"] = moved
    guard.boundary()
    if step == t.steps and place.run is None and exists(join(root, "adapter", "adapter.json")):
        summary["adapter"] = join(root, "adapter")  # a completed run, read only: already there
        note(f"run complete; its adapter is {summary['adapter']}")
    elif step == t.steps:
        from spill.jobs.adapter_files import publish_adapter

        p = valid.kept(trainer.state()[0]) if valid else trainer.state()[0]
        summary["adapter"] = publish_adapter(
            root, p, opts.lora, model, fingerprint, cfg.num_hidden_layers, losses, resolved.files,
            want["model"].get("quantization"), valid.record() if valid else None,
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
    runner.close()
    return summary
