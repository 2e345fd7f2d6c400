"""The job verbs on the command line: ``run``, ``eval``, ``distill``, ``tune`` (alias ``train``).

Each command turns its arguments into the options of its job module (``spill.jobs.rows.generate``,
``eval``, ``distill``, ``tune``), makes one call and prints the summary. Every flag that is a
setting of a conf group (``model``, ``tune``, ``eval``, ``teacher``, ``engine``) takes its default from
``spill.conf.defaults``, so ``spill tune`` and a build with the same values are the same run.
Everything heavy is imported inside the commands, so ``spill --help`` stays light.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from spill.cli.options import (
    authority_options,
    engine_options,
    engine_settings,
    log_option,
    model_options,
    model_settings,
    setting_flags,
)
from spill.settings import EvalSettings, TeacherSettings, TuneSettings
from spill.store.location import location


def _generation_options(p: argparse.ArgumentParser) -> None:
    setting_flags(p, TeacherSettings, "teacher")  # run shares distill's generation defaults
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="sampling seed; each row derives its own from it and its id",
    )
    p.add_argument(
        "--chat", action="store_true", help="wrap plain prompts in the chat template as a user turn"
    )


def _state_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--state",
        metavar="URI",
        help="commit results here (local path, s3://, gs://, az://, memory://) and continue "
        "from what is committed; SIGTERM/SIGINT then saves and exits 75",
    )
    authority_options(p)


def _writer(args):
    from spill.jobs.authority import Writer

    state = location(args.state) if args.state else None  # the command line's text, parsed once
    return Writer(state, args.lease, args.wait, tuple(getattr(args, "argv", ())))


def _row_options(args, writer=None):
    from spill.jobs.rows.job import RowOptions
    from spill.models.quant import spec_of

    return RowOptions(
        batch=args.batch,
        engine=engine_settings(args),
        weights=args.weights,
        writer=writer or _writer(args),
        quantize=spec_of(model_settings(args)),
    )


def _run_options(args, adapter: str | None = None):
    from spill.jobs.rows.generate import GenerateOptions

    return GenerateOptions(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        chat=args.chat,
        adapter=Path(adapter) if adapter else None,
    )


def _job_options(p: argparse.ArgumentParser) -> None:
    """What every job verb ends with: --procs, --json, the engine group and the model group."""
    p.add_argument(
        "--procs",
        type=int,
        default=1,
        metavar="N",
        help="run as N processes on this host through torch's elastic launcher (torchrun); "
        "the result is the same at any N (docs/procs.md)",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    engine_options(p)
    model_options(p)


def _launched(args) -> int | None:
    """With ``--procs N`` (N > 1): the job run as N processes by torch's elastic launcher, its
    exit status; None: run it here."""
    if getattr(args, "procs", 1) == 1:
        return None
    from spill.jobs.launch import launch

    return launch(args.procs, args.argv)


def _checked_out(args) -> None:
    """Refuse an ``--out`` that would overwrite a project's files or state, before anything runs
    (``spill.project.owned``); one that is an input is the job's own check."""
    from spill.project.owned import refuse_output

    refuse_output(args.out, "--out", states=(args.state,))


def cmd_run(args) -> int:
    _checked_out(args)
    if (code := _launched(args)) is not None:
        return code
    from spill.console import emit
    from spill.jobs.rows.generate import generate

    opts = _run_options(args, args.adapter)
    emit(
        generate(args.model, Path(args.input), Path(args.out), opts, _row_options(args)), args.json
    )
    return 0


def cmd_distill(args) -> int:
    _checked_out(args)
    if (code := _launched(args)) is not None:
        return code
    from spill.console import emit
    from spill.jobs.rows.distill import distill

    opts, job = _run_options(args), _row_options(args)
    emit(distill(args.teacher, Path(args.input), Path(args.out), opts, job), args.json)
    return 0


def cmd_eval(args) -> int:
    _checked_out(args)
    if (code := _launched(args)) is not None:
        return code
    from spill.console import emit
    from spill.jobs.rows.eval import EvalOptions, evaluate

    opts = EvalOptions(
        max_new_tokens=args.max_new_tokens,
        chat=args.chat,
        adapter=Path(args.adapter) if args.adapter else None,
    )
    out = Path(args.out) if args.out else None
    logs = _eval_tracking(args, writer := _writer(args))
    result = evaluate(args.model, Path(args.input), out, opts, _row_options(args, writer))
    if logs is not None:
        from spill.jobs.track import log_scores

        log_scores(logs, {f"eval/{k}": v for k, v in result.items()})
    columns = ["rows", "correct", "accuracy", "gold_logprob", "gold_logprob_per_token"]
    emit(result, args.json, None if args.json else columns)
    return 0


def _eval_tracking(args, writer):
    """``spill eval --log``: its scores as one run of the experiment ``spill-eval``, named
    by model and input; keyed by ``--state`` (``writer.state``, parsed: a rerun logs nothing
    twice), else a new run."""
    if not args.log:
        return None
    import uuid

    from spill.jobs.track import TrackSpec, check, logdir_for

    check(args.log)  # before the model loads
    run = f"{Path(args.model).name} on {Path(args.input).name}" + (
        f" with {Path(args.adapter).name}" if args.adapter else ""
    )
    logdir = logdir_for(writer.state, run)[0] if writer.state else None
    params = {"model.name": args.model, "input": args.input, "adapter": args.adapter}
    key = f"eval#{args.state}" if args.state else f"eval#{uuid.uuid4().hex}"
    return TrackSpec(args.log, "spill-eval", run, params, logdir=logdir, key=key)


