"""What several verbs share on the command line: which verbs are jobs, the flags made from the
settings (the engine group's, and the ``engine.*`` overrides they stand for; a group's as
``setting_flags``; the model group's ``--quantize``, ``--group-size``), ``--wait``/``--lease``.

Nothing here reads a conf file when imported: a job verb's defaults are read when its parser is
built, so ``spill --help`` and a finished ``spill build`` stay light.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from spill import conf
from spill.errors import UsageError
from spill.settings import TRACKERS, EngineSettings, ModelSettings, engine_flags, flag_name

JOB_VERBS = ("run", "eval", "distill", "tune", "train", "predict")  # train: tune's alias
# the engine flags that take a value (the switches are --resident and --packed-matmul): what
# build and resume turn into engine.* overrides, and what a resume passes on to the command it
# replays; each an engine setting's flag (spill.settings.engine)
ENGINE_FLAGS = tuple(f.name for f in engine_flags() if f.type != "bool")


@dataclass(frozen=True)
class Replay:
    """What a verb may return in place of an exit code: a command line for ``spill.cli.main``
    to run instead, in folder ``cwd`` (``spill resume`` of a state location)."""

    cwd: str
    argv: list[str]


def _dest(f) -> str:
    """The attribute a setting's flag sets (``engine`` for ``--engine``)."""
    return flag_name(f).removeprefix("--").replace("-", "_")


def _parsed(parse):
    """``parse`` as an argparse type: its ``ValueError`` said as the flag's error."""

    def convert(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


def engine_options(p: argparse.ArgumentParser, shorthand: bool = False) -> None:
    """``--engine --device --dtype --ring|--resident --memory --packed-matmul`` (and
    ``--weights``), one per engine setting that is a flag: every verb that computes takes them.
    A job verb defaults them to the engine group's base option; with ``shorthand`` (build,
    resume) they default to None and stand for ``engine.*`` overrides."""
    if shorthand:  # no conf read: a finished build should not import YAML
        given = dict.fromkeys(f.name for f in engine_flags())
    else:
        given = conf.defaults("engine")
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
    ring = g.add_mutually_exclusive_group()  # a ring of slots, or every layer resident
    for f in engine_flags():
        m, default = f.metadata, given[f.name]
        at = ring if f.name in ("ring", "resident") else g
        helped = m["help"].replace(" (default: %(default)s)", "") if shorthand else m["help"]
        if f.type == "bool":
            at.add_argument(flag_name(f), action="store_true", default=bool(default), help=helped)
            continue
        at.add_argument(flag_name(f), **_value_flag(f, default, helped))


def _value_flag(f, default, help: str | None) -> dict:
    """argparse's options for a setting that takes a value: its type from the field (or its
    ``parse``), its choices from the schema, its help and metavar from the field."""
    m = f.metadata
    kind = next(t for t in (int, float, str) if t.__name__ in str(f.type).split(" | "))
    options = {"type": _parsed(m["parse"]) if m["parse"] else kind, "default": default}
    if help:
        options["help"] = help
    choices = tuple(c for c in m["schema"].get("enum", ()) if c is not None)
    if choices and kind is str:
        options = {"choices": choices, **options}
        options.pop("type")
    elif choices:  # numbers: the settings' ``problem`` says a bad one in one line
        options["metavar"] = "|".join(map(str, choices))
    if m["metavar"]:
        options["metavar"] = m["metavar"]
    return options


def engine_settings(args: argparse.Namespace) -> EngineSettings:
    """A job verb's engine flags as its engine group (``--memory`` parsed to bytes)."""
    if args.ring is not None and args.ring < 1:
        raise UsageError("--ring must be at least 1")
    return EngineSettings(**{f.name: getattr(args, _dest(f)) for f in engine_flags()})


def engine_overrides(args: argparse.Namespace) -> list[str]:
    """The engine flags given as the ``engine.*`` overrides they stand for (the same options
    every computing verb takes); ``--resident`` also unsets the ring, ``--ring`` the resident."""
    given = {f.name: getattr(args, _dest(f), None) for f in engine_flags()}
    out = [f"engine.{k}={given[k]}" for k in ENGINE_FLAGS if given[k] is not None]
    if args.ring is not None and args.ring < 1:
        raise UsageError("--ring must be at least 1")
    out += [f"engine.{k}=true" for k in given if k not in (*ENGINE_FLAGS, "resident") and given[k]]
    if args.resident:
        out += ["engine.resident=true", "engine.ring=null"]
    elif args.ring is not None:
        out.append("engine.resident=false")
    return out


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags given, as a command line (what a resume passes on)."""
    out = []
    for f in engine_flags():
        value = getattr(args, _dest(f))
        if f.type == "bool":
            out += [flag_name(f)] if value else []
        elif value is not None:
            out.append(f"{flag_name(f)}={value}")
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
    given = conf.defaults(group)
    for f in dataclasses.fields(cls):
        m = f.metadata
        if not m.get("flag") or only is not None and f.name not in only:
            continue
        flag = flag_name(f)
        if str(f.type) == "bool":  # --keep-best / --no-keep-best
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=given[f.name],
                           help=m["help"])  # fmt: skip
            continue
        p.add_argument(flag, **_value_flag(f, given[f.name], m["help"]))


def model_options(p: argparse.ArgumentParser) -> None:
    """``--quantize`` and ``--group-size`` (``spill.settings.ModelSettings``; defaults:
    conf/model/custom.yaml, as in a build): every verb that takes a model by name."""
    g = p.add_argument_group("quantized base (defaults: conf/model/custom.yaml, as in a build)")
    setting_flags(g, ModelSettings, "model")


def model_settings(args: argparse.Namespace):
    """A job verb's model and its ``--quantize``/``--group-size`` as the model group, or a
    one-line ``UsageError`` for a quantization no copy can be made with."""
    name = getattr(args, "model", None) or getattr(args, "teacher", None) or ""
    model = ModelSettings(name=name, quantize=args.quantize, group_size=args.group_size)
    if why := model.problem(lambda key: "--" + key.replace("_", "-")):
        raise UsageError(why)
    return model


def trackers(text: str) -> tuple[str, ...]:
    """``--log tensorboard,mlflow``: the ``tune.log`` list, comma-separated (``""``: none)."""
    kinds = tuple(dict.fromkeys(k.strip() for k in text.split(",") if k.strip()))
    if unknown := [k for k in kinds if k not in TRACKERS]:
        raise argparse.ArgumentTypeError(
            f"{unknown[0]!r} is not a tracker spill logs to: use {' or '.join(TRACKERS)}, "
            "comma-separated"
        )
    return kinds


def log_option(p) -> None:
    """``--log``: the trackers a job logs to (``tune.log``; default: conf/tune/default.yaml)."""
    p.add_argument(
        "--log",
        type=trackers,
        default=conf.defaults("tune")["log"],
        metavar="TRACKERS",
        help="log to tensorboard and/or mlflow, comma-separated (docs/watching.md)",
    )
