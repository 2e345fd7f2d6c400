"""``spill resume <state>``: continue whatever run a state location holds, from the location alone.
Given a state location (a folder or a URI holding ``runs/``), ``replay`` reads the run's control
object and ``command.json`` (the command line that last owned the run), prints the last committed
step or row count, and hands back that command for ``spill.cli.main`` to run in the folder it was
typed in: ``--state`` set to the location given, its own ``--stop-after`` dropped (a resume
continues), the resume's ``--stop-after``, ``--wait``, ``--lease`` and engine options applied. The
command itself acquires the run (exit 75 while another process holds it), restores from the pointed
payloads and continues.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from spill.cli.options import JOB_VERBS, Replay, engine_argv
from spill.console import note
from spill.control.keys import current
from spill.errors import StoreError
from spill.jobs.authority import read_command
from spill.project.report.status import progress
from spill.store.location import Location

BUILD_VERBS = ("build", "resume")


def _drop(argv: list[str], flag: str) -> list[str]:
    """``argv`` without ``flag`` and its value (``--flag V`` or ``--flag=V``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(f"{flag}="):
            out.append(a)
    return out


def _extra(args) -> list[str]:
    """The resume's own options, as flags of the recorded command."""
    out = []
    if args.stop_after:
        out += ["--stop-after", args.stop_after]
    if args.wait:
        out.append("--wait")
    if args.lease is not None:
        out += ["--lease", str(args.lease)]
    return out


def replay(where: Location, args, project_dir: Callable[[list[str]], str]) -> Replay:
    """The command that continues the run at state location ``where`` (``spill resume``'s DIR,
    as the command line parsed it); see the module doc. ``project_dir(argv)``: the project
    folder a recorded build or resume names."""
    where = where.absolute  # file:///p is the path /p
    doc = current(where)
    if doc is None:
        raise StoreError(f"nothing to resume at {where}: it holds no run")
    cmd = read_command(where)
    if cmd is None or cmd["verb"] not in (*JOB_VERBS, *BUILD_VERBS):
        raise StoreError(
            f"{where} does not record the command that owns its run; run that command again "
            f"with --state {where}"
        )
    note(
        f"resuming run {doc['run']} ({doc['status']}, generation {doc['generation']}) at "
        f"{where}: {progress(where, doc)}"
    )
    if not os.path.isdir(cmd["cwd"]):
        raise StoreError(
            f"{where} was run from {cmd['cwd']}, which is not on this machine; run "
            f"`{' '.join(cmd['argv'])}` again with --state {where} from a copy of its inputs"
        )
    argv = [*_drop(_drop(list(cmd["argv"]), "--stop-after"), "--state"), "--state", where]
    if cmd["verb"] in BUILD_VERBS:
        argv = ["resume", os.path.join(cmd["cwd"], project_dir(cmd["argv"])), "--state", where]
    argv += engine_argv(args)
    argv += ["--json"] if args.json else []
    return Replay(cmd["cwd"], [*argv, *_extra(args)])  # the recorded arguments are relative to it
