"""``spill tune`` (``tune``): a LoRA run made of optimizer steps, each one a quantum that can be the
last. The job's whole state is the adapter, the AdamW moments, the step and the data cursor; batches
are a pure function of (seed, micro-batch index). Rank 0 commits a checkpoint every ``ckpt_every``
steps, at ``stop_after``, at the end and on preemption; the same command again (any machine, engine
or world size with the same ``--state``) continues from the newest one. Every rank runs ``run``:
what rank 0 does beyond its share of a step (hold the run, commit, validate, log, publish the
adapter) is its ``Leader``, the others' ``Follower`` (``spill.jobs.tune.ranks``).
"""

from __future__ import annotations

import time
from pathlib import Path

from spill.console import note, progress
from spill.engines.base import TuneShape
from spill.errors import UsageError
from spill.jobs import track
from spill.jobs.authority import hold
from spill.jobs.group import Group
from spill.jobs.group import current as current_group
from spill.jobs.loading import find_model, open_model
from spill.jobs.preempt import Guard
from spill.jobs.tune.data import load_examples
from spill.jobs.tune.options import TuneOptions, state_root
from spill.jobs.tune.pairs import load_pairs
from spill.jobs.tune.ranks import Follower, Found, Leader, Role
from spill.jobs.tune.steps import Steps, peak_rss_mb
from spill.models.config import load_config
from spill.models.tokenizer import Tokenizer
from spill.store.disk import same_file
from spill.store.probe import probe_writable

# a preference tune's metrics the progress line shows (every one goes to the checkpoint and trackers)
SHOWN = {"rewards/accuracies": "acc", "rewards/margins": "margin"}


def tune(model: str, train_path: Path, name: str, opts: TuneOptions) -> dict:
    """Run (or continue) the job; SIGTERM/SIGINT anywhere in it saves what is done and exits 75.
    Started as one rank of several (torchrun, ``--procs``), rank 0 holds and commits the run
    and the others compute their share of each step (``spill.jobs.group``)."""
    opts.check()
    group = current_group()
    if not group.leader:
        with Guard(unit="step") as guard:
            begin = group.start(None)  # what rank 0 starts from, or its refusal
            return run(guard, Follower(group, begin), model, Path(train_path), opts, group)
    group.new_job()
    try:
        return _lead(model, Path(train_path), name, opts, group)
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
            leader = Leader(guard, held, logs, group, name, train_path)
            summary = run(guard, leader, model, train_path, opts, group)
        if summary["step"] == t.steps:
            held.finish()
    return summary


def run(
    guard: Guard, role: Role, model: str, train_path: Path, opts: TuneOptions, group: Group
) -> dict:
    """The job on one rank: the same model, rows, trainer and steps on every rank; ``role`` is
    what this rank does beyond them. Returns the role's summary."""
    t = opts.tune
    # Everything that can refuse the run is checked before an engine opens.
    resolved, fingerprint = find_model(model, opts.weights, opts.quantize)
    if opts.quantize is not None:
        model = resolved.name  # the copy's own name: tiny:llama:1:4x64@q4g64
    folder = Path(resolved.folder)
    cfg, tok, opts = load_config(folder), Tokenizer(folder), opts.on(folder)
    if t.method == "sft":
        examples = load_examples(train_path, tok, t.seq_len)
    else:
        examples = load_pairs(train_path, tok, t.seq_len, bos=t.method == "orpo")
    found = Found(model, resolved, fingerprint, cfg, tok)
    step, state = role.begin(found, opts)
    shape = TuneShape(opts.lora, t.micro_batch, t.seq_len)
    loaded = open_model(
        model, resolved, fingerprint, opts.engine.name, opts.engine, "tune", shape, tok
    )
    runner = loaded.runner
    trainer = runner.trainer(opts.lora)
    trainer.set_state(*state)
    # the longest micro-batch this run can make; the choice never changes the results
    plan = trainer.plan(t.micro_batch, t.seq_len, t.activations)
    per_rank = (
        f" · {group.world} processes, each its own ring and --memory" if group.world > 1 else ""
    )
    note(f"spill tune · {plan.line()}{per_rank}")  # rank 0's: the others are quiet
    if t.method == "dpo":
        note(
            "spill tune · DPO reference: the base (adapter off), one forward of a pair's first "
            "micro-batch, kept with the checkpoints"
        )
    role.opened(runner, trainer)
    t0 = time.perf_counter()
    stop, loss = opts.stop_after or t.steps, None
    steps = Steps(trainer, examples, tok.pad_id, opts, group, runner.info.device, role.refs)
    role.refs = steps.refs  # the same array: what the steps compute, rank 0 commits
    with progress(stop, "tune", unit="step", initial=step) as bar:
        while step < stop:
            group.boundary(guard)
            role.before_forward()
            loss = steps.gradients(step)
            role.after_backward()
            with guard.mutating():
                steps.apply(step)
                step += 1
                role.applied(step, loss, steps.metrics)
            rate = steps.tokens / (time.perf_counter() - t0)
            shown = {v: f"{steps.metrics[k]:.3f}" for k, v in SHOWN.items() if k in steps.metrics}
            bar.set_postfix(loss=f"{loss:.4f}", **shown, **role.shown(), tok_s=f"{rate:.0f}")
            bar.update(1)
            role.stepped(step, rate, bar)
    seconds = time.perf_counter() - t0
    peaks = group.collect(peak_rss_mb()) if group.world > 1 else None  # by rank
    summary = role.finish(step, loss, seconds, steps.tokens, peaks)
    runner.close()
    return summary
