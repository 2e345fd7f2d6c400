"""What several verbs share on the command line: which verbs are jobs, the engine flags (and the
``engine.*`` overrides they stand for), the model group's flags (``--quantize``, ``--group-size``),
``--wait``/``--lease`` and sizes as an argparse type.

Nothing here reads a conf file when imported: a job verb's engine defaults are read when its
parser is built, so ``spill --help`` and a finished ``spill build`` stay light.
"""

from __future__ import annotations

import argparse

from spill.errors import UsageError

JOB_VERBS = ("run", "eval", "distill", "tune", "train", "predict")  # train: tune's alias
# the engine flags that take a value (--resident is the one switch): what build and resume turn
# into engine.* overrides, and what a resume passes on to the command it replays
ENGINE_FLAGS = ("engine", "device", "dtype", "ring", "memory")


def parse_size(text: str) -> int:
    """``--memory``: ``8G``, ``512MiB``, ``1.5g`` or a plain byte count (``spill.ground.sizes``)."""
    from spill.ground.sizes import parse_size as parse

    try:
        return parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def engine_options(p: argparse.ArgumentParser, shorthand: bool = False) -> None:
    """``--engine --device --dtype --ring|--resident --memory --packed-matmul`` (and ``--weights``): every verb
    that computes takes them. A job verb defaults them to the engine group's base option; with
    ``shorthand`` (build, resume) they default to None and stand for ``engine.*`` overrides."""
    if shorthand:  # no conf read: a finished build should not import YAML
        e = dict.fromkeys(
            ("name", "device", "dtype", "ring", "resident", "memory", "packed_matmul")
        )
    else:
        from spill.conf import defaults

        e = defaults("engine")
    g = p.add_argument_group(
        "engine (shorthand for the engine.* settings; unset: the project's)"
        if shorthand
        else "model and engine"
    )
    if not shorthand:
        g.add_argument(
            "--weights",
            metavar="URI",
            help="stage the model folder from this fsspec URI (local, s3://, memory://)",
        )
    g.add_argument(
        "--engine",
        default=e["name"],
        choices=["auto", "torch", "mlx"],
        help="compute engine" + ("" if shorthand else " (default: %(default)s)"),
    )
    g.add_argument(
        "--device",
        default=e["device"],
        help="device for the engine, e.g. cpu or cuda (default: the best available)",
    )
    g.add_argument(
        "--dtype",
        default=e["dtype"],
        choices=["float32", "bfloat16"],
        help="base-weight numerics (default: measured choice)",
    )
    ring = g.add_mutually_exclusive_group()
    ring.add_argument(
        "--ring",
        type=int,
        default=e["ring"],
        metavar="K",
        help="stream decoder layers through K slots (2 streams hardest)",
    )
    ring.add_argument(
        "--resident",
        action="store_true",
        default=bool(e["resident"]),
        help="load every layer once and keep it",
    )
    g.add_argument(
        "--memory",
        type=parse_size,
        default=e["memory"],
        metavar="SIZE",
        help="memory budget for the layer ring, e.g. 8G (default: from free RAM)",
    )
    g.add_argument(
        "--packed-matmul",
        action="store_true",
        default=bool(e["packed_matmul"]),
        help="compute 4-bit layers with torch's int4 matmul on a CPU (bfloat16, other numbers "
        "than the dequantized path; row jobs, not tune)",
    )


def engine_settings(args: argparse.Namespace):
    """A job verb's engine flags as its engine group (``--memory`` parsed to bytes)."""
    from spill.settings import EngineSettings

    if args.ring is not None and args.ring < 1:
        raise UsageError("--ring must be at least 1")
    return EngineSettings(
        name=args.engine,
        ring=args.ring,
        resident=args.resident,
        memory=args.memory,
        device=args.device,
        dtype=args.dtype,
        packed_matmul=args.packed_matmul,
    )


