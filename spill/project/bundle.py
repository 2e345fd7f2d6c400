"""``spill bundle``: one file holding a project, its model files and optionally its run state.

(Being written: see the bundle issue.)
"""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    """Add ``bundle`` to the ``spill`` subcommands."""
    p = sub.add_parser(
        "bundle",
        usage="spill bundle DIR PATH | --verify PATH | --install PATH DIR",
        help="pack a project and its model files into one file; verify or install one offline",
    )
    p.add_argument("args", nargs="*", metavar="DIR PATH")
    p.add_argument("--verify", metavar="PATH", help="check a bundle's manifest and checksums")
    p.add_argument("--install", nargs=2, metavar=("PATH", "DIR"), help="install a bundle")
    p.add_argument("--with-state", action="store_true", help="also carry the run state")
    p.add_argument("--state", metavar="URI", help="the state location (default DIR/.spill/)")
    p.add_argument("--force", action="store_true", help="install into a non-empty DIR")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    raise NotImplementedError
