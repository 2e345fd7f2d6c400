"""The command line, the top floor: turn arguments into one call of a verb's module, print what
it returns, and turn errors into exit codes. Nothing below imports it.

One module per verb group parses and prints (``jobs``: run, eval, distill, tune; ``project``:
init, build, resume, status; ``report``, ``predict``, ``chat``, ``serve``, ``move``, ``bundle``, ``models``, ``export``, ``example``; ``resume`` replays
a state location's recorded command); what several share is in ``options``. Imports here stay
light (argparse and spill's engine-free modules); each verb imports its own module when it runs,
so ``spill --help`` never imports torch or mlx.
"""

from __future__ import annotations

import argparse
import os
import sys

from spill import __version__
from spill.cli import (
    bundle,
    chat,
    example,
    export,
    jobs,
    models,
    move,
    predict,
    project,
    report,
    serve,
)
from spill.cli.options import JOB_VERBS, Replay
from spill.errors import EXIT_USAGE, SpillError


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; given the verb that runs, the job verbs' options (whose defaults come
    from the conf files) are only added when it is one of them."""
    parser = argparse.ArgumentParser(
        prog="spill",
        description="Fine-tune, run, distill and evaluate causal LMs with weights streamed layer by layer from disk.",
    )
    parser.add_argument("--version", action="version", version=f"spill {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    jobs.add_parsers(sub, full=verb is None or verb in JOB_VERBS)  # run, eval, distill, tune
    project.add_parsers(sub)  # init, build, resume, status
    report.add_parser(sub)
    predict.add_parser(sub)
    chat.add_parser(sub, full=verb in (None, "chat"))
    serve.add_parser(sub, full=verb in (None, "serve"))
    move.add_parser(sub)
    bundle.add_parser(sub)
    models.add_parser(sub)
    export.add_parser(sub)
    example.add_parser(sub)
    return parser


def _verb(argv: list[str]) -> str | None:
    """The verb a command line names (its first word that is no option), or None."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_verb(argv))
    args, extra = parser.parse_known_args(argv)
    if extra and not hasattr(args, "overrides"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if hasattr(args, "overrides"):
        args.overrides = extra
    args.argv = argv  # what a run records, so that `spill resume <state>` can continue it
    try:
        code = args.func(args)
    except SpillError as e:
        if not e.said:  # a preempted job already said so, in one line
            print(f"spill: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("spill: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return EXIT_USAGE
    if isinstance(code, Replay):  # a verb handed back the command to run in its place
        os.chdir(code.cwd)
        return main(code.argv)
    return code


def entry() -> None:
    """The console script: ``main()``, then a fast exit.

    Everything spill writes is flushed and fsynced before ``main`` returns, so the interpreter's
    teardown (torch's alone takes ~0.5 s) is skipped, unless worker processes (a joblib sweep)
    still need the normal exit to be shut down.
    """
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    if "torch" in sys.modules or "mlx.core" in sys.modules:
        import psutil

        from spill.payloads.checkpoint import settle

        settle()  # a save's removal of older checkpoints, still on its own thread
        if not psutil.Process().children():
            os._exit(code)
    raise SystemExit(code)
