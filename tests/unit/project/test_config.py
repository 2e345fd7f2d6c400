"""spill.yaml -> Project: every shipped group option and every example project composes and
validates; a bad file or override fails in one line naming the key path and what is allowed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import spill.conf
import yaml

from spill.project.config import ConfigError, compose, compose_key, from_record
from spill.settings import ExportSettings

ROOT = Path(__file__).resolve().parents[3]
CONF = Path(spill.conf.__file__).parent
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and not p.name.startswith("_"))
PROJECTS = sorted(p.parent for p in (ROOT / "projects").glob("*/spill.yaml"))
# options that leave a value to the project, and the value a project would give
NEEDS = {"custom": "{group}.name=tiny:llama:3"}


def options():
    for group in GROUPS:
        for path in sorted((CONF / group).glob("*.yaml")):
            yield group, path.stem


@pytest.fixture
def toy(tmp_path) -> Path:
    dst = tmp_path / "toy"
    shutil.copytree(ROOT / "projects" / "toy", dst, ignore=shutil.ignore_patterns(".spill"))
    return dst


def test_groups_are_the_documented_ones():
    assert GROUPS == sorted(
        ["data", "engine", "eval", "export", "model", "prompt", "teacher", "tune"]
    )


@pytest.mark.parametrize(("group", "option"), list(options()), ids=lambda x: x)
def test_every_shipped_option_composes_and_validates(toy, group, option):
    # export came later: a project lists it in its defaults or appends it (``+export=hf``)
    overrides = [f"{'+' if group == 'export' else ''}{group}={option}"]
    if option in NEEDS:
        overrides.append(NEEDS[option].format(group=group))
    if group == "data":
        overrides += ["data.file=toy.csv", "data.input=text", "data.output=label"]
    project = compose(toy, overrides)
    assert project.name == "toy"
    assert from_record(project.to_dict(), toy, overrides) == project


@pytest.mark.parametrize("folder", PROJECTS, ids=lambda p: p.name)
def test_every_example_project_composes_and_validates(folder):
    project = compose(folder)
    assert (folder / project.data.file).is_file()
    first = (folder / "spill.yaml").read_text().splitlines()[0]
    schema = first.split("$schema=", 1)[1]
    assert first.startswith("# yaml-language-server: $schema=")
    assert (folder / schema).resolve() == ROOT / "schemas" / "spill-yaml.schema.json"


def test_the_export_group_needs_no_entry_in_the_defaults_list(toy):
    assert compose(toy).export == ExportSettings(formats=(), dtype=None, quantize=None)
    text = (toy / "spill.yaml").read_text()
    (toy / "spill.yaml").write_text(text + "\nexport:\n  formats: [hf, gguf]\n")
    p = compose(toy)
    assert (p.export.formats, p.export.dtype, p.export.quantize) == (("hf", "gguf"), None, None)
    assert compose(toy, ["+export=mlx"]).export.formats == ("mlx",)
    q = compose(toy, ["export.quantize=q8_0"]).export
    assert (q.quantize_for("hf"), q.quantize_for("gguf")) == (None, "q8_0")
    assert (
        compose(toy, ["export.formats=[mlx]", "export.quantize=4"]).export.quantize_for("mlx")
        == "4"
    )
    assert from_record(p.to_dict(), toy) == p
    old = p.to_dict()
    del old["export"]  # a record made before the export group: no export stage
    assert from_record(old, toy).export.formats == ()


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("export.quantize=q8_0", "export.quantize 'q8_0' applies to gguf only"),
        ("export.formats=[onnx]", "export.formats[0] is 'onnx'; allowed: hf, gguf, mlx"),
        ("export.dtype=f8", "export.dtype is 'f8'; allowed: null, f32, bf16, f16"),
    ],
)
def test_export_settings_that_cannot_be_written_are_refused_in_one_line(toy, override, said):
    text = (toy / "spill.yaml").read_text()
    (toy / "spill.yaml").write_text(text + "\nexport:\n  formats: [hf]\n")
    with pytest.raises(ConfigError) as e:
        compose(toy, [override])
    assert said in str(e.value) and "\n" not in str(e.value)


def test_overrides_and_project_group_files(toy):
    (toy / "tune").mkdir()
    (toy / "tune" / "mine.yaml").write_text("defaults:\n  - default\ndropout: 0.25\nsteps: 7\n")
    p = compose(toy, ["tune=mine", "tune.rank=2", "tune.lr=3e-4"])
    # the group option, then the project's own values (steps: 300), then the overrides
    assert (p.tune.dropout, p.tune.steps, p.tune.rank, p.tune.lr) == (0.25, 300, 2, 0.0003)
    assert p.overrides == ("tune=mine", "tune.rank=2", "tune.lr=3e-4")


def test_a_group_file_written_before_later_settings_still_composes(toy):
    """A project's own tune file naming every key of its day (no validation, no trackers), and
    a model file without quantization: the later settings take their shipped defaults, which
    change nothing; a key of the first release left out is still refused."""
    old_tune = (
        "steps: 60\nlr: 0.005\nwarmup: 5\nweight_decay: 0.0\nrank: 8\nalpha: null\n"
        "dropout: 0.0\ntargets: all\nbatch: 8\nmicro_batch: 8\nseq_len: 64\nckpt_every: 30\n"
        "activations: auto\n"
    )
    (toy / "tune").mkdir()
    (toy / "tune" / "old.yaml").write_text(old_tune)
    (toy / "model").mkdir()
    (toy / "model" / "old.yaml").write_text("name: tiny:llama:2:2x64\n")
    text = (toy / "spill.yaml").read_text()
    for section in ("\ntune:\n", "\nmodel:\n"):  # the group files say it all
        start = text.index(section)
        text = text[:start] + text[text.index("\n\n", start + 1) :]
    text = text.replace("  - tune: default", "  - tune: old")
    (toy / "spill.yaml").write_text(text.replace("  - model: tiny", "  - model: old"))
    p = compose(toy)
    t = p.tune
    assert (t.steps, t.valid, t.eval_every, t.keep_best, tuple(t.log)) == (60, None, 10, False, ())
    assert (p.model.quantize, p.model.group_size) == (None, 64)
    (toy / "tune" / "old.yaml").write_text(old_tune.replace("lr: 0.005\n", ""))
    with pytest.raises(ConfigError, match="tune.lr is missing"):
        compose(toy)


def test_compose_key_follows_what_composition_reads(toy):
    key = compose_key(toy)
    assert compose_key(toy) == key
    assert compose_key(toy, ["tune.lr=1"]) != key
    (toy / "spill.yaml").write_text((toy / "spill.yaml").read_text() + "# a comment\n")
    commented = compose_key(toy)
    assert commented != key
    (toy / "tune").mkdir()
    (toy / "tune" / "mine.yaml").write_text("steps: 1\n")
    assert compose_key(toy) != commented
    (toy / "toy.csv").write_text("text,label\n")  # the data is not the config's business
    assert compose_key(toy) == compose_key(toy)


BAD_FILES = {
    "unknown key": (
        "tune:\n  lrr: 1\n",
        "tune.lrr is not a setting spill knows; allowed here: steps, lr",
    ),
    "wrong type": ("tune:\n  lr: fast\n", "tune.lr: 'fast' is not of type 'number'"),
    "not allowed": ("engine:\n  name: cuda\n", "engine.name is 'cuda'; allowed: auto, torch, mlx"),
    "range": ("tune:\n  dropout: 1.5\n", "tune.dropout: 1.5 is greater than or equal to"),
    "top level": ("colour: red\n", "colour is not a setting spill knows; allowed here: defaults"),
    "batch shape": ("tune:\n  batch: 8\n  micro_batch: 3\n", "tune.batch 8 must be a multiple"),
    # AdamW's first step overflows float32 past 1e37 (a traceback before); NaN passes bounds
    "lr overflow": ("tune:\n  lr: 3.0e+38\n", "tune.lr: 3e+38 is greater than the maximum"),
    "lr nan": ("tune:\n  lr: .nan\n", "tune.lr nan: a learning rate is a number above 0"),
    "template": ('prompt:\n  template: "{input} {who}"\n', "prompt.template uses {who}"),
    "no input": ('prompt:\n  template: "hello"\n', "prompt.template: 'hello' does not match"),
    # issue 35 item 12: a format spec or conversion pads or reprs at build time: refused here
    "padding": (
        'prompt:\n  template: "{input} {input:>300000000}"\n',
        "prompt.template has {input:>300000000}; write {input} alone (no format spec",
    ),
    "bad spec": ('prompt:\n  template: "{input} {labels:x}"\n', "prompt.template has {labels:x}"),
    "conversion": ('prompt:\n  template: "{input} {input!r}"\n', "prompt.template has {input!r}"),
    "positional": ('prompt:\n  template: "{input} {}"\n', "prompt.template uses {};"),
    "attribute": (
        'prompt:\n  template: "{input} {input.upper}"\n',
        "prompt.template uses {input.upper}",
    ),
    "brace": ('prompt:\n  template: "{input} }"\n', "prompt.template is not a valid template"),
    "targets": ("tune:\n  targets: q_proj,foo\n", "tune.targets: 'q_proj,foo' does not match"),
    "yaml": ("tune: [1\n", "not valid YAML"),
}


def _merge(doc: dict, extra: dict) -> dict:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(doc.get(key), dict):
            _merge(doc[key], value)
        else:
            doc[key] = value
    return doc


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_schema_invalid_spill_yaml_is_one_line(toy, case):
    text, message = BAD_FILES[case]
    path = toy / "spill.yaml"
    try:
        doc = _merge(yaml.safe_load(path.read_text()), yaml.safe_load(text))
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
    except yaml.YAMLError:
        path.write_text(path.read_text() + text)
    with pytest.raises(ConfigError) as err:
        compose(toy)
    assert message in str(err.value)
    assert "\n" not in str(err.value) and str(toy / "spill.yaml") in str(err.value)


BAD_OVERRIDES = {
    "unknown option": (
        ["tune=nope"],
        "no config option 'tune/nope'; options in tune: all-linear, default, quick",
    ),
    "unknown key": (
        ["tune.lrr=3"],
        "tune.lrr is not a setting spill knows, so it cannot be overridden; allowed in tune: steps",
    ),
    "added key": (["+tune.lrr=3"], "tune.lrr is not a setting spill knows"),
    "missing": (["teacher=custom"], "teacher.name is not set"),
    "syntax": (["tune.lr=[1"], "no viable alternative"),
    "type": (["tune.steps=1e-4"], "tune.steps: 0.0001 is not of type 'integer'"),
}


@pytest.mark.parametrize("case", sorted(BAD_OVERRIDES))
def test_bad_overrides_are_one_line(toy, case):
    overrides, message = BAD_OVERRIDES[case]
    with pytest.raises(ConfigError) as err:
        compose(toy, overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_no_spill_yaml(tmp_path):
    with pytest.raises(ConfigError, match="has no spill.yaml; `spill init"):
        compose(tmp_path)


def documented_builds():
    """``(doc, project, overrides)`` for every ``spill build`` line in the docs' code blocks,
    a sweep expanded into its combinations."""
    import itertools
    import re
    import shlex

    for md in sorted((ROOT / "docs").rglob("*.md")):
        for block in re.findall(r"```[a-z]*\n(.*?)```", md.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.strip().removeprefix("$ ").split(" #")[0]
                if not line.startswith("spill build "):
                    continue
                words = shlex.split(line)[2:]
                folder = words[0] if words and "=" not in words[0] and words[0][0] != "-" else "."
                name = Path(folder).name
                project = (
                    ROOT / "projects" / (name if (ROOT / "projects" / name).is_dir() else "toy")
                )
                overrides = [w for w in words if "=" in w and not w.lstrip("+").startswith("hydra")]
                if "-m" in words:
                    keys = [o.split("=", 1)[0] for o in overrides]
                    values = [o.split("=", 1)[1].split(",") for o in overrides]
                    for combo in itertools.product(*values):
                        yield (
                            md.name,
                            project,
                            [f"{k}={v}" for k, v in zip(keys, combo, strict=True)],
                        )
                else:
                    yield md.name, project, overrides


def test_every_documented_combination_composes_and_validates():
    seen = 0
    for doc, project, overrides in documented_builds():
        try:
            compose(project, overrides)
        except ConfigError as e:
            raise AssertionError(f"{doc}: spill build {project.name} {overrides}: {e}") from None
        seen += 1
    assert seen >= 10  # the docs do mention builds and sweeps
