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

from spill import settings
from spill.cli import build_parser
from spill.jobs.rows.eval import EvalOptions
from spill.jobs.rows.generate import GenerateOptions
from spill.jobs.rows.job import RowOptions
from spill.jobs.tune import TuneOptions
from spill.models.lora import LoraConfig
from spill.settings import schema as settings_schema

CONF = Path(spill.conf.__file__).parent
ROOT = Path(__file__).resolve().parents[2]
GROUPS = {
    "model": "custom",
    "tune": "default",
    "eval": "default",
    "teacher": "none",
    "engine": "auto",
}
SECTIONS = {g: settings.GROUPS[g] for g in GROUPS}
ENGINE_FLAGS = {"engine": "name", "device": "device", "dtype": "dtype", "ring": "ring"}
ENGINE_FLAGS |= {"resident": "resident", "memory": "memory", "packed_matmul": "packed_matmul"}


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
    from spill.ground.validate import load_schema

    return load_schema("spill-yaml")["properties"][group]["properties"]


def unset(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


@pytest.mark.parametrize("group", GROUPS)
def test_the_reader_is_the_files(group):
    assert spill.conf.defaults(group) == base(group)
    assert spill.conf.BASE[group] == GROUPS[group]


@pytest.mark.parametrize("group", GROUPS)
def test_schema_and_project_dataclass_name_every_setting_with_the_conf_default(group):
    conf, schema = base(group), schema_section(group)
    assert list(schema) == list(conf), "the schema's keys are the conf's, in order"
    assert sorted(f.name for f in dataclasses.fields(SECTIONS[group])) == sorted(conf)
    assert [name for name, _ in settings_schema.fields(group)] == list(conf)
    unset_here = {k: "<none>" if v == "???" else v for k, v in conf.items()}  # ???: the project's
    assert {k: v.get("default", "<none>") for k, v in schema.items()} == unset_here


def test_the_shipped_schema_is_what_the_settings_make():
    """The group sections of spill-yaml.schema.json are generated from spill.settings (types,
    bounds, descriptions) and conf/ (defaults): `python -m spill.settings` writes them."""
    from spill.ground.validate import load_schema

    shipped = load_schema("spill-yaml")["properties"]
    made = settings_schema.schema_sections()
    assert {g: shipped[g] for g in made} == made, "run `python -m spill.settings`"


def test_the_checkpoint_identity_pins_every_tune_setting_that_decides_the_result():
    """A stage's inputs and a checkpoint's identity both name the deciding tune settings."""
    from spill.jobs.tune.identity import IDENTITY, IDENTITY_LORA, IDENTITY_PREFERENCE

    decides = set(settings.deciding(settings.TuneSettings))
    # the validation settings: the file's fingerprint, --eval-every and --keep-best
    pinned = set(IDENTITY) | set(IDENTITY_LORA) | set(settings.VALIDATION)
    assert pinned | set(IDENTITY_PREFERENCE) == decides
    assert set(IDENTITY_PREFERENCE) == set(settings.PREFERENCE)
    assert {"ckpt_every", "activations", "log"} == {
        f.name for f in dataclasses.fields(settings.TuneSettings)
    } - decides


@pytest.mark.parametrize("group", ["model", "teacher", "engine"])
def test_other_options_only_rename(group):
    """Model, teacher and engine options differ from their base in ``name`` alone."""
    want = {k: v for k, v in base(group).items() if k != "name"}
    for path in sorted((CONF / group).glob("*.yaml")):
        got = {k: v for k, v in raw(group, path.stem).items() if k != "name"}
        assert got == want, path.name


def test_tune_job_and_cli_read_the_tune_group():
    conf = base("tune")
    fields = {f.name: f for f in dataclasses.fields(settings.TuneSettings)}
    assert all(unset(fields[k]) for k in conf), "TuneSettings keeps no default of its own"
    cli = cli_defaults("tune")
    assert {k: cli[k] for k in conf} == conf
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
    from spill.jobs.tune.identity import identity as _identity

    args = build_parser().parse_args(["tune", "m", "t.jsonl", "--name", "x"])
    flags = settings.TuneSettings(**{k: getattr(args, k) for k in base("tune")})
    cli = TuneOptions(tune=flags, seed=0)
    built = TuneOptions(tune=settings.TuneSettings(**base("tune")), seed=0)
    assert _identity("m", "fp", "data", cli) == _identity("m", "fp", "data", built)
    readme = (ROOT / "README.md").read_text()
    assert f"micro-batches of {cli.tune.micro_batch} samples by default" in readme


def test_row_verbs_read_the_teacher_eval_and_engine_groups():
    teacher, ev, engine = base("teacher"), base("eval"), base("engine")
    for verb in ("run", "distill"):
        cli = cli_defaults(verb)
        assert {k: cli[k] for k in ("max_new_tokens", "temperature", "batch")} == {
            k: teacher[k] for k in ("max_new_tokens", "temperature", "batch")
        }
        top_p = next(f for f in dataclasses.fields(GenerateOptions) if f.name == "top_p")
        assert cli["top_p"] == top_p.default  # in no group: GenerateOptions holds its one default
    cli = cli_defaults("eval")
    assert (cli["max_new_tokens"], cli["batch"]) == (ev["max_new_tokens"], ev["batch"])
    for verb in ("run", "distill", "eval", "tune"):
        cli = cli_defaults(verb)
        assert {flag: cli[flag] for flag in ENGINE_FLAGS} == {
            flag: engine[key] for flag, key in ENGINE_FLAGS.items()
        }, verb


def test_the_job_verbs_take_the_model_groups_quantization_flags():
    """``--quantize``/``--group-size`` on run, eval, distill and tune default to conf/model's
    base option; the schema's choices are spill.models.quant's (declared in the settings)."""
    from spill.models import quant

    model = base("model")
    assert (model["quantize"], model["group_size"]) == (None, 64)
    for verb in ("run", "eval", "distill", "tune"):
        cli = cli_defaults(verb)
        assert (cli["quantize"], cli["group_size"]) == (None, 64), verb
    section = schema_section("model")
    assert section["quantize"]["enum"] == [None, *quant.BITS]
    assert section["group_size"]["enum"] == list(quant.GROUP_SIZES)
    flag = lambda key: "--" + key.replace("_", "-")  # noqa: E731
    ok = settings.ModelSettings(name="m", quantize=4, group_size=32)
    assert ok.problem(flag) == "" and quant.spec_of(ok) == quant.Spec(4, 32)
    assert quant.spec_of(settings.ModelSettings(name="m", quantize=None, group_size=64)) is None
    bad = settings.ModelSettings(name="m", quantize=3, group_size=64)
    assert bad.problem(flag) == "--quantize 3 is not one spill makes: use 4 or 8"
    bad = settings.ModelSettings(name="m", quantize=8, group_size=48)
    assert bad.problem(flag) == "--group-size 48 is not one spill makes: use 32, 64 or 128"


def test_job_options_keep_no_copy_of_a_group_default():
    """A field named like a setting has no default, or the conf's."""
    known = {k: v for g in GROUPS for k, v in base(g).items()}
    for cls in (RowOptions, GenerateOptions, EvalOptions, TuneOptions, *SECTIONS.values()):
        for f in dataclasses.fields(cls):
            if f.name in known and not unset(f) and f.default != known[f.name]:
                pytest.fail(f"{cls.__name__}.{f.name} has a default of its own: {f.default!r}")


def test_the_engine_seams_defaults_are_the_engine_group():
    """``LoadOptions`` is built without conf/ (engines, benches): its defaults are
    conf/engine/auto.yaml's, as are those of the name and procs."""
    fields = dataclasses.fields(settings.EngineSettings)
    assert {f.name: f.default for f in fields} == base("engine")
    assert settings.EngineSettings().load() == settings.LoadOptions()


def test_the_engine_names_are_the_engines_spill_picks_from():
    """``engine.name``'s choices (the settings import no engine) are ``auto`` and the engines."""
    from spill.engines import ENGINES

    assert settings.ENGINE_NAMES == ("auto", *ENGINES)


def test_the_engine_flags_are_the_engine_settings():
    """Every engine setting but procs is a flag; on a build they are the ``engine.*``
    overrides they stand for, and a resume passes them on as the same flags."""
    from spill.cli.options import engine_argv, engine_overrides

    build = subparsers()["build"]
    given = ["--engine", "torch", "--device", "cpu", "--dtype", "float32", "--resident"]
    args = build.parse_args([*given, "--memory", "1G", "--packed-matmul"])
    assert engine_overrides(args) == [
        "engine.name=torch",
        "engine.device=cpu",
        "engine.dtype=float32",
        f"engine.memory={2**30}",
        "engine.packed_matmul=true",
        "engine.resident=true",
        "engine.ring=null",
    ]
    assert vars(build.parse_args(engine_argv(args))) == vars(args)
    ring = build.parse_args(["--ring", "2"])
    assert engine_overrides(ring) == ["engine.ring=2", "engine.resident=false"]
    named = {f.name for f in dataclasses.fields(settings.EngineSettings)}
    assert set(ENGINE_FLAGS.values()) == named - {"procs"}  # the defaults test reads them all


def test_the_export_record_names_the_export_groups_formats_and_dtypes():
    """export.json's schema lists the formats and dtypes literally: the export group's."""
    from spill.ground.validate import load_schema

    record = load_schema("export")["properties"]
    assert record["format"]["enum"] == list(settings.EXPORT_FORMATS)
    assert record["dtype"]["enum"] == list(settings.EXPORT_DTYPES)


def test_a_setting_is_one_field_and_one_conf_line(monkeypatch):
    """Adding a setting to a group: its field in spill.settings (type, schema fragment, help),
    its line in the group's base option in conf/, and `python -m spill.settings` for the
    schema file. Everything else reads the shape: here a group grown by one field makes its
    flag, its schema entry and its stage input without another edit."""
    import argparse as ap

    from spill.cli.options import setting_flags

    @dataclasses.dataclass(frozen=True)
    class Grown(settings.TuneSettings):
        label_smoothing: float = settings.setting({"type": "number", "minimum": 0}, "smoothing")

    flags = ap.ArgumentParser()
    grown, original = dict(base("tune"), label_smoothing=0.1), spill.conf.defaults
    monkeypatch.setattr(spill.conf, "defaults", lambda g: grown if g == "tune" else original(g))
    setting_flags(flags, Grown, "tune")
    assert flags.parse_args([]).label_smoothing == 0.1
    assert flags.parse_args(["--label-smoothing", "0.3"]).label_smoothing == 0.3
    assert "label_smoothing" in settings.deciding(Grown)


@pytest.mark.parametrize(
    "text", ["8G", "512MiB", "1.5g", "1048576", " 8 gb ", "2t", "8x", "g", "1.", "-1", "8 GiBs"]
)
def test_the_schema_admits_exactly_the_sizes_spill_sizes_reads(text):
    import re

    from spill.ground.sizes import parse_size

    pattern = schema_section("engine")["memory"]["pattern"]
    try:
        parse_size(text)
        parsed = True
    except ValueError:
        parsed = False
    assert bool(re.search(pattern, text)) == parsed


def _outside(schema: dict) -> list:
    """Values each bound or enum of a setting's schema refuses, nearest the bound first."""
    out: list = []
    if "minimum" in schema:
        out.append(schema["minimum"] - (1 if schema.get("type") == "integer" else 1e-9))
    if "exclusiveMinimum" in schema:
        out.append(schema["exclusiveMinimum"])
    if "maximum" in schema:
        out.append(schema["maximum"] * 10 if schema["maximum"] else 1)
    if "exclusiveMaximum" in schema:
        out.append(schema["exclusiveMaximum"])
    if "enum" in schema:
        out.append("not-one-of-them")
    return out


BOUNDED = [
    (f.name, bad)
    for f in dataclasses.fields(settings.TuneSettings)
    if f.metadata["flag"] is not False
    for bad in _outside(f.metadata["schema"])
]


@pytest.mark.parametrize("name, bad", BOUNDED)
def test_the_tune_jobs_checks_refuse_what_the_tune_schema_refuses(name, bad):
    """``spill tune``'s flags are not read through the schema: the job's own checks refuse every
    value past a bound or outside an enum that the one definition (``TuneSettings``) states."""
    from spill.errors import SpillError

    good = settings.TuneSettings(**base("tune"))
    TuneOptions(tune=good, seed=0).check()  # the defaults pass
    tune = dataclasses.replace(good, **{name: bad})
    with pytest.raises(SpillError):
        TuneOptions(tune=tune, seed=0).check()
