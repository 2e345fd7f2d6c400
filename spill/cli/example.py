"""``spill example relay [DIR]`` and the two commands its ``relay.sh`` calls (``relay-leg``,
``relay-check``) on the command line: one call of ``spill.examples.relay`` or
``spill.examples.relay_check`` each, and the line or table it prints."""

from __future__ import annotations

import json
from pathlib import Path

from spill.examples.relay import PROJECTS, write


def cmd_relay(args) -> int:
    out = write(Path(args.dir), args.project, args.force)
    print(
        f"wrote {out['folder']}: relay.sh builds {out['project']} on {out['from']}, stops after "
        f"tune step {out['stop']}, moves it and finishes on {out['to']}; run {out['folder']}/relay.sh"
    )
    return 0


def cmd_leg(args) -> int:
    from spill.examples.relay_check import record_leg

    got = record_leg(Path(args.legs), args.name, args.engine)
    print(f"leg {args.name}: {got['engine']} on {got['machine']} ({got['os']})")
    return 0


def cmd_check(args) -> int:
    from spill.console import table
    from spill.examples.relay_check import check_files, passed

    rows = check_files(args.reference, args.relay, args.legs, args.noise_floor, args.stop)
    ok = passed(rows)
    if args.json:
        print(json.dumps({"passed": ok, "checks": rows}, indent=2))
    else:
        print(table(rows))
        failed = sum(r["ok"] != "ok" for r in rows)
        print("relay passed every check" if ok else f"relay FAILED {failed} of {len(rows)} checks")
    return 0 if ok else 1


def add_parser(sub) -> None:
    p = sub.add_parser("example", help="write a runnable example folder (the relay)")
    ex = p.add_subparsers(dest="example", metavar="EXAMPLE", required=True)
    p = ex.add_parser(
        "relay",
        help="a build stopped inside tune, moved to a second place, finished there and checked",
    )
    p.add_argument("dir", nargs="?", default="relay", help="the folder to write (./relay)")
    p.add_argument("--project", choices=PROJECTS, default="tickets", help="the example project")
    p.add_argument("--force", action="store_true", help="rewrite a folder that is not empty")
    p.set_defaults(func=cmd_relay)
    p = ex.add_parser("relay-leg", help="record this machine as a leg of a relay (relay.sh)")
    p.add_argument("name", choices=("a", "b"))
    p.add_argument("--engine", choices=("torch", "mlx"), required=True)
    p.add_argument("--legs", required=True, help="the legs file to add to")
    p.set_defaults(func=cmd_leg)
    p = ex.add_parser("relay-check", help="check a relayed build against its reference")
    p.add_argument("--reference", required=True, help="the reference's `spill status --json`")
    p.add_argument("--relay", required=True, help="the relayed project's folder or URI")
    p.add_argument("--legs", required=True, help="what ran each leg (relay-leg's file)")
    p.add_argument("--noise-floor", required=True, help="the measured tolerances")
    p.add_argument("--stop", type=int, required=True, help="the tune step leg a stopped at")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.set_defaults(func=cmd_check)
