"""``spill predict``: a built project's tuned model on new inputs (``spill.project.predict``).

``spill predict [DIR] INPUT --out OUT`` is a row job (``--state``, exit 75, one writer);
``spill predict [DIR] --text "..."`` answers one input and prints it. The engine flags are
shorthand for the project's ``engine.*`` settings, as on ``spill build``.
"""

from __future__ import annotations

from pathlib import Path

from spill.cli.options import authority_options, engine_options, engine_overrides
from spill.errors import UsageError
from spill.store.location import Location, location

HELP = "label new inputs with a built project's tuned model"
DESCRIPTION = (
    "Apply a built project's prompt (prompt.template, prompt.chat), model and published tuned "
    "adapter (.spill/adapters/<name>/) to new rows: a CSV or JSONL file with the project's "
    "input column (data.input; an 'id' column is kept, else rows are numbered from 1). For a "
    "classification each row gets the label with the highest log-probability after its prompt, "
    "scored as `spill eval` scores an answer (the label's tokens summed), and `probability`: "
    "the softmax of the labels' total log-probs, over the project's labels only. --generate (or "
    "a free-text project) answers greedily instead (`text`). Output: one JSON line per row "
    "(schemas/predict-row.schema.json). What is used is what the last build recorded."
)


def _places(args) -> tuple[str, str | None]:
    """(project folder, input file) from the one or two positionals."""
    given = list(args.paths)
    if len(given) > 2:
        raise UsageError("give at most a project folder and one input file")
    if len(given) == 2:
        return given[0], given[1]
    if not given:
        return ".", None
    one = given[0]
    if args.text is not None or Path(one).is_dir():
        return one, None
    return ".", one


def _request(args):
    from spill.jobs.authority import Writer
    from spill.jobs.rows.job import RowOptions
    from spill.project.predict import Request

    if args.stop_after is not None and not args.state:
        raise UsageError("--stop-after keeps the rows done only with --state; give one")
    state = location(args.state) if args.state else None  # the command line's text, parsed once
    writer = Writer(state, args.lease, args.wait, tuple(getattr(args, "argv", ())))
    job = RowOptions(batch=args.batch, stop_after=args.stop_after, writer=writer)
    return Request(
        generate=args.generate,
        max_new_tokens=args.max_new_tokens,
        engine=tuple(engine_overrides(args)),
        job=job,
    )


def _build_state(args) -> Location | None:
    """``--build-state``, parsed here, once (after the usage checks, which come first)."""
    return location(args.build_state) if args.build_state else None


def cmd_predict(args) -> int:
    from spill.console import emit

    project, input_path = _places(args)
    req = _request(args)
    if args.text is not None:
        if input_path is not None or args.out or args.state:
            raise UsageError("--text answers one input: give no INPUT file, --out or --state")
        from spill.project.predict import predict_text

        got = predict_text(project, args.text, req, _build_state(args))
        if args.json:
            emit(got, True)
        elif "label" in got:
            print(f"{got['label']}  (probability {got['probability']:.4f})")
        else:
            print(got["text"])
        return 0
    if input_path is None:
        raise UsageError("give an INPUT file (CSV or JSONL) and --out, or --text")
    if not args.out:
        raise UsageError("--out is required with an INPUT file (where the answers go)")
    from spill.project.owned import refuse_output
    from spill.project.predict import predict_file

    build_state = _build_state(args)
    refuse_output(args.out, "--out", projects=(project,), states=(args.state, build_state))
    got = predict_file(project, Path(input_path), Path(args.out), req, build_state)
    if args.json:
        emit(got, True)
        return 0
    shown = dict(got)
    if "labels" in got:
        shown["labels"] = ", ".join(f"{k} {v}" for k, v in got["labels"].items() if v) or "-"
    columns = ["rows", "labels" if "labels" in got else "generated_tokens", "seconds"]
    columns += ["engine", "numerics"] + (["restored", "ran"] if args.state else [])
    emit(shown, False, columns)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "predict",
        usage="spill predict [DIR] INPUT.csv|INPUT.jsonl --out OUT.jsonl [options]\n"
        '       spill predict [DIR] --text "..." [options]',
        help=HELP,
        description=DESCRIPTION,
        epilog="With --state, SIGTERM/SIGINT commits the rows done and exits 75; the same "
        "command continues.",
    )
    p.add_argument("paths", nargs="*", metavar="[DIR] INPUT", help="project folder (.), input")
    p.add_argument("--out", metavar="OUT", help="answers JSONL, one line per row (written whole)")
    p.add_argument("--text", metavar="TEXT", help="answer this one input and print it")
    p.add_argument(
        "--generate", action="store_true", help="free text (greedy) instead of choosing a label"
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        metavar="N",
        help="longest generated answer (default: eval.max_new_tokens, else teacher's)",
    )
    p.add_argument(
        "--batch",
        type=int,
        metavar="N",
        help="rows computed together (speed; label scores are the same bits at any batch)",
    )
    p.add_argument(
        "--state",
        metavar="URI",
        help="commit answered rows here and continue from them; SIGTERM then exits 75",
    )
    p.add_argument(
        "--stop-after", type=int, metavar="N", help="stop after N rows, committed (with --state)"
    )
    p.add_argument(
        "--build-state", metavar="URI", help="the project's build state (default DIR/.spill/)"
    )
    p.add_argument("--json", action="store_true", help="print the summary (or answer) as JSON")
    engine_options(p, shorthand=True)
    authority_options(p)
    p.set_defaults(func=cmd_predict)
