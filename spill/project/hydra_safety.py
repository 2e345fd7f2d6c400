"""What a ``hydra:`` tree may do in spill: pick Hydra's own launchers and sweeper and give them
settings that are data; nothing in it may run code or write files of its choosing.

``check`` (a composed config), ``check_sources`` (spill.yaml and the overrides, before Hydra loads
anything) and ``check_sweep`` (each job of a sweep) run before any of it does, and refuse in one
``HydraRefused`` naming the key. Each rule and its reason: docs/sweeps.md, "What spill refuses in
``hydra:``".
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from spill.errors import HydraRefused

# spill.yaml is data (a bundle brings one from elsewhere), yet Hydra runs code from ``hydra:``
# (callbacks, ``_target_``, logging's ``dictConfig``, ``job.env_set``, a ``pkg://`` search path).
SEARCH_PATH = "pkg://spill.conf"  # spill's shipped groups, the one search path a project has

INSTANTIATE = tuple("_target_ _args_ _partial_ _recursive_ _convert_ _call_".split())
PLUGIN_TARGETS = ("hydra.launcher._target_", "hydra.sweeper._target_")
CALLBACKS = "Hydra callbacks run code; spill.yaml is data, so spill refuses them; remove the key"
JOB_NUM = "${hydra.job.num}"
ENV = tuple(  # values that are data: a folder, a number, a switch, a credential
    "SPILL_HOME SPILL_LEASE SPILL_PROGRESS SPILL_PROGRESS_EVERY SPILL_PREEMPT_GRACE "
    "SPILL_PREEMPT_DEADLINE "
    "HF_HUB_OFFLINE CUDA_VISIBLE_DEVICES OMP_NUM_THREADS AWS_ACCESS_KEY_ID "
    "AWS_SECRET_ACCESS_KEY AWS_SESSION_TOKEN AWS_REGION AWS_DEFAULT_REGION".split()
)
# each launcher's settings: the fields of its plugin's config dataclass (a unit test compares)
JOBLIB = tuple(
    "n_jobs backend prefer require verbose timeout pre_dispatch batch_size temp_folder "
    "max_nbytes mmap_mode".split()
)
SUBMITIT = tuple(
    "submitit_folder timeout_min cpus_per_task gpus_per_node tasks_per_node mem_gb nodes name "
    "stderr_to_stdout".split()
)
SLURM = SUBMITIT + tuple(
    "partition qos comment constraint exclude gres cpus_per_gpu gpus_per_task mem_per_gpu "
    "mem_per_cpu account signal_delay_s max_num_timeout additional_parameters "
    "array_parallelism setup".split()
)
PLUGINS = "hydra_plugins.hydra_{0}_launcher.{0}_launcher."
LAUNCHERS = {  # _target_ -> (the hydra/launcher option, its settings, its own rules)
    "hydra._internal.core_plugins.basic_launcher.BasicLauncher": ("basic", (), ()),
    PLUGINS.format("joblib") + "JoblibLauncher": ("joblib", JOBLIB, ("joblib",)),
    PLUGINS.format("ray") + "RayLauncher": ("ray", ("ray",), ("ray",)),
    PLUGINS.format("submitit") + "LocalLauncher": ("submitit_local", SUBMITIT, ("folder",)),
    PLUGINS.format("submitit") + "SlurmLauncher": ("submitit_slurm", SLURM, ("folder", "slurm")),
}
SWEEPERS = {
    "hydra._internal.core_plugins.basic_sweeper.BasicSweeper": (
        "basic",
        ("max_batch_size", "params"),
        ("params",),
    )
}
SBATCH = tuple(  # additional_parameters: resources and scheduling; no file, folder, env or command
    "requeue no-requeue time time-min mem mem-per-cpu mem-per-gpu gpus gpus-per-node "
    "gpus-per-task cpus-per-task cpus-per-gpu ntasks ntasks-per-node nodes exclusive nodelist "
    "exclude constraint partition qos account reservation licenses gres mail-type mail-user "
    "begin deadline dependency hint nice priority wckey comment job-name".split()
)
JOBLIB_BACKENDS = (None, "loky", "multiprocessing", "threading", "sequential")
RAY_INIT = tuple(
    "address num_cpus num_gpus resources object_store_memory namespace ignore_reinit_error "
    "include_dashboard log_to_driver logging_level runtime_env".split()
)
RAY_REMOTE = tuple(
    "num_cpus num_gpus memory max_retries resources accelerator_type max_calls "
    "retry_exceptions scheduling_strategy runtime_env".split()
)
LOGGING = {  # dictConfig's sections -> the keys spill lets an entry of each have
    "formatters": ("format", "datefmt", "style", "validate"),
    "filters": ("name",),
    "handlers": ("class", "level", "formatter", "filters", "stream"),
    "loggers": ("level", "handlers", "propagate", "filters"),
}
STREAMS = ("ext://sys.stdout", "ext://sys.stderr")
HYDRA = (
    tuple(  # HydraConf's fields once composed (hydra/conf/__init__.py; env: the hydra/env group)
        "mode searchpath run sweep hydra_logging job_logging sweeper launcher callbacks help "
        "hydra_help output_subdir overrides job runtime verbose env".split()
    )
)
JOB = tuple("name chdir override_dirname id num config_name env_set env_copy config".split())


DATA = "spill.yaml is data, so spill refuses"
WHY = {  # the end of each refusal's line: what is wrong, and what to do
    "instantiate": "Hydra instantiates a {0} in its tree, which runs code; " + DATA + " it; "
    "remove the key",
    "instantiate_spill": "spill instantiates nothing from spill.yaml; it refuses {0}; remove the key",
    "subdir": "spill reads each job's record back from <sweep dir>/" + JOB_NUM + "; remove the key",
    "output_subdir": "{0!r} is not one folder name inside a job's folder (Hydra writes its copies "
    "of the config there); use null or .hydra",
    "overrides": "{0!r} is not on this command line, and hydra.overrides is Hydra's record of "
    "it, not a setting; remove the key",
    "searchpath": "{0!r} is not spill's own [" + SEARCH_PATH + "]: Hydra imports a pkg:// module "
    "while it loads, and another folder holds config the project does not; put it in the project",
    "target": "{0!r} is not one of the Hydra {1}s spill runs ({2}); pick one with hydra/{1}=NAME",
    "line": "a line break in a launcher's setting can start a line of its job script; "
    "write the value on one line",
    "temp_folder": "joblib writes and removes its memmapped files there; remove the key",
    "backend": "{0!r} is not one of joblib's own backends (loky, multiprocessing, threading, "
    "sequential)",
    "address": "{0!r} is not null, auto or local: the launcher unpickles what the cluster sends "
    "back, so the machine names it (RAY_ADDRESS, or ray start there), not the project",
    "folder": "{0!r} is not inside the sweep folder {1!r}; submitit writes its job files there; "
    "remove the key",
    "setup": "submitit runs these shell lines before each job; " + DATA + " them; set the "
    "environment up in your Slurm account",
    "sbatch": "not an sbatch option spill passes on; only resources and scheduling ({0}), "
    "nothing that names a file, folder, environment or command",
    "env": "a variable can make a job load code (LD_PRELOAD, PYTHONPATH, SPILL_MLX_BLAS), so spill "
    "sets only {0} (plain values); export others in the launching shell (env_copy passes them)",
    "params": "a sweep over Hydra's own settings is not supported; sweep spill's settings",
    "factory": "a factory that logging's dictConfig calls, which runs code; remove the key",
    "ext": "dictConfig imports what {0!r} names; only a handler's stream may be one, "
    "ext://sys.stdout or ext://sys.stderr",
    "handler": "{0!r} is code that logging's dictConfig runs (a FileHandler opens its file for "
    "writing); spill allows only logging.StreamHandler (hydra/job_logging=none or stdout)",
}


def _join(path: str, key: Any) -> str:
    return f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else str(key)


def _entries(node: Any, path: str = "") -> Iterator[tuple[str, Any, Any]]:
    """Every (path, key, value) in nested dicts and lists, depth first."""
    for key, value in node.items() if isinstance(node, dict) else enumerate(node):
        yield _join(path, key), key, value
        if isinstance(value, (dict, list)):
            yield from _entries(value, _join(path, key))


def _inside(folder: Any, top: Any) -> bool:
    if not isinstance(folder, str) or not isinstance(top, str):
        return False
    top = os.path.normpath(top)
    return os.path.commonpath([top, os.path.normpath(os.path.join(top, folder))]) == top


class _Check:
    """One composed config's checks; the first refusal raises."""

    def __init__(self, where: str, overrides: Sequence[str]) -> None:
        self.where = where
        self.given = set(overrides)
        self.sweep_dir: Any = None

    def no(self, path: str, why: str, *args: Any) -> None:
        why = WHY.get(why, why)
        raise HydraRefused(f"{self.where}: {path}: {why.format(*args) if args else why}")

    def keys(self, node: Any, path: str, allowed: Sequence[str], what: str) -> dict:
        """``node`` (a mapping or null) with no key outside ``allowed``."""
        if node is None:
            return {}
        if not isinstance(node, dict):
            self.no(path, "must be a mapping")
        for key in node:
            if key not in allowed:
                known = ", ".join(allowed) or "none"
                self.no(_join(path, key), f"is not {what} spill passes on; allowed: {known}")
        return node

    def instantiate(self, path: str, key: str) -> None:
        if path not in PLUGIN_TARGETS:
            self.no(path, "instantiate" if path.startswith("hydra.") else "instantiate_spill", key)

    def run(self, doc: dict) -> None:
        if isinstance(doc.get("hydra"), dict):  # first: the one refusal that names the entry
            for name in doc["hydra"].get("callbacks") or {}:
                self.no(f"hydra.callbacks.{name}", CALLBACKS)
        for path, key, _ in _entries(doc):
            if key in INSTANTIATE:
                self.instantiate(path, key)
        hydra = self.keys(doc.get("hydra"), "hydra", HYDRA, "a Hydra setting")
        sweep = self.keys(hydra.get("sweep"), "hydra.sweep", ("dir", "subdir"), "a sweep setting")
        self.sweep_dir = sweep.get("dir")
        self.searchpath(hydra.get("searchpath"), "hydra.searchpath")
        self.plugin(hydra.get("launcher"), "hydra.launcher", LAUNCHERS, "launcher")
        self.plugin(hydra.get("sweeper"), "hydra.sweeper", SWEEPERS, "sweeper")
        for name in ("hydra_logging", "job_logging"):
            self.logging(hydra.get(name), f"hydra.{name}")
        job = self.keys(hydra.get("job"), "hydra.job", JOB, "a hydra.job setting")
        self.env(job.get("env_set"), "hydra.job.env_set", job.get("env_copy") or ())
        self.keys(hydra.get("run"), "hydra.run", ("dir",), "a hydra.run setting")
        if sweep.get("subdir", JOB_NUM) != JOB_NUM:
            self.no("hydra.sweep.subdir", "subdir")
        out = hydra.get("output_subdir")
        if out is not None and (not isinstance(out, str) or out in ("", ".", "..") or "/" in out):
            self.no("hydra.output_subdir", "output_subdir", out)
        for kind, lines in (hydra.get("overrides") or {}).items():
            for line in lines or ():
                if line not in self.given:
                    self.no(f"hydra.overrides.{kind}", "overrides", line)

    def searchpath(self, value: Any, path: str) -> None:
        if value not in (None, [], [SEARCH_PATH]):
            self.no(path, "searchpath", value)

    def plugin(self, node: Any, path: str, known: dict, kind: str) -> None:
        if node is None:
            return
        names = ", ".join(name for name, *_ in known.values())
        if not isinstance(node, dict):
            self.no(path, "target", node, kind, names)
        if (target := node.get("_target_")) not in known:
            self.no(f"{path}._target_", "target", target, kind, names)
        name, fields, rules = known[target]
        rest = {k: v for k, v in node.items() if k != "_target_"}
        self.keys(rest, path, fields, f"a setting of Hydra's {name} {kind}")
        for where, _, value in _entries(rest, path) if kind == "launcher" else ():
            if isinstance(value, str) and ("\n" in value or "\r" in value):
                self.no(where, "line")
        for rule in rules:
            getattr(self, f"_{rule}")(node, path)

    def _joblib(self, node: dict, path: str) -> None:
        if node.get("temp_folder") is not None:
            self.no(f"{path}.temp_folder", "temp_folder")
        if node.get("backend") not in (None, "loky", "multiprocessing", "threading", "sequential"):
            self.no(f"{path}.backend", "backend", node["backend"])

    def _ray(self, node: dict, path: str) -> None:
        ray = self.keys(node.get("ray"), f"{path}.ray", ("init", "remote"), "a Ray setting")
        init = self.keys(ray.get("init"), f"{path}.ray.init", RAY_INIT, "a ray.init option")
        remote = self.keys(
            ray.get("remote"), f"{path}.ray.remote", RAY_REMOTE, "a ray.remote option"
        )
        if init.get("address") not in (None, "auto", "local"):
            self.no(f"{path}.ray.init.address", "address", init["address"])
        for part, options in (("init", init), ("remote", remote)):
            where = f"{path}.ray.{part}.runtime_env"
            env = self.keys(options.get("runtime_env"), where, ("env_vars",), "a runtime_env key")
            self.env(env.get("env_vars"), f"{where}.env_vars")

    def _folder(self, node: dict, path: str) -> None:
        if not _inside(node.get("submitit_folder"), self.sweep_dir):
            self.no(
                f"{path}.submitit_folder", "folder", node.get("submitit_folder"), self.sweep_dir
            )

    def _slurm(self, node: dict, path: str) -> None:
        if node.get("setup"):
            self.no(f"{path}.setup", "setup")
        extra = node.get("additional_parameters") or {}
        for key in extra if isinstance(extra, dict) else ["(a list)"]:
            if str(key).replace("_", "-") not in SBATCH:
                self.no(f"{path}.additional_parameters.{key}", "sbatch", ", ".join(SBATCH))

    def _params(self, node: dict, path: str) -> None:
        for key in node.get("params") or {}:
            bare = str(key).lstrip("+~").split("@")[0]  # +hydra.x, ~hydra/y@pkg
            if bare == "hydra" or bare.startswith(("hydra.", "hydra/")):
                self.no(f"{path}.params.{key}", "params")

    def env(self, node: Any, path: str, copied: Sequence[str] = ()) -> None:
        if node is not None and not isinstance(node, dict):
            self.no(path, "must be a mapping")
        for name, value in (node or {}).items():
            if name in copied and os.environ.get(name) == value:
                continue  # env_copy: the launching shell's own value
            if name not in ENV or isinstance(value, (dict, list)):
                self.no(f"{path}.{name}", "env", ", ".join(ENV))

    def logging(self, node: Any, path: str) -> None:
        top = ("version", *LOGGING, "root", "disable_existing_loggers", "incremental")
        conf = self.keys(node, path, top, "a logging setting")
        for where, key, value in _entries(conf, path):
            if key == "()":
                self.no(where, "factory")
            if isinstance(value, str) and value.startswith(("ext://", "cfg://")):
                if key != "stream" or value not in STREAMS:
                    self.no(where, "ext", value)
        for name, handler in (conf.get("handlers") or {}).items():
            if (cls := (handler or {}).get("class")) != "logging.StreamHandler":
                self.no(f"{path}.handlers.{name}.class", "handler", cls)
        for section, allowed in LOGGING.items():
            for name, entry in (conf.get(section) or {}).items():
                self.keys(
                    entry, f"{path}.{section}.{name}", allowed, f"a logging {section[:-1]} key"
                )
        self.keys(conf.get("root"), f"{path}.root", LOGGING["loggers"], "a root logger key")


