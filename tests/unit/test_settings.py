"""One definition per setting: the conf group's base option (``conf/<group>/``) is every
default, and this test fails when any other place disagrees with it: the shipped options that
only rename (teacher, engine), the spill.yaml schema's defaults and keys, the project's frozen
dataclasses, the job options' dataclasses, ``LoraConfig``, and the CLI's argparse defaults.

The YAML is parsed here independently of ``spill.conf.defaults``, so a bug in that reader shows too.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest
import spill.conf
import yaml

from spill.cli import build_parser
from spill.jobs.eval import EvalOptions
from spill.jobs.rows_job import RowOptions
from spill.jobs.run import RunOptions
from spill.jobs.tune import TuneOptions
from spill.models.lora import LoraConfig
from spill.project import config as project_config

CONF = Path(spill.conf.__file__).parent
ROOT = Path(__file__).resolve().parents[2]
GROUPS = {"tune": "default", "eval": "default", "teacher": "none", "engine": "auto"}
SECTIONS = {
    "tune": project_config.TuneConfig,
    "eval": project_config.EvalConfig,
    "teacher": project_config.TeacherConfig,
    "engine": project_config.EngineConfig,
}
ENGINE_FLAGS = {"engine": "name", "device": "device", "dtype": "dtype", "ring": "ring"}
ENGINE_FLAGS |= {"resident": "resident", "memory": "memory"}


def raw(group: str, option: str) -> dict:
    """An option file as written, with the same-group options it extends merged under it."""
    doc = yaml.safe_load((CONF / group / f"{option}.yaml").read_text())
    out: dict = {}
    for parent in doc.pop("defaults", []):
        out |= raw(group, parent)
    return out | doc


def base(group: str) -> dict:
    return raw(group, GROUPS[group])


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def cli_defaults(verb: str) -> dict:
    p = subparsers()[verb]
    return {a.dest: a.default for a in p._actions if a.dest != "help"}


def schema_section(group: str) -> dict:
    from spill.validate import load_schema

    return load_schema("spill-yaml")["properties"][group]["properties"]


def unset(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


@pytest.mark.parametrize("group", GROUPS)
def test_the_reader_is_the_files(group):
    assert spill.conf.defaults(group) == base(group)


@pytest.mark.parametrize("group", GROUPS)
def test_schema_and_project_dataclass_name_every_setting_with_the_conf_default(group):
    settings, schema = base(group), schema_section(group)
    assert list(schema) == list(settings), "the schema's keys are the conf's, in order"
    assert [f.name for f in dataclasses.fields(SECTIONS[group])] == list(settings)
    assert {k: v.get("default", "<none>") for k, v in schema.items()} == settings


@pytest.mark.parametrize("group", ["teacher", "engine"])
def test_other_options_only_rename(group):
    """Teacher and engine options differ from their base in ``name`` alone."""
    want = {k: v for k, v in base(group).items() if k != "name"}
    for path in sorted((CONF / group).glob("*.yaml")):
        got = {k: v for k, v in raw(group, path.stem).items() if k != "name"}
        assert got == want, path.name


def test_tune_job_and_cli_read_the_tune_group():
    settings = base("tune")
    fields = {f.name: f for f in dataclasses.fields(TuneOptions)}
    assert all(unset(fields[k]) for k in settings), "TuneOptions keeps no default of its own"
    cli = cli_defaults("tune")
    assert {k: cli[k] for k in settings} == settings
    assert cli["engine"] == base("engine")["name"]


def test_lora_config_defaults_are_the_tune_group():
    t = base("tune")
    default = LoraConfig()
    assert (default.rank, default.dropout) == (t["rank"], t["dropout"])
    assert default.targets == LoraConfig.parse_targets(t["targets"])
    assert t["alpha"] is None and default.alpha == 2 * t["rank"]  # null: 2 x rank, one rule
    assert LoraConfig(rank=4).alpha == 8.0 and LoraConfig(rank=4, alpha=3.0).alpha == 3.0


def test_a_cli_tune_and_a_build_tune_are_the_same_run():
    """Identical options from ``spill tune`` with no flags and from a build with tune/default."""
    from spill.jobs.tune import _identity

    args = build_parser().parse_args(["tune", "m", "t.jsonl", "--name", "x"])
    cli = TuneOptions(**{k: getattr(args, k) for k in base("tune")}, seed=0, engine=args.engine)
    section = project_config.TuneConfig(**base("tune"))
    built = TuneOptions(**dataclasses.asdict(section), seed=0, engine="auto")
    assert _identity("m", "fp", "data", cli) == _identity("m", "fp", "data", built)
    readme = (ROOT / "README.md").read_text()
    assert f"micro-batches of {cli.micro_batch} samples by default" in readme


def test_row_verbs_read_the_teacher_eval_and_engine_groups():
    teacher, ev, engine = base("teacher"), base("eval"), base("engine")
    for verb in ("run", "distill"):
        cli = cli_defaults(verb)
        assert {k: cli[k] for k in ("max_new_tokens", "temperature", "batch")} == {
            k: teacher[k] for k in ("max_new_tokens", "temperature", "batch")
        }
        top_p = next(f for f in dataclasses.fields(RunOptions) if f.name == "top_p")
        assert cli["top_p"] == top_p.default  # in no group: RunOptions holds its one default
    cli = cli_defaults("eval")
    assert (cli["max_new_tokens"], cli["batch"]) == (ev["max_new_tokens"], ev["batch"])
    for verb in ("run", "distill", "eval", "tune"):
        cli = cli_defaults(verb)
        assert {flag: cli[flag] for flag in ENGINE_FLAGS} == {
            flag: engine[key] for flag, key in ENGINE_FLAGS.items()
        }, verb


def test_job_options_keep_no_copy_of_a_group_default():
    """A field named like a setting has no default, or the conf's."""
    known = {k: v for g in GROUPS for k, v in base(g).items()}
    for cls in (RowOptions, RunOptions, EvalOptions, TuneOptions):
        for f in dataclasses.fields(cls):
            if f.name in known and not unset(f):
                pytest.fail(f"{cls.__name__}.{f.name} has a default of its own: {f.default!r}")


@pytest.mark.parametrize(
    "text", ["8G", "512MiB", "1.5g", "1048576", " 8 gb ", "2t", "8x", "g", "1.", "-1", "8 GiBs"]
)
def test_the_schema_admits_exactly_the_sizes_spill_sizes_reads(text):
    import re

    from spill.sizes import parse_size

    pattern = schema_section("engine")["memory"]["pattern"]
    try:
        parse_size(text)
        parsed = True
    except ValueError:
        parsed = False
    assert bool(re.search(pattern, text)) == parsed
