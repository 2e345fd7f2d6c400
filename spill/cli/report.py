"""``spill report [DIR] [--state URI] [-o FILE] [--json]`` on the command line: one call of
``spill.project.report.report.write``, then the path it wrote (or, with ``--json``, what it shows).

The page lands in the project folder (``DIR/report.html``) unless ``-o`` says otherwise; for a
project at a URI, or a state location named instead of a project, in the current folder. A
state location that is a project's ``.spill/`` is read with that project (for its notes).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from spill.store.location import location


def add_parser(sub) -> None:
    p = sub.add_parser(
        "report",
        help="write one HTML page: stages, losses, scores, where each step and row ran, models",
        description="Write a self-contained HTML page (inline SVG, no scripts, nothing "
        "fetched) about a project's build and its sweep jobs: the stage table, the train and "
        "validation loss of every run overlaid, each score against each swept parameter, which "
        "engine, machine and OS computed which steps and rows, and the models with their "
        "fingerprints. It reads the state only, like `spill status`.",
    )
    p.add_argument("dir", nargs="?", default=".", metavar="DIR", help="project folder (.)")
    p.add_argument("--state", metavar="URI", help="build state location (default DIR/.spill/)")
    p.add_argument(
        "-o", "--out", metavar="FILE", help="where to write the page (default DIR/report.html)"
    )
    p.add_argument("--json", action="store_true", help="print what the page shows as JSON")
    p.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    from spill.project.owned import refuse_output
    from spill.project.remote import locate
    from spill.project.report.report import FILE, target, write
    from spill.project.report.status import is_state

    given = location(args.dir)  # the project (or state) and --state are parsed here, once
    state = location(args.state) if args.state else None
    args.dir, args.state = locate(given, state, build=False)
    out = args.out
    # a state location (not a project at a URI, checked out to args.dir): its build, read as is
    if args.state is None and args.dir == given.plain and is_state(given.plain):
        state = Path(args.dir)  # its project, when it is one's .spill/ (else none is checked)
        home = state.parent if (state.parent / "spill.yaml").is_file() else state
        args.dir, args.state = str(home), given.plain
        out = out or FILE
    elif given.uri and out is None:  # a project at a URI: its copy here is spill's own
        out = FILE
    out = target(Path(args.dir), out)
    refuse_output(out, "-o", projects=(args.dir,), states=(args.state,))
    result = write(Path(args.dir), args.state, out)
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        print(result["path"])
    return 0
