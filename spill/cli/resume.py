"""``spill resume <state>``: continue whatever run a state location holds, from the location alone.

``spill resume DIR`` with a project folder continues its build (``spill.project.build.build``). Given a
state location instead (a folder or a URI holding ``runs/``), this module reads the run's control
object and ``command.json`` (the command line that last owned the run, recorded at acquisition
by ``spill.jobs.authority``), prints the last committed step or row count
(``spill.project.report.status.progress``), and runs that command again through ``spill.cli.main`` in
the folder it was typed in, with ``--state`` set to the location given, its own
``--stop-after`` dropped (a resume continues), and the resume's ``--stop-after``, ``--wait``,
``--lease`` and engine options applied. The command itself acquires the run (exit 75 naming the
owner while another process holds it), restores from the pointed payloads and continues.
"""

from __future__ import annotations

import os

from spill.cli.options import JOB_VERBS, engine_argv
from spill.console import note
from spill.errors import StoreError
from spill.store.fs import absolute

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


def resume_state(where: str, args) -> int:
    """Continue the run at state location ``where``; see the module doc."""
    from spill.cli import build_parser, main  # the floor's own entry: a replay is a command line
    from spill.control.keys import current
    from spill.jobs.authority import read_command
    from spill.project.report.status import progress

    where = absolute(where)  # file:///p is the path /p
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
        recorded, _ = build_parser(cmd["verb"]).parse_known_args(cmd["argv"])
        project = os.path.join(cmd["cwd"], recorded.dir)
        argv = ["resume", project, "--state", where]
    argv += engine_argv(args)
    argv += ["--json"] if args.json else []
    os.chdir(cmd["cwd"])  # the recorded arguments are relative to it
    return main([*argv, *_extra(args)])
