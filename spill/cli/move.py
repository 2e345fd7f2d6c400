"""``spill move [DIR] URI`` and ``spill move --abort [DIR]`` on the command line: which places
the words name, then one call of ``spill.project.move.move`` (``move`` or ``abort``)."""

from __future__ import annotations

import argparse

from spill.cli.options import authority_options
from spill.errors import UsageError
from spill.store.location import location


def add_parser(sub) -> None:
    p = sub.add_parser(
        "move",
        usage="spill move [DIR] URI [--state URI] [--with-exports] [--wait] [--lease SECONDS] "
        "[--json]\n"
        "       spill move --abort [DIR]",
        help="move a project's run (its state and files) to another folder or URI",
        description="Quiesce the run's writer at its next committed boundary, take the run, "
        "copy a consistent snapshot with a checksummed manifest, verify it, and hand the run "
        "over: afterwards `spill build URI` (or `spill resume URI`) continues there, and the "
        "source says where it went. Rerun the same command after any interruption; "
        "`--abort` calls off a move that has not handed the run over yet.",
    )
    p.add_argument("where", nargs="*", metavar="[DIR] URI", help="the project (.) and where to")
    p.add_argument("--state", metavar="URI", help="the source's state (default DIR/.spill/)")
    p.add_argument(
        "--abort",
        action="store_true",
        help="call off the move of DIR's run: the run returns to what it was before the move "
        "(a new generation), and its partial copy at the destination is removed",
    )
    p.add_argument(
        "--with-exports",
        action="store_true",
        help="also copy the merged models of the export stage (exports/); without it they stay "
        "where they were made and a build at the destination writes them again",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    authority_options(p)
    p.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    from spill.console import emit
    from spill.project.move.move import abort, move

    # the places are parsed here, once (the destination first, as the move checks it first)
    if args.abort:
        if len(args.where) > 2:
            raise UsageError("spill move --abort takes the project folder; see --help")
        to = location(args.where[1]) if len(args.where) == 2 else None
        src = location(args.where[0] if args.where else ".")
        state = location(args.state) if args.state else None
        result = abort(src, to, state=state, wait=args.wait)
        keys = ("run", "from", "to", "status", "generation", "destination")
    else:
        if not 1 <= len(args.where) <= 2:
            raise UsageError("spill move takes a project folder and a destination; see --help")
        src, to = (".", args.where[0]) if len(args.where) == 1 else args.where
        to, src = location(to), location(src)
        state = location(args.state) if args.state else None
        result = move(
            src, to, state=state, wait=args.wait, lease=args.lease,
            with_exports=args.with_exports,
        )  # fmt: skip
        keys = ("run", "from", "to", "files", "bytes", "seconds", "status")
    emit(result, args.json, None if args.json else keys)
    return 0
