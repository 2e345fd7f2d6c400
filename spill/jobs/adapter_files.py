"""Adapters on disk: publishing a finished one (``publish_adapter``: spill's layout, the PEFT and
MLX-LM layouts and a loss-curve PNG under ``<state>/adapter/``) and reading one back for ``run`` and
``eval`` (``load_adapter``, ``apply_adapter``).

spill's own layout is ``params.safetensors`` (float32, spill's names) plus ``adapter.json``
(``schema_version``, the LoRA configuration and the base model it was trained on; validated against
``schemas/adapter.schema.json`` on read). An older ``adapter.json`` that is the bare LoRA
configuration, and a tune checkpoint folder (its ``state.json``), are read too.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import spill
from spill.errors import SpillError
from spill.ground.validate import validate
from spill.models import expert_adapters
from spill.models.lora import KNOWN, MODULES, LoraConfig, export_mlx, export_peft
from spill.models.provenance import describe_base
from spill.store.fs import join, put_bytes, remove
from spill.store.location import Location

ADAPTER = "adapter"
# PEFT's stacked expert parameters -> the spill targets they hold
EXPERT_PARAMETERS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
SCHEMA_VERSION = 1


def loss_png(losses: list[float], path: Path, title: str, valid: list[list] | None = None) -> None:
    """The train loss by step, and the validation loss (``[step, loss]`` pairs) when given."""
    import matplotlib  # lazy: matplotlib, only to draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(range(1, len(losses) + 1), [np.nan if x is None else x for x in losses], lw=1.5,
            label="train")  # fmt: skip
    if valid:
        xs, ys = zip(*((s, np.nan if x is None else x) for s, x in valid), strict=True)
        ax.plot(xs, ys, "o-", lw=1.5, ms=3, label="validation")
        ax.legend()
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("loss (completion tokens)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)


def readme(
    base: dict,
    fingerprint: str,
    files: dict[str, str] | None,
    lora,
    steps: int,
    quantization: dict | None = None,
    no_peft: str | None = None,
) -> str:
    """The note beside an export: exactly which base weights the adapter was trained on;
    ``no_peft``: why PEFT's layout is not there."""
    lines = [
        f"# LoRA adapter for {base['name']}",
        "",
        f"Trained by spill {spill.__version__}: rank {lora.rank}, alpha {lora.alpha:g}, "
        f"targets {', '.join(lora.targets)}, {steps} steps.",
        "",
        "## The base weights it was trained on",
        "",
        f"- model: `{base['name']}`, weight fingerprint `{fingerprint}`",
    ]
    if base.get("hub"):
        at = f" at commit `{base['revision']}`" if base.get("revision") else ""
        lines.append(f"- hub repository: `{base['hub']}`{at} (what `peft/` names as its base)")
    if base.get("gguf"):
        lines.append(
            f"- imported from the GGUF file `{base['gguf']}` (sha256 `{base['gguf_sha256']}`), "
            "dequantized exactly: these are not the hub repository's own weights, so the "
            "adapter on the hub's weights computes close to, not exactly, what spill measured"
        )
    if quantization:
        lines.append(
            f"- quantized: {quantization['format']} ({quantization['source']}); the adapter was "
            "trained on these values, so PEFT's layout reproduces spill's numbers on their float "
            "form (`spill.models.sources.quantize.dequantize_folder`) and comes close on the "
            "float model they were made from"
        )
    for name, sha in sorted((files or {}).items()):
        lines.append(f"- `{name}`: sha256 `{sha}`")
    lines += [
        "",
        "## Layouts",
        "",
        "- `params.safetensors` + `adapter.json`: spill's own (`spill run --adapter`, `eval`)",
        f"- `peft/`: not written: {no_peft}"
        if no_peft
        else "- `peft/`: PEFT (`PeftModel.from_pretrained(base, 'peft')`)",
        "- `mlx/`: mlx-lm (`mlx_lm.generate --adapter-path mlx`)",
        "- `loss.png`: the training loss per step",
    ]
    return "\n".join(lines) + "\n"