def cmd_tune(args) -> int:
    from spill.console import emit
    from spill.jobs.tune import TuneOptions, tune
    from spill.models.quant import spec_of

    if (code := _launched(args)) is not None:
        return code
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(TuneSettings)}
    valid = fields.pop("valid")  # the job's file; the setting carves rows off in a build
    settings = TuneSettings(**fields, valid=None)
    opts = TuneOptions(
        tune=settings,
        valid=Path(valid) if valid else None,
        seed=args.seed,
        engine=engine_settings(args),
        stop_after=args.stop_after,
        weights=args.weights,
        writer=_writer(args),
        quantize=spec_of(model_settings(args)),
        track=_tracking(args, settings),
    )
    emit(tune(args.model, Path(args.train), args.name, opts), args.json)
    return 0


def _tracking(args, settings):
    """``--log``'s trackers for a bare ``spill tune``: experiment and run its ``--name``
    (``spill.jobs.track.session``), the run's settings as params."""
    if not args.log:
        return None
    from spill.jobs.track import TrackSpec, flat

    model = {"name": args.model, "quantize": args.quantize, "group_size": args.group_size}
    params = {**flat("tune", settings), **flat("model", model), "seed": args.seed}
    return TrackSpec(kinds=args.log, params=params)


def _tune_options(p: argparse.ArgumentParser) -> None:
    """One flag per setting of the tune group (``spill.settings.TuneSettings``)."""
    g = p.add_argument_group("settings (defaults: conf/tune/default.yaml, as in a build)")
    setting_flags(g, TuneSettings, "tune")
    g.add_argument(
        "--valid",
        metavar="FILE",
        help="validation rows (JSONL, as TRAIN): their loss every --eval-every steps, committed "
        "with the checkpoints",
    )
    log_option(g)
    p.add_argument(
        "--stop-after", type=int, metavar="N", help="stop after step N with a committed checkpoint"
    )


HELP = {
    "run": "generate answers for a JSONL file of prompts",
    "eval": "grade a model (and adapter) on rows with known answers",
    "distill": "have a teacher answer prompts, as training rows",
    "tune": "train a LoRA adapter, streamed through the ring",
}


def add_parsers(sub, full: bool = True) -> None:
    """The job verbs' subcommands, added to ``spill``'s subparsers. ``full=False`` (another
    verb runs) adds each by name and help only: reading the conf defaults imports YAML, which
    a finished ``spill build`` or ``spill status`` should not pay for."""
    if not full:
        for verb, text in HELP.items():
            sub.add_parser(verb, help=text, aliases=["train"] if verb == "tune" else [])
        return
    p = sub.add_parser("run", help=HELP["run"])
    p.add_argument("model", help="alias (smollm2:135m), hub id (org/name) or local model folder")
    p.add_argument("input", help='JSONL rows {"id", "prompt"} or {"id", "messages"}')
    p.add_argument("--out", required=True, help="results JSONL (written whole at the end)")
    p.add_argument(
        "--adapter", metavar="DIR", help="generate with this LoRA adapter (spill or PEFT layout)"
    )
    _generation_options(p)
    _state_option(p)
    _job_options(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("eval", help=HELP["eval"])
    p.add_argument("model", help="alias, hub id or local model folder")
    p.add_argument(
        "input", help='JSONL rows {"id", "prompt"|"messages", "answer"} ("completion" works too)'
    )
    p.add_argument("--adapter", metavar="DIR", help="a LoRA adapter folder (spill or PEFT layout)")
    p.add_argument("--out", help="per-row results JSONL (written whole at the end)")
    setting_flags(p, EvalSettings, "eval")
    log_option(p)
    p.add_argument(
        "--chat", action="store_true", help="wrap plain prompts in the chat template as a user turn"
    )
    _state_option(p)
    _job_options(p)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("distill", help=HELP["distill"])
    p.add_argument("teacher", help="alias, hub id or local model folder of the teacher")
    p.add_argument("input", help='JSONL rows {"id", "prompt"} or {"id", "messages"}')
    p.add_argument(
        "--out", required=True, help="training JSONL, prompt/completion or messages rows"
    )
    _generation_options(p)
    _state_option(p)
    _job_options(p)
    p.set_defaults(func=cmd_distill)

    p = sub.add_parser("tune", aliases=["train"], help=HELP["tune"])
    p.add_argument("model", help="alias, hub id or local model folder")
    p.add_argument("train", help='JSONL rows {"prompt","completion"}, {"messages"} or {"text"}')
    p.add_argument(
        "--name", required=True, help="the run's name (its state folder without --state)"
    )
    p.add_argument(
        "--state", metavar="URI", help="checkpoint location: a path, s3://, gs://, az://, memory://"
    )
    authority_options(p)
    _tune_options(p)
    p.add_argument("--seed", type=int, default=0, help="adapter init and data order")
    _job_options(p)
    p.set_defaults(func=cmd_tune)
