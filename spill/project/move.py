"""``spill move``: hand a project's run to another state location.

(Being written.)
"""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("move", help="move a project's run (state and files) to another place")
    p.add_argument("where", nargs="+", metavar="[DIR] URI")
    p.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    raise NotImplementedError