# PEFT's layout is ``adapter_model.safetensors`` + ``adapter_config.json``, naming the hub
# repository and commit the model name pins as its base (what PEFT can resolve); a ``README.md``
# beside them says which base weights the adapter was trained on (for an imported GGUF: the file and
# its sha256).
def write_local(
    out: Path,
    params: dict[str, np.ndarray],
    lora: LoraConfig,
    model: str,
    fingerprint: str,
    layers: int,
    losses: list[float],
    files: dict[str, str] | None = None,
    quantization: dict | None = None,
    validation: dict | None = None,
) -> Path:
    from safetensors.numpy import save_file  # lazy: safetensors, when used

    out.mkdir(parents=True, exist_ok=True)
    save_file(dict(sorted(params.items())), str(out / "params.safetensors"))
    meta = {
        "schema_version": SCHEMA_VERSION,
        "format": "spill-lora",
        "lora": lora.to_dict(),
        "base_model": model,
        "fingerprint": fingerprint,
        "steps": len(losses),
        **({"quantization": quantization} if quantization else {}),
        **({"validation": validation} if validation else {}),
    }
    (out / "adapter.json").write_text(json.dumps(meta, indent=2) + "\n")
    base = describe_base(model, files)
    if why := expert_adapters.peft_refusal(params):  # a note in its place, the rest written
        (out / "peft").mkdir()
        (out / "peft" / "README.md").write_text(f"No PEFT layout for this adapter: {why}.\n")
    else:
        export_peft(params, lora, base["hub"] or model, out / "peft", base["revision"])
    export_mlx(params, lora, layers, out / "mlx")
    note = readme(base, fingerprint, files, lora, len(losses), quantization, why)
    (out / "README.md").write_text(note)
    title = f"{model} · LoRA r{lora.rank} · {len(losses)} steps"
    loss_png(losses, out / "loss.png", title, (validation or {}).get("losses"))
    return out


# Everything is first written to a local temporary folder by the exporters, then published file by
# file through the store, so an ``s3://`` state gets the same tree as a local one.
def publish_adapter(
    root: Location,
    params,
    lora: LoraConfig,
    model: str,
    fingerprint: str,
    layers: int,
    losses: list[float],
    files: dict[str, str] | None = None,
    quantization: dict | None = None,
    validation: dict | None = None,
) -> str:
    """Write the adapter tree under ``<root>/adapter`` and return its location; ``files``: the
    base's weight files and their sha256, as the run recorded them (for the README);
    ``quantization``: a quantized base's identity (``spill.models.sources.quantize.identity``);
    ``validation``: its losses and which step's adapter this is (``Validation.record``)."""
    target = join(root, ADAPTER)
    remove(target)  # what a publication killed midway left, its temporary files included
    with tempfile.TemporaryDirectory(prefix="spill-adapter-") as tmp:
        local = write_local(
            Path(tmp), params, lora, model, fingerprint, layers, losses, files, quantization,
            validation,
        )  # fmt: skip
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            put_bytes(join(target, *path.relative_to(local).parts), path.read_bytes())
    return target


# --- reading an adapter back ------------------------------------------------------------------


@dataclass(frozen=True)
class Adapter:
    lora: LoraConfig
    params: dict[str, np.ndarray]  # float32, spill's names
    sha256: str  # over the configuration and the tensors: part of a row job's identity


def _damaged(path: Path, why: str) -> SpillError:
    return SpillError(f"{path}: {why}; re-export the adapter or point --adapter at another folder")


