"""``spill bundle`` on the command line: which of its three modes the words name (write, verify,
install), one call of ``spill.project.bundle.bundle``, and its one-row table (or ``--json``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from spill.errors import UsageError
from spill.store.location import location


def add_parser(sub) -> None:
    """Add ``bundle`` to the ``spill`` subcommands."""
    p = sub.add_parser(
        "bundle",
        usage="spill bundle DIR PATH [--with-state [--with-exports] [--state URI] [--wait]] "
        "[--force] [--json]\n"
        "       spill bundle --verify PATH [--json]\n"
        "       spill bundle --install PATH DIR [--force] [--json]",
        help="pack a project and its model files into one file; verify or install one offline",
        description="Pack a project (its files, the model files its stages load, and with "
        "--with-state its run) into one file with a checksummed manifest; check one; install "
        "one on a machine without network.",
    )
    p.add_argument("args", nargs="*", metavar="DIR PATH")
    p.add_argument("--verify", metavar="PATH", help="check a bundle's manifest and checksums")
    p.add_argument("--install", nargs=2, metavar=("PATH", "DIR"), help="install a bundle")
    p.add_argument("--with-state", action="store_true", help="also carry the run state")
    p.add_argument(
        "--with-exports",
        action="store_true",
        help="with --with-state: also carry the export stage's merged models (exports/)",
    )
    p.add_argument("--state", metavar="URI", help="the state location (default DIR/.spill/)")
    p.add_argument(
        "--wait", action="store_true", help="with --with-state: wait for a live owner to finish"
    )
    p.add_argument(
        "--force", action="store_true", help="replace an existing PATH, or a non-empty DIR"
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    from spill.console import emit, note
    from spill.project.bundle import bundle
    from spill.store.fs import absolute

    modes = sum(bool(x) for x in (args.args, args.verify, args.install))
    if modes != 1 or args.args and len(args.args) != 2:
        raise UsageError(
            "give DIR PATH (write a bundle), --verify PATH or --install PATH DIR; see --help"
        )
    if (args.verify or args.install) and (
        args.with_state or args.state or args.wait or args.with_exports
    ):
        raise UsageError(
            "--with-state, --with-exports, --state and --wait go with writing a bundle (DIR PATH)"
        )
    if args.with_exports and not args.with_state:
        raise UsageError("--with-exports carries the exports of the run state: add --with-state")
    if args.verify:
        path = Path(absolute(args.verify))
        result = bundle.verify(path)
        for line in result["problems"]:
            note(f"spill: error: {path}: {line}")
        if not args.json:
            del result["problems"]
        emit(result, args.json)
        return 1 if result["bad"] else 0
    if args.install:
        path, dest = (Path(absolute(w)) for w in args.install)
        result = bundle.install(path, dest, args.force)
        if not args.json:
            result["models"] = ", ".join(result["models"]) or "-"
            result["models_own"] = ", ".join(result["models_own"]) or "-"
            result["run"] = result["run"] or "-"
        emit(result, args.json)
        return 0
    # the project and its state are parsed here, once
    where, path = location(args.args[0]), Path(args.args[1])
    state = location(args.state) if args.state else None
    result = bundle.pack(
        where, path, state=state, with_state=args.with_state, wait=args.wait,
        force=args.force, with_exports=args.with_exports,
    )  # fmt: skip
    emit(result, args.json)
    return 0