def engine_overrides(args: argparse.Namespace) -> list[str]:
    """``--engine --device --dtype --ring --resident --memory`` as the ``engine.*`` overrides
    they stand for (the same options every computing verb takes)."""
    out = []
    for key in ENGINE_FLAGS:
        value = getattr(args, key, None)
        if value is not None:
            out.append(f"engine.{'name' if key == 'engine' else key}={value}")
    if args.ring is not None and args.ring < 1:
        raise UsageError("--ring must be at least 1")
    if args.packed_matmul:
        out.append("engine.packed_matmul=true")
    if args.resident:
        out += ["engine.resident=true", "engine.ring=null"]
    elif args.ring is not None:
        out.append("engine.resident=false")
    return out


def _lease(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def authority_options(p: argparse.ArgumentParser) -> None:
    """``--wait`` and ``--lease``: how a writer meets another owner of its state's run."""
    p.add_argument(
        "--wait",
        action="store_true",
        help="if another process owns the state's run, wait for it instead of exiting 75",
    )
    p.add_argument(
        "--lease",
        type=_lease,
        metavar="SECONDS",
        help="how long the run stays ours without a heartbeat (default $SPILL_LEASE or 120)",
    )


def setting_flags(p, cls, group: str, only: tuple[str, ...] | None = None) -> None:
    """One flag per setting of ``cls`` (a ``spill.settings`` group) that the job verbs take
    (``--micro-batch`` for ``micro_batch``), its type from the field, its choices from the
    schema, its help from the field and its default from the group's base option in conf/."""
    import dataclasses

    from spill.conf import defaults

    given = defaults(group)
    for f in dataclasses.fields(cls):
        m = f.metadata
        if not m.get("flag") or only is not None and f.name not in only:
            continue
        flag = "--" + f.name.replace("_", "-")
        if str(f.type) == "bool":  # --keep-best / --no-keep-best
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=given[f.name],
                           help=m["help"])  # fmt: skip
            continue
        kind = next(t for t in (int, float, str) if t.__name__ in str(f.type).split(" | "))
        options = {"type": kind, "default": given[f.name]}
        if m["help"]:
            options["help"] = m["help"]
        choices = tuple(c for c in m["schema"].get("enum", ()) if c is not None)
        if choices and kind is str:
            options = {"choices": choices, **options}
            options.pop("type")
        elif choices:  # numbers: the settings' ``problem`` says a bad one in one line
            options["metavar"] = "|".join(map(str, choices))
        p.add_argument(flag, **options)


def model_options(p: argparse.ArgumentParser) -> None:
    """``--quantize`` and ``--group-size`` (``spill.settings.ModelSettings``; defaults:
    conf/model/custom.yaml, as in a build): every verb that takes a model by name."""
    from spill.settings import ModelSettings

    g = p.add_argument_group("quantized base (defaults: conf/model/custom.yaml, as in a build)")
    setting_flags(g, ModelSettings, "model")


def model_settings(args: argparse.Namespace):
    """A job verb's model and its ``--quantize``/``--group-size`` as the model group, or a
    one-line ``UsageError`` for a quantization no copy can be made with."""
    from spill.settings import ModelSettings

    name = getattr(args, "model", None) or getattr(args, "teacher", None) or ""
    model = ModelSettings(name=name, quantize=args.quantize, group_size=args.group_size)
    if why := model.problem(lambda key: "--" + key.replace("_", "-")):
        raise UsageError(why)
    return model


def trackers(text: str) -> tuple[str, ...]:
    """``--log tensorboard,mlflow``: the ``tune.log`` list, comma-separated (``""``: none)."""
    from spill.settings import TRACKERS

    kinds = tuple(dict.fromkeys(k.strip() for k in text.split(",") if k.strip()))
    if unknown := [k for k in kinds if k not in TRACKERS]:
        raise argparse.ArgumentTypeError(
            f"{unknown[0]!r} is not a tracker spill logs to: use {' or '.join(TRACKERS)}, "
            "comma-separated"
        )
    return kinds


def log_option(p) -> None:
    """``--log``: the trackers a job logs to (``tune.log``; default: conf/tune/default.yaml)."""
    from spill.conf import defaults

    p.add_argument(
        "--log",
        type=trackers,
        default=defaults("tune")["log"],
        metavar="TRACKERS",
        help="log to tensorboard and/or mlflow, comma-separated (docs/watching.md)",
    )