def _read_json(path: Path) -> dict:
    try:
        doc = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise _damaged(path, f"not UTF-8 (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise _damaged(path, f"not valid JSON ({e.msg} at line {e.lineno})") from None
    except RecursionError:
        raise _damaged(path, "nested too deeply to be an adapter file") from None
    except OSError as e:
        raise _damaged(path, f"cannot be read ({e.strerror or e})") from None
    if not isinstance(doc, dict):
        raise _damaged(path, f"expected a JSON object, got {type(doc).__name__}")
    return doc


def _read_tensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file  # lazy: safetensors, when used

    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises its own error type for a damaged header
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise _damaged(path, f"not a readable safetensors file ({first})") from None


def _lora_config(doc: dict, where: Path) -> LoraConfig:
    try:
        targets = doc["targets"]
        targets = LoraConfig.parse_targets(
            targets if isinstance(targets, str) else ",".join(targets), KNOWN
        )
        return LoraConfig(
            rank=int(doc["rank"]),
            alpha=float(doc["alpha"]),
            dropout=float(doc.get("dropout", 0.0)),
            targets=targets,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise SpillError(
            f"{where}: not a LoRA configuration ({e}); expected rank, alpha and targets"
        ) from None


def _spill_adapter(folder: Path) -> tuple[LoraConfig, dict[str, np.ndarray]]:
    meta, state = folder / "adapter.json", folder / "state.json"
    if meta.is_file():
        doc = _read_json(meta)
        validate(doc, "adapter", where=str(meta))
        where, doc = meta, doc.get("lora", doc)  # the older form is the bare configuration
    elif state.is_file():  # a tune checkpoint folder
        doc = _read_json(state)
        validate(doc, "checkpoint-state", where=str(state))
        where, doc = state, doc["adapter"]
    else:
        raise SpillError(f"{folder}: params.safetensors without adapter.json; add the LoRA config")
    return _lora_config(doc, where), _read_tensors(folder / "params.safetensors")


def _peft_adapter(folder: Path) -> tuple[LoraConfig, dict[str, np.ndarray]]:
    """PEFT names ``base_model.model.model.layers.<k>.<module>.lora_A.weight`` ``[r, in]``."""
    where = folder / "adapter_config.json"
    cfg = _read_json(where)
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        raise SpillError(f"{where}: target_modules is a pattern; list the module names instead")
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise _damaged(where, "target_modules is not a list of module names")
    stacked = cfg.get("target_parameters") or []  # an MoE model's experts (expert_adapters)
    if not isinstance(stacked, list) or not all(isinstance(t, str) for t in stacked):
        raise _damaged(where, "target_parameters is not a list of parameter names")
    experts = [p for t in stacked for p in EXPERT_PARAMETERS.get(t.rsplit(".", 1)[-1], (t,))]
    lora = _lora_config(
        {
            "rank": cfg.get("r"),
            "alpha": cfg.get("lora_alpha"),
            "dropout": cfg.get("lora_dropout", 0.0),
            "targets": [t.rsplit(".", 1)[-1] for t in targets] + experts,
        },
        where,
    )
    if cfg.get("use_rslora") or cfg.get("use_dora"):
        raise SpillError(f"{where}: rsLoRA and DoRA adapters are not supported; use plain LoRA")
    tensors = _read_tensors(folder / "adapter_model.safetensors")
    params = (
        expert_adapters.unstack_peft(tensors, stacked, lora.rank, str(folder)) if stacked else {}
    )
    for key, value in tensors.items():
        stem, sep, tail = key.rpartition(".lora_")
        if not sep or "layers." not in stem or tail not in ("A.weight", "B.weight"):
            raise SpillError(f"{folder}: unexpected tensor {key!r} in a PEFT LoRA adapter")
        if value.ndim != 2:
            raise _damaged(folder / "adapter_model.safetensors", f"{key} is not a matrix")
        stem = stem[stem.index("layers.") :]
        name = f"{stem}.lora_{'a' if tail[0] == 'A' else 'b'}"
        params[name] = np.ascontiguousarray(value.T.astype(np.float32))  # [r,in] -> [in,r]
    return lora, params


def load_adapter(folder: Path) -> Adapter:
    """An adapter folder in either layout, as float32 params in spill's names and a hash."""
    folder = Path(folder)
    if (folder / "params.safetensors").is_file():
        lora, params = _spill_adapter(folder)
    elif (folder / "adapter_model.safetensors").is_file() and (
        folder / "adapter_config.json"
    ).is_file():
        lora, params = _peft_adapter(folder)
    else:
        raise SpillError(
            f"{folder}: no adapter here; give a folder with params.safetensors + adapter.json "
            "(spill) or adapter_model.safetensors + adapter_config.json (PEFT)"
        )
    known = set(MODULES.values())
    for name in params:
        module = name.split(".", 2)[-1].rsplit(".", 1)[0]
        if module not in known and not expert_adapters.EXPERT.match(name):
            raise SpillError(f"{folder}: tensor {name!r} is not on a LoRA target spill knows")
    h = hashlib.sha256(json.dumps(lora.to_dict(), sort_keys=True).encode())
    for name in sorted(params):
        h.update(name.encode())
        h.update(np.ascontiguousarray(params[name], dtype=np.float32).tobytes())
    return Adapter(lora, params, h.hexdigest())


def apply_adapter(loaded, adapter: Adapter | None) -> None:
    """Make a loaded runner's later ``generate``/``score`` calls use ``adapter`` (None: the base)."""
    if adapter is None:
        return
    if not hasattr(loaded.runner, "use_adapter"):
        raise SpillError(f"the {loaded.runner.info.engine} engine cannot apply adapters yet")
    loaded.runner.use_adapter(adapter.lora, adapter.params)
