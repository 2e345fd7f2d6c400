"""The project verbs on the command line: ``init``, ``build``, ``status``, ``resume``.

Each command turns its arguments into one call of ``spill.project.init``, ``build``, ``sweep`` or
``status`` and prints the summary; ``resume`` and ``status`` given a state location instead of
a project go to ``spill.cli.resume`` and ``spill.project.report.status.run_summary``. Everything heavy
is imported inside the commands, so ``spill --help`` stays light. Arguments argparse does not
know are Hydra overrides (``tune.lr=3e-4``; with ``-m`` a sweep).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from spill.cli.options import Replay, authority_options, engine_options, engine_overrides
from spill.errors import SpillError, UsageError
from spill.store.location import location


def _overrides(args) -> list[str]:
    """Hydra overrides: what argparse left over; a first "DIR" that is really ``k=v`` is one."""
    extra = list(args.overrides)
    if Path(args.dir).name == "spill.yaml" and Path(args.dir).is_file():
        args.dir = str(Path(args.dir).parent)  # the project's file named instead of its folder
    if "=" in args.dir and not Path(args.dir).is_dir():
        extra.insert(0, args.dir)
        args.dir = "."
    bad = [a for a in extra if a.startswith("-")]
    if bad:
        raise UsageError(f"unknown option {bad[0]}; `spill {args.command} --help` lists them")
    return extra + engine_overrides(args) + _procs(args)


def _run_options(p) -> None:
    """What build and resume both take: the engine group (shorthands too), --procs, authority."""
    engine_options(p, shorthand=True)
    p.add_argument(
        "--procs",
        type=int,
        metavar="N",
        help="run each job as N processes (engine.procs; torch's elastic launcher, docs/procs.md)",
    )
    authority_options(p)


def _procs(args) -> list[str]:
    """``--procs N`` as the ``engine.procs`` override it stands for."""
    if getattr(args, "procs", None) is None:
        return []
    if args.procs < 1:
        raise UsageError("--procs must be at least 1")
    return [f"engine.procs={args.procs}"]


def _relaunched(args, run) -> int:
    """``run()``; a build that asks for more processes than it has is started again as that
    many by torch's elastic launcher (the same command line; each rank reads the same config)."""
    from spill.project.build.follow import Relaunch

    try:
        return run()
    except Relaunch as wanted:
        from spill.jobs.launch import launch

        return launch(wanted.args[0], args.argv)


def _emit_build(summary: dict, as_json: bool, args=None) -> None:
    """The table (or JSON); after a build or resume that has an adapter, where it is and the
    command that predicts with it (``args``: the command's, for its DIR and --state)."""
    from spill.console import speaking
    from spill.project.report.status import adapter, exports, render, with_losses
    from spill.project.report.status import as_json as to_json

    if not speaking():  # a rank other than 0: rank 0 prints the build
        return
    if args is not None:  # a build's summary: its loss series, read from its state now
        try:
            summary = with_losses(summary)
        except (SpillError, OSError):  # the table matters more than its sparkline
            pass
    if as_json:
        print(json.dumps(to_json(summary), indent=2, sort_keys=True))
        return
    print(render(summary))
    where = adapter(summary) if args is not None else None
    if where:
        project = "" if args.dir == "." else f"{args.dir} "
        state = f" --build-state {args.state}" if args.state else ""
        print(f"adapter: {where}/ (spill, PEFT and MLX-LM layouts)")
        print(f'predict: spill predict {project}INPUT.csv --out OUT.jsonl{state}, or --text "..."')
    if args is not None and (made := exports(summary)):
        formats = ", ".join(sorted(summary["doc"]["stages"]["export"]["result"]["formats"]))
        print(f"exports: {made}/ ({formats}; docs/export.md)")
    if args is not None and not summary.get("dry_run"):
        print(f"report: {_report_command(args)}")


def _report_command(args) -> str:
    """The ``spill report`` command that makes this build's page (``spill.cli.report``)."""
    project = "" if args.dir == "." else f" {args.dir}"
    return f"spill report{project}" + (f" --state {args.state}" if args.state else "")


