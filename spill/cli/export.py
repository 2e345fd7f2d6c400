"""``spill export ADAPTER OUT --format hf|gguf|mlx`` on the command line: one call of
``spill.jobs.export.export``, then the files it wrote as a table (or export.json as JSON). A built
project (its folder or its build state) names the adapter its tune stage published."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from spill.errors import SpillError, UsageError
from spill.ground.sizes import parse_size
from spill.settings import EXPORT_DTYPES, EXPORT_FORMATS, EXPORT_QUANTIZE
from spill.store.location import location, on_disk


def _either(kinds: tuple[str, ...]) -> str:
    return ", ".join(kinds[:-1]) + " or " + kinds[-1]


def add_parser(sub) -> None:
    gguf, mlx = (tuple(map(str, EXPORT_QUANTIZE[f])) for f in ("gguf", "mlx"))
    p = sub.add_parser(
        "export",
        help="merge a tuned adapter into its base and write a model to deploy (hf, gguf, mlx)",
        description="Merge a finished tune's LoRA adapter into the base weights it was trained "
        "on (float32 merge, then the output dtype) and write the model folder: hf "
        "(transformers, vLLM), gguf (llama.cpp, Ollama) or mlx (mlx-lm), with the base's "
        "tokenizer and chat template and an export.json recording every file's sha256.",
    )
    p.add_argument(
        "adapter",
        help="a finished tune's adapter folder or its state folder, or a built project "
        "(its folder or its .spill/): the adapter its tune stage published",
    )
    p.add_argument("out", help="the folder to write (new, or empty)")
    p.add_argument(
        "--format", choices=EXPORT_FORMATS, default="hf", help="what to write (default hf)"
    )
    p.add_argument(
        "--dtype",
        choices=EXPORT_DTYPES,
        help="the output's float dtype (default: the base's, else bf16)",
    )
    p.add_argument(
        "--quantize",
        choices=sorted({*gguf, *mlx}),
        help=f"gguf: {_either(gguf)} for the matrices (norms stay F32); mlx: {_either(mlx)} bits",
    )
    p.add_argument(
        "--model",
        help="the base model (default: the one the adapter records); its "
        "fingerprint must still be the adapter's",
    )
    p.add_argument("--weights", metavar="URI", help="stage the base's folder from this URI")
    p.add_argument(
        "--shard-size",
        default="2G",
        help="hf, mlx: the largest safetensors shard (default 2G; e.g. 500M)",
    )
    p.add_argument("--json", action="store_true", help="print export.json instead of the table")
    p.set_defaults(func=command)


def built_adapter(given: str) -> Path:
    """``given``, or where a build's state (or its project folder) published its tuned adapter:
    a finished build exports like its adapter; an unfinished one says how to finish it."""
    from spill.ground.paths import STATE_DIR
    from spill.project.build import record
    from spill.project.build.stages import TUNE

    if (here := on_disk(given)) is None:
        raise SpillError(f"{given}: spill export reads a local adapter folder; copy it here first")
    path = Path(here)
    where = path / STATE_DIR if (path / "spill.yaml").is_file() else path
    if not (where / "runs").is_dir():
        return path  # an adapter folder or a tune's state: spill.jobs.export reads it
    state = location(where)  # a build's state, parsed here for the build's readers
    doc = record.read(state)
    if doc is None:
        return path
    rec = (doc.get("stages") or {}).get(TUNE.name) or {}
    name = doc["project"]["name"]
    if rec.get("status") != "done":
        progress = f"step {rec['progress']} of {rec['total']}" if "total" in rec else "not run"
        raise SpillError(
            f"{given}: this build's tune stage is not done ({progress}); `spill resume {given}` "
            "finishes it, then export again"
        )
    if problem := TUNE.problem(state, name, rec.get("outputs")):
        raise SpillError(
            f"{given}: the build's tuned adapter: {problem}; `spill resume {given}` restores it, "
            "then export again"
        )
    return where / TUNE.output(name)


def command(args: argparse.Namespace) -> int:
    from spill.console import note, table
    from spill.jobs.export import export
    from spill.project.owned import refuse_output

    try:
        shard_bytes = parse_size(args.shard_size)
    except ValueError as e:
        raise UsageError(f"--shard-size: {e}") from None
    options = {"shard_bytes": shard_bytes} if args.format in ("hf", "mlx") else {}
    refuse_output(args.out, "OUT", folder=True)
    record = export(
        built_adapter(args.adapter), Path(args.out), args.format, args.dtype, args.quantize,
        model=args.model, weights=args.weights, progress=note, **options,
    )  # fmt: skip
    if args.json:
        print(json.dumps(record, indent=2, sort_keys=True))
        return 0
    base = record["base"]
    how = " (dequantized for the merge)" if base["dequantized"] else ""
    note(
        f"merged {record['adapter']['folder']} into {base['name']}{how}: "
        f"{record['format']} {record['quantize'] or record['dtype']}"
    )
    rows = [
        {"file": name, "bytes": f["size"], "sha256": f["sha256"][:16]}
        for name, f in sorted(record["files"].items())
    ]
    print(table(rows))
    print(Path(args.out))
    return 0
