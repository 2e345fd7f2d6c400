"""A finished adapter on disk or on a store: spill's layout, the PEFT and MLX-LM layouts, and a
loss-curve PNG, all under ``<state>/adapter/``.

spill's own layout is ``params.safetensors`` (float32, spill's names) plus ``adapter.json``
(the LoRA configuration and the base model it was trained on). Everything is first written to
a local temporary folder by the exporters, then published file by file through the store, so
an ``s3://`` state gets the same tree as a local one.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np

from spill.models.lora import LoraConfig, export_mlx, export_peft
from spill.store.fs import join, put_bytes, remove

ADAPTER = "adapter"


def loss_png(losses: list[float], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(range(1, len(losses) + 1), [np.nan if x is None else x for x in losses], lw=1.5)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("loss (completion tokens)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)


def write_local(
    out: Path,
    params: dict[str, np.ndarray],
    lora: LoraConfig,
    model: str,
    fingerprint: str,
    layers: int,
    losses: list[float],
) -> Path:
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(dict(sorted(params.items())), str(out / "params.safetensors"))
    meta = {
        "format": "spill-lora",
        "lora": lora.to_dict(),
        "base_model": model,
        "fingerprint": fingerprint,
        "steps": len(losses),
    }
    (out / "adapter.json").write_text(json.dumps(meta, indent=2) + "\n")
    export_peft(params, lora, model, out / "peft")
    export_mlx(params, lora, layers, out / "mlx")
    loss_png(losses, out / "loss.png", f"{model} · LoRA r{lora.rank} · {len(losses)} steps")
    return out


def publish_adapter(
    root: str,
    params,
    lora: LoraConfig,
    model: str,
    fingerprint: str,
    layers: int,
    losses: list[float],
) -> str:
    """Write the adapter tree under ``<root>/adapter`` and return its location."""
    target = join(root, ADAPTER)
    remove(target)  # what a publication killed midway left, its temporary files included
    with tempfile.TemporaryDirectory(prefix="spill-adapter-") as tmp:
        local = write_local(Path(tmp), params, lora, model, fingerprint, layers, losses)
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            put_bytes(join(target, *path.relative_to(local).parts), path.read_bytes())
    return target