def cmd_init(args) -> int:
    from spill.console import note
    from spill.project.init import init

    if (args.output is None) == (args.chosen is None):
        raise UsageError("give the answer column once: --output COL (or --chosen COL for pairs)")
    if args.chosen is not None and args.rejected is None:
        raise UsageError("--chosen names a pair's better answer; give --rejected COL too")
    done = init(
        Path(args.data),
        args.input,
        args.output or args.chosen,
        Path(args.project),
        seed=args.seed,
        model=args.model,
        teacher=args.teacher,
        rejected_col=args.rejected,
    )
    kind = (
        f"classification, {done['labels']} labels"
        if done["task"] == "classification"
        else "free-text generation"
    )
    note(
        f"wrote {done['project']}/spill.yaml: {done['rows']} rows ({done['train']} to train on, "
        f"{done['test']} to grade), {kind}; student {done['model']}, teacher "
        f"{done['teacher'] or 'none'}"
        + ("; preference pairs, tuned by DPO" if done["method"] == "dpo" else "")
    )
    print(f"spill build {done['project']}")
    return 0


def _preemptible(run) -> int:
    """A build stopped by Ctrl-C, SIGTERM or a stop request exits 75 with one ``preempted`` line
    (``spill.jobs.preempt``: planning, composing and sweeping stop at once, jobs at a boundary)."""
    from spill.jobs.preempt import stops_at_once

    with stops_at_once():
        return run()


def cmd_build(args) -> int:
    return _relaunched(args, lambda: _preemptible(lambda: _build(args)))


def _at_uri(args) -> None:
    """``DIR`` and ``--state`` parsed, here, once: a project at a URI (``spill move`` put it
    there) is read from a local working copy, with its state at ``<URI>/.spill``; file:///p is
    the folder /p (``spill.project.remote.locate``)."""
    from spill.project.remote import locate

    given = location(args.dir)
    state = location(args.state) if args.state else None
    args.dir, args.state = locate(given, state, build=args.command == "build")


def _writer(args):
    from spill.jobs.authority import Writer

    return Writer(args.state, args.lease, args.wait, tuple(getattr(args, "argv", ())))


def _build(args) -> int:
    from spill.project.build.build import BuildOptions, build

    _at_uri(args)
    opts = BuildOptions(
        writer=_writer(args),
        stop_after=args.stop_after,
        dry_run=args.dry_run,
        overrides=tuple(_overrides(args)),
        new_run=args.new_run,
    )
    if args.multirun:
        if args.procs is not None:
            raise UsageError("--procs with -m: a sweep runs its builds as one process each")
        from spill.project.sweep import exit_code, render, sweep

        result = sweep(args.dir, opts)
        print(json.dumps(result, indent=2, sort_keys=True) if args.json else render(result))
        if not args.json and not args.dry_run:
            print(f"report: {_report_command(args)} (every job of the sweep, overlaid)")
        return exit_code(result)
    _emit_build(build(args.dir, opts), args.json, args)
    return 0


def cmd_resume(args) -> int | Replay:
    from spill.cli.resume import replay
    from spill.project.build.build import BuildOptions, build
    from spill.project.report.status import is_state

    _at_uri(args)
    if args.state is None and not args.overrides and is_state(args.dir):
        return replay(args.dir, args, _project_dir)
    if args.overrides:
        if args.overrides[0].startswith("-"):
            raise UsageError(
                f"unknown option {args.overrides[0]}; `spill resume --help` lists them"
            )
        raise UsageError(
            "resume continues the recorded build as it was; use `spill build` to change values"
        )
    opts = BuildOptions(
        writer=_writer(args),
        stop_after=args.stop_after,
        dry_run=args.dry_run,
        resume=True,
        engine=tuple(engine_overrides(args) + _procs(args)),
    )
    return _relaunched(
        args, lambda: _preemptible(lambda: _emit_build(build(args.dir, opts), args.json, args) or 0)
    )


