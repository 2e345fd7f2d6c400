"""What a tune checkpoint commit costs against a plain fsync'd write of the same bytes (issue 13),
for docs/reports/011-speed-tune.md. Both sides run in one process, alternating; nothing here
asserts a time.

    python bench/checkpoint.py [--rounds 7] [--dir DIR] [--json OUT]

The checkpoint: SmolLM2-135M's LoRA rank 16 on all seven linears (4.9M float32 parameters,
random), its AdamW moments m and v, and a state.json like tune's. ``spill`` is the real path,
``spill.payloads.checkpoint.save_checkpoint`` on the place of a run this process holds (as
``spill tune`` does): the safetensors layout written from the arrays' memory while two threads
hash it (sha256), params, opt and state.json fsynced, COMMIT written atomically (temp file,
fsync, rename, fsync of the folder), the run's control object moved to it (flock, fsync'd
replace). The older checkpoint folders (two are kept) are removed on a background thread after
the save returns: the bench waits for that removal outside the timed span (so it never overlaps
the baseline) and reports its time apart. The baseline writes the very bytes spill wrote (params, opt, state.json and
COMMIT, read back from spill's folder before timing) to a fresh folder: ``open``, ``write``,
``fsync`` per file and one ``fsync`` of the folder; no encoding, hashing, rename or control.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

HIDDEN, INTER, HEADS, KV, HEAD_DIM, LAYERS, RANK = 576, 1536, 9, 3, 64, 30, 16  # SmolLM2-135M


def arrays():
    import numpy as np

    from spill.models.config import parse_config
    from spill.models.lora import ALL_LINEAR, LoraConfig, init_params

    cfg = parse_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": HIDDEN,
            "intermediate_size": INTER,
            "num_attention_heads": HEADS,
            "num_key_value_heads": KV,
            "head_dim": HEAD_DIM,
            "num_hidden_layers": LAYERS,
            "vocab_size": 49152,
            "rms_norm_eps": 1e-5,
            "rope_theta": 100000.0,
            "tie_word_embeddings": True,
        }
    )
    lora = LoraConfig(rank=RANK, alpha=2 * RANK, targets=ALL_LINEAR)
    params = init_params(cfg, lora, 0)
    rng = np.random.default_rng(0)
    opt = {}
    for name, p in params.items():
        opt[f"m::{name}"] = rng.normal(0, 1e-3, p.shape).astype(np.float32)
        opt[f"v::{name}"] = rng.uniform(0, 1e-6, p.shape).astype(np.float32)
    return lora, params, opt


def state_doc(lora, step: int) -> dict:
    return {
        "model": {"id": "smollm2:135m", "fingerprint": "sha256:" + "0" * 64},
        "seed": 0,
        "adapter": lora.to_dict(),
        "hyperparameters": {"lr": 1e-4, "steps": 1000, "batch": 4, "micro_batch": 4},
        "step": step,
        "cursor": step,
        "losses": [1.0] * step,
        "producers": [],
        "train_file": "train.jsonl",
    }


def plain_write(folder: Path, blobs: dict[str, bytes]) -> None:
    folder.mkdir(parents=True)
    for name, data in blobs.items():
        fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    from spill.jobs.authority import hold
    from spill.payloads.checkpoint import COMMIT, FILES, save_checkpoint, settle

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "spill-bench-ckpt")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    shutil.rmtree(a.dir, ignore_errors=True)
    a.dir.mkdir(parents=True)
    os.environ.setdefault("SPILL_HOME", str(a.dir / "home"))
    lora, params, opt = arrays()
    times: dict[str, list[float]] = {"spill": [], "plain": [], "removal": []}
    size = 0
    with hold(str(a.dir / "state"), None) as held:
        place = held.writable("bench")
        first = save_checkpoint(place, 1, params, opt, state_doc(lora, 1))  # warm: imports
        blobs = {n: Path(first, n).read_bytes() for n in (*FILES, COMMIT)}
        size = sum(len(b) for b in blobs.values())
        for r in range(a.rounds):
            for side in ("spill", "plain") if r % 2 == 0 else ("plain", "spill"):
                step = 2 + r
                # removals (spill's older folder, the baseline's last copy) are committed here,
                # untimed: on a filesystem mounted with discard their trims land in the next
                # journal commit, i.e. in whichever side fsyncs next
                os.sync()
                t = time.perf_counter()
                if side == "spill":
                    save_checkpoint(place, step, params, opt, state_doc(lora, step))
                else:
                    plain_write(a.dir / "plain" / str(step), blobs)
                times[side].append(time.perf_counter() - t)
                if side == "spill":  # the background removal of older folders, untimed above
                    t = time.perf_counter()
                    settle(place)
                    times["removal"].append(time.perf_counter() - t)
            shutil.rmtree(a.dir / "plain" / str(2 + r))
    ratios = [p / s for s, p in zip(times["spill"], times["plain"], strict=True)]
    mb = size / 1e6
    for side in ("spill", "plain"):
        med = statistics.median(times[side])
        print(f"{side}: median {med * 1e3:.0f} ms for {mb:.1f} MB ({mb / med:.0f} MB/s)")
    removal = statistics.median(times["removal"]) * 1e3
    print(f"spill's removal of the older folder, after the save returned: median {removal:.0f} ms")
    print(
        f"spill commit vs plain fsync'd write: {statistics.median(ratios):.2f}x "
        f"(per round {', '.join(f'{x:.2f}' for x in ratios)}; goal >= 0.8x)"
    )
    if a.json:
        doc = {
            "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
            "bytes": size,
            "seconds": times,
            "ratio_per_round": ratios,
            "ratio_median": statistics.median(ratios),
            "load_average": os.getloadavg()[0],
        }
        a.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