def check(doc: dict, where: str, overrides: Sequence[str] = ()) -> None:
    """Refuse, in one ``HydraRefused`` line (a ``ConfigError``) naming the key, a composed
    config (plain data, its ``hydra`` tree included) that can run code or write files;
    ``overrides``: the command line."""
    _Check(where, overrides).run(doc)


def check_sources(file: Path, overrides: Sequence[str], where: str) -> None:
    """Refuse what must be refused before Hydra loads anything: a search path in spill.yaml or
    the overrides (Hydra imports a pkg:// one while it loads), and override keys naming code."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    checker = _Check(where, overrides)
    try:  # as Hydra reads it: the file's own hydra.searchpath, resolved
        found = OmegaConf.select(OmegaConf.load(file), "hydra.searchpath")
        found = OmegaConf.to_container(found, resolve=True) if OmegaConf.is_config(found) else found
    except Exception:  # noqa: BLE001 (composing reports a file it cannot read or resolve)
        found = None
    checker.searchpath(found, "hydra.searchpath")
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException:
        return  # composing reports the syntax error
    for override in parsed:
        key = override.key_or_group
        parts = key.split(".")
        if parts[:2] == ["hydra", "callbacks"] and len(parts) > 2:
            checker.no(".".join(parts[:3]), CALLBACKS)
        if key == "hydra/callbacks" and override.value() is not None:
            checker.no(key, CALLBACKS)
        for i, part in enumerate(parts):
            if part in INSTANTIATE:
                checker.instantiate(".".join(parts[: i + 1]), part)
        if key == "hydra.searchpath":
            checker.searchpath(override.value(), "hydra.searchpath")


def plain(node: Any) -> Any:
    """A composed config as plain data, each value resolved where it can be: a value that only
    a job knows (``${hydra.job.num}``) or that is unset (``???``) stays as written."""
    from omegaconf import OmegaConf  # lazy: Hydra, only when composing

    if not OmegaConf.is_config(node):
        return node
    raw = OmegaConf.to_container(node, resolve=False)
    out: Any = [None] * len(raw) if isinstance(raw, list) else {}
    for key in range(len(raw)) if isinstance(raw, list) else list(raw):
        try:
            out[key] = plain(node[key])
        except Exception:  # noqa: BLE001 (an unresolvable value is checked as written)
            out[key] = raw[key]
    return out


def check_sweep(hydra: Any, name: str, overrides: Sequence[str], where: str) -> None:
    """Compose the sweep as ``Hydra.multirun`` will (the master config, then each job's as its
    launcher composes it) and check each, before Hydra instantiates or runs anything of it."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode

    master = hydra.compose_config(name, list(overrides), run_mode=RunMode.MULTIRUN)
    doc = plain(master)
    check(doc, where, overrides)
    params = (doc["hydra"]["sweeper"] or {}).get("params") or {}
    arguments = [*(f"{k}={v}" for k, v in params.items()), *doc["hydra"]["overrides"]["task"]]
    parsed = OverridesParser.create(config_loader=hydra.config_loader).parse_overrides(arguments)
    for batch in BasicSweeper.split_arguments(parsed, None):  # basic: the one sweeper allowed
        for job in batch:
            cfg = hydra.config_loader.load_sweep_config(master, list(job))
            check(plain(cfg), f"{where}: job {','.join(job)}", [*overrides, *arguments, *job])
