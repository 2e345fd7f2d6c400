"""``spill.yaml`` -> a frozen ``Project``: the one place that composes with Hydra and validates.

``compose(root, overrides)`` composes the project folder (its group folders before spill's
``conf/``, where every default lives), refuses an unsafe ``hydra:`` tree (``hydra_safety``),
validates against ``schemas/spill-yaml.schema.json`` and freezes the settings dataclasses;
every error is one ``ConfigError`` line naming the key. ``from_record`` rebuilds the
``Project`` a build recorded under the same ``compose_key`` (``spill.project.sources``).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from spill import conf
from spill.errors import BadOverride, ConfigError, HydraRefused
from spill.ground.validate import load_schema, short
from spill.project import hydra_safety
from spill.project.data import template_problem
from spill.project.hydra_safety import SEARCH_PATH  # noqa: F401  (init writes it into projects)
from spill.project.sources import (
    FILE,
    compose_key,  # noqa: F401  (part of this boundary's API)
    project_files,
)
from spill.settings import (
    GROUPS,
    PREFERENCE,
    VALIDATION,
    DataSettings,
    EngineSettings,
    EvalSettings,
    ExportSettings,
    ModelSettings,
    PromptSettings,
    TeacherSettings,
    TuneSettings,
)

CONFIG_NAME = "spill"
SCHEMA = "spill-yaml"
SECTIONS = ("data", "model", "teacher", "tune", "eval", "engine", "prompt", "export")
# spill's own Hydra settings, before the user's overrides: no logging, no .hydra/ copies
SILENT = ("hydra/job_logging=none", "hydra/hydra_logging=none", "hydra.output_subdir=null")


@dataclass(frozen=True)
class Project:
    root: Path  # the project folder (absolute)
    schema_version: int
    name: str
    id: str | None
    seed: int
    data: DataSettings
    model: ModelSettings
    teacher: TeacherSettings
    tune: TuneSettings
    eval: EvalSettings
    engine: EngineSettings
    prompt: PromptSettings
    export: ExportSettings
    overrides: tuple[str, ...] = field(default=())

    @property
    def data_path(self) -> Path:
        return self.root / self.data.file

    def to_dict(self) -> dict[str, Any]:
        """The composed config as plain data (what spill.yaml and the overrides amount to)."""
        doc = asdict(self)
        for key in ("root", "overrides"):
            doc.pop(key)
        if doc["id"] is None:
            doc.pop("id")
        for section in doc.values():  # a frozen list setting (tune.log) is a list again
            if isinstance(section, dict):
                section.update({k: list(v) for k, v in section.items() if isinstance(v, tuple)})
        return doc


def from_record(doc: dict[str, Any], root: Path, overrides: Sequence[str] = ()) -> Project:
    """A ``Project`` from a composed config this module validated before (a build's record).
    A record made before quantized bases names no ``quantize``: its models were float, and
    the shipped group size fills in the setting that then decides nothing; so do the shipped
    defaults of tune settings added later (validation, trackers: off by default) and of the
    export group (no formats: no export stage)."""
    doc = with_later(doc)
    sections = {k: GROUPS[k](**doc[k]) for k in SECTIONS}
    return Project(
        Path(root).resolve(),
        doc["schema_version"],
        doc["name"],
        doc.get("id"),
        doc["seed"],
        **sections,
        overrides=tuple(overrides),
    )


def _before_quantization(group: str, section: dict[str, Any]) -> dict[str, Any]:
    if "quantize" in section:
        return section
    return {**section, "quantize": None, "group_size": conf.defaults(group)["group_size"]}


# the settings added after spill.yaml's first release: validation, trackers, the export group,
# the packed matmul, preference tuning (tune.method, tune.beta, data.rejected)
LATER = {
    "tune": (*VALIDATION, "log", *PREFERENCE),
    "data": ("rejected",),
    "export": tuple(f.name for f in fields(ExportSettings)),
    "engine": ("packed_matmul",),
}


def with_later(doc: dict[str, Any]) -> dict[str, Any]:
    """A composed config or a record with the settings added after spill.yaml's first release
    filled in where it lacks them (a record made before them, or a project's own group file
    written before them), with the shipped defaults, under which they change nothing; every
    other key stays required. The shipped defaults (YAML) are read only when a key is missing."""
    groups = [k for k in ("model", "teacher") if isinstance(doc.get(k), dict)]
    out = {**doc, **{k: _before_quantization(k, doc[k]) for k in groups}}
    if "export" not in out:  # the group came later: spill.yaml's ``export:`` is optional
        out["export"] = {}
    for group, keys in LATER.items():
        section = out.get(group)
        if isinstance(section, dict) and (missing := [k for k in keys if k not in section]):
            shipped = conf.defaults(group)
            out[group] = {**{k: shipped[k] for k in missing}, **section}
    return out


# --- validation --------------------------------------------------------------------------------


def _strict(schema: dict) -> dict:
    """The schema with every section and every key in it required (a composed config)."""
    out = copy.deepcopy(schema)
    out["required"] = ["schema_version", "name", "seed", *SECTIONS]
    for name in SECTIONS:
        section = out["properties"][name]
        section["required"] = list(section["properties"])
    return out


def _path(parts) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top level)"


def _message(error, schema: dict) -> str:
    """One line for a jsonschema error: the key path, what is wrong, what is allowed."""
    parts = list(error.absolute_path)
    where = _path(parts)
    sub = schema
    for p in parts:
        sub = sub.get("properties", {}).get(p, {}) if isinstance(p, str) else sub.get("items", {})
    if error.validator == "required":
        missing = error.message.split("'")[1]
        key = _path([*parts, missing])
        hint = f"pick a {missing} option in defaults" if not parts else "set it"
        return f"{key} is missing; {hint} (spill's conf/ options define every key)"
    if error.validator == "additionalProperties":
        allowed = ", ".join(sub.get("properties", {}))
        unknown = sorted(set(error.instance) - set(sub.get("properties", {})))
        key = _path([*parts, unknown[0]]) if unknown else where
        return f"{key} is not a setting spill knows; allowed here: {allowed}"
    if error.validator == "enum":
        allowed = ", ".join("null" if v is None else str(v) for v in error.validator_value)
        return f"{where} is {short(repr(error.instance), 40)}; allowed: {allowed}"
    described = sub.get("description")
    return f"{where}: {short(error.message)}" + (f" ({described})" if described else "")


def validate(doc: Any, where: str, strict: bool = True) -> None:
    """Raise ``ConfigError`` naming the first problem's key path; ``strict``: a composed config."""
    from jsonschema import Draft202012Validator  # lazy: jsonschema, when validating
    from jsonschema.exceptions import best_match

    schema = load_schema(SCHEMA)
    checked = _strict(schema) if strict else schema
    error = best_match(Draft202012Validator(checked).iter_errors(doc))
    if error is not None:
        raise ConfigError(f"{where}: {_message(error, checked)}")
    if not strict:
        return
    tune = TuneSettings(**doc["tune"])
    if why := tune.problem(lambda key: f"tune.{key}"):
        raise ConfigError(f"{where}: {why}")
    export = ExportSettings(**doc["export"])
    if why := export.problem(lambda key: f"export.{key}"):
        raise ConfigError(f"{where}: {why}")
    if tune.keep_best and tune.valid is None:
        raise ConfigError(
            f"{where}: tune.keep_best picks by validation loss; set tune.valid (rows or a "
            "fraction of the training split) too"
        )
    if why := template_problem(doc["prompt"]["template"]):
        raise ConfigError(f"{where}: prompt.template {why}")


# --- composition -------------------------------------------------------------------------------


def hydra_line(e: BaseException) -> str:
    """Hydra's and OmegaConf's multi-line messages as one line."""
    text = str(e)
    if "Could not find" in text and "Available options" in text:
        head, _, rest = text.partition("Available options in ")
        group, _, options = rest.partition(":")
        found = [o.strip() for o in options.split("Config search path")[0].split() if o.strip()]
        what = head.split("Could not find", 1)[1].strip().strip("'")
        return f"no config option {what!r}; options in {group.strip(chr(39))}: {', '.join(found)}"
    if text.startswith("Could not override '"):
        key = text.split("'")[1]
        section = key.split(".")[0]

        known = load_schema(SCHEMA)["properties"].get(section, {}).get("properties")
        allowed = f"; allowed in {section}: {', '.join(known)}" if known else ""
        return f"{key} is not a setting spill knows, so it cannot be overridden{allowed}"
    key = re.search(r"full_key: *(\S*)", text)
    if key and key[1] and not key[1].startswith("object_type="):
        key = key[1]
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        composing = len(lines) > 1 and lines[0].endswith("while composing config:")
        first = short(lines[1] if composing else lines[0], 300)
        if "Missing mandatory value" in first:
            return f"{key} is not set (the chosen option leaves it to the project); set it"
        return f"{key}: {first}"
    skip = ("https://", "full_key:", "object_type=")
    lines = [
        ln.strip()
        for ln in text.splitlines()
        if ln.strip() and not ln.strip().startswith(skip) and "https://" not in ln
    ]
    return short(" ".join(lines), 300) or type(e).__name__


def compose(root: Path | str, overrides: Sequence[str] = ()) -> Project:
    """Compose ``<root>/spill.yaml`` with ``overrides`` and validate it (the Hydra boundary).
    A failure that the project without the overrides does not have is the command line's
    (``BadOverride``, exit 2); a ``hydra:`` setting refused as code stays a refusal."""
    try:
        return _compose(root, overrides)
    except HydraRefused:
        raise
    except ConfigError as e:
        if not overrides:
            raise
        try:
            _compose(root, ())
        except ConfigError:
            raise e from None  # the project itself fails: that says more than the override
        raise BadOverride(str(e)) from None


def _compose(root: Path | str, overrides: Sequence[str]) -> Project:
    root = Path(root).resolve()
    where = f"{root / FILE}"
    if not (root / FILE).is_file():
        raise ConfigError(
            f"{root} has no {FILE}; `spill init DATA --input COL --output COL --project {root}` "
            "makes one"
        )
    check_encoding(root)
    from hydra import compose as hydra_compose  # lazy: Hydra, only when composing
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf, open_dict
    from omegaconf.errors import OmegaConfBaseException
    from yaml import YAMLError

    given = [*SILENT, *for_hydra(root, overrides)]  # the hydra tree as a sweep would have it
    hydra_safety.check_sources(root / FILE, given, where)
    try:
        with initialize_config_dir(config_dir=str(root), version_base="1.3", job_name="spill"):
            cfg = hydra_compose(CONFIG_NAME, given, return_hydra_config=True)
        hydra_safety.check(hydra_safety.plain(cfg), where, given)
        with open_dict(cfg):
            del cfg["hydra"]
        doc = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = getattr(mark, "name", None) or getattr(e, "name", None) or where
        raise ConfigError(f"{where}: not valid YAML ({short(str(e), 300)})") from None
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(f"{where}: {hydra_line(e)}") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply to be a spill.yaml") from None
    except (
        ValueError,
        TypeError,
        KeyError,
        AttributeError,
        AssertionError,
        IndexError,
        OSError,
    ) as e:
        # Hydra's own code raises these on a malformed defaults list or hydra section
        what = f"{type(e).__name__}: {short(str(e), 200)}"
        raise ConfigError(
            f"{where}: Hydra cannot compose it ({what}); check its defaults"
        ) from None
    return from_composed(doc, root, overrides, where)


def for_hydra(root: Path, overrides: Sequence[str]) -> list[str]:
    """The overrides as Hydra is given them. A setting added after the first release (``LATER``)
    may be missing from a project's own group file or its ``export:``: it is set with ``++``
    (added, or overridden where present); ``export=OPTION`` appends the group (``+``) when the
    defaults list does not name it. Records keep the overrides as the user wrote them."""
    later = tuple(f"{g}.{k}=" for g, keys in LATER.items() for k in keys)
    out = []
    for o in overrides:
        if o.startswith(later):
            o = "++" + o
        elif o.startswith("export=") and "export" not in _listed(root):
            o = "+" + o
        out.append(o)
    return out


def _listed(root: Path) -> set[str]:
    """The groups spill.yaml's defaults list names (an unreadable file names none: Hydra says
    what is wrong with it)."""
    import yaml  # lazy: PyYAML, when used

    try:
        doc = yaml.safe_load((root / FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        return set()
    items = doc.get("defaults") if isinstance(doc, dict) else None
    return {k for i in items or [] if isinstance(i, dict) for k in i}


def check_encoding(root: Path) -> None:
    """Refuse, naming the file and the byte, a project file that is not UTF-8 (Hydra would
    raise a traceback from deep inside its config source); cheap: these files are small."""
    for path in project_files(root):
        try:
            path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"{path}: byte {e.object[e.start]:#04x} at offset {e.start} is not UTF-8; "
                "save the file as UTF-8"
            ) from None
        except OSError as e:
            raise ConfigError(f"{path}: cannot be read ({e.strerror})") from None


def from_composed(
    doc: Any, root: Path | str, overrides: Sequence[str] = (), where: str | None = None
) -> Project:
    """Validate a composed config (a plain dict) and freeze it; Hydra's sweeps come in here."""
    root = Path(root).resolve()
    if not isinstance(doc, dict):
        doc = _to_container(doc, where or str(root / FILE))
    doc = {k: v for k, v in doc.items() if k != "hydra"}
    doc.setdefault("schema_version", 1)
    doc = with_later(doc)
    validate(doc, where or str(root / FILE))
    return from_record(doc, root, overrides)


def _to_container(cfg: Any, where: str) -> dict:
    from omegaconf import OmegaConf  # lazy: Hydra, only when composing
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{where}: {hydra_line(e)}") from None