def cmd_status(args) -> int:
    from spill.project.report.status import is_state, status

    _at_uri(args)
    if args.state is None and is_state(args.dir):  # a job's (or a build's) state location
        from spill.console import emit
        from spill.project.report.status import run_summary

        view = run_summary(args.dir)
        keys = ("state", "id", "status", "generation", "owner", "progress")
        keys += ("move",) if view.get("move") else ()
        emit(view, args.json, None if args.json else keys)
        for line in [] if args.json else view["notes"]:
            print(f"note: {line}")
        return 0

    summary = status(args.dir, args.state)
    if "runs" in summary:  # a sweep's folder: its runs, as the sweep printed them
        from spill.project.report.series import lines
        from spill.project.sweep import render

        print(json.dumps(summary, indent=2, sort_keys=True) if args.json else render(summary))
        for run, found in {} if args.json else summary["losses"].items():
            print("\n".join([f"{run}:", *(f"  {x}" for x in lines(found))]))
        return 0
    _emit_build(summary, args.json)
    return 0


def _project_dir(argv: list[str]) -> str:
    """The project folder (DIR) a recorded ``spill build`` or ``spill resume`` names."""
    parser = argparse.ArgumentParser(prog="spill")
    add_parsers(parser.add_subparsers(dest="command"))
    return parser.parse_known_args(argv)[0].dir


def add_parsers(sub) -> None:
    """Add init, build, resume and status to the ``spill`` subcommands."""
    p = sub.add_parser("init", help="make a project folder from a CSV or JSONL data file")
    p.add_argument("data", help="CSV (with a header row) or JSONL file")
    p.add_argument("--input", required=True, metavar="COL", help="the column the model reads")
    p.add_argument("--output", metavar="COL", help="the column it answers with")
    p.add_argument("--chosen", metavar="COL", help="a preference pair's better answer (--output)")
    p.add_argument(
        "--rejected", metavar="COL", help="a pair's worse answer: the project tunes with DPO"
    )
    p.add_argument("--project", required=True, metavar="DIR", help="the new project folder")
    p.add_argument("--seed", type=int, default=0, help="split, init and data-order seed")
    p.add_argument("--model", metavar="M", help="the student (default: chosen for this machine)")
    p.add_argument("--teacher", metavar="M", help="a teacher that answers the training inputs")
    p.set_defaults(func=cmd_init)

    def project_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("dir", nargs="?", default=".", metavar="DIR", help="project folder (.)")
        p.add_argument("--state", metavar="URI", help="build state location (default DIR/.spill/)")
        p.add_argument("--json", action="store_true", help="print the result as JSON")

    p = sub.add_parser(
        "build",
        usage="spill build [DIR] [options] [-m] [OVERRIDE ...]",
        help="grade, distill, tune and grade a project; skip what is done",
        description="Plan the stages eval:base, distill, tune (train), eval and export against "
        "the recorded state, then run what is needed. Trailing KEY=VALUE arguments are Hydra "
        "overrides (tune.lr=3e-4); with -m they sweep (tune.lr=1e-4,3e-4).",
        epilog="Ctrl-C or SIGTERM stops like a preemption: state committed, exit 75.",
    )
    project_args(p)
    p.add_argument(
        "--stop-after",
        metavar="STAGE[:N]",
        help="stop after a stage, or N steps (tune) / rows / formats (export) into it; exit 0",
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan and why, run nothing")
    p.add_argument(
        "-m", "--multirun", action="store_true", help="a Hydra sweep: one build per combination"
    )
    p.add_argument(
        "--new-run",
        action="store_true",
        help="fork a new run from an installed copy's state (lineage: the copied run)",
    )
    _run_options(p)
    p.set_defaults(func=cmd_build, overrides=[])

    p = sub.add_parser(
        "resume",
        help="continue a stopped build (or any run, given its state location)",
        description="Continue the recorded build as it was. The engine options may change: "
        "they decide where the stages compute, not what they mean. Given a state location "
        "(a folder or URI holding runs/) instead of a project, continue the run it holds: the "
        "command that owned it is run again there, and the last committed step or rows are "
        "printed first.",
    )
    project_args(p)
    p.add_argument("--stop-after", metavar="STAGE[:N]", help="stop again after this point")
    p.add_argument("--dry-run", action="store_true", help="print the plan and why, run nothing")
    _run_options(p)
    p.set_defaults(func=cmd_resume, overrides=[])

    p = sub.add_parser(
        "status",
        help="a project's build table, read from its state (or a state location's run)",
        description="The build table of a project folder; given a state location (a folder or "
        "URI holding runs/) instead, its current run: owner, generation, lease, progress.",
    )
    project_args(p)
    p.set_defaults(func=cmd_status)
