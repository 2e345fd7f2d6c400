"""What ``spill export`` costs per format against moving the same bytes (issue 25): the
embedded SmolLM2-135M (``smollm2:135m@f32``, its float32 import) with a rank-8 adapter on
every linear, exported as each format; the baseline reads the base's weight files once
(``cat > /dev/null``) and copies the export's output folder (``cp -r``), the bytes an export
must at least read and write. Sides alternate per round, the page cache warm for both;
nothing here asserts a time.

    python bench/export.py [--rounds 3] [--formats hf:bf16,gguf:f16,...] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PY = sys.executable
ROOT = Path(__file__).resolve().parents[1]
FORMATS = "hf:f32,hf:bf16,gguf:f32,gguf:f16,gguf:q8_0,gguf:q4_0,mlx:bf16,mlx:4"
BASE = "smollm2:135m@f32"
ADAPTER = """
import json, sys
from pathlib import Path
import numpy as np
from spill.jobs.adapter_files import write_local
from spill.jobs.loading import find_model
from spill.models.config import load_config
from spill.models.lora import ALL_LINEAR, LoraConfig, init_params
resolved, fp = find_model(sys.argv[1], None)
cfg = load_config(Path(resolved.folder))
lora = LoraConfig(rank=8, targets=ALL_LINEAR)
params = init_params(cfg, lora, seed=0)
rng = np.random.default_rng(0)
for name in params:
    if name.endswith("lora_b"):  # a trained adapter's B is not zero
        params[name] = rng.normal(0, 0.01, params[name].shape).astype(np.float32)
write_local(Path(sys.argv[2]), params, lora, sys.argv[1], fp, cfg.num_hidden_layers, [1.0])
print(json.dumps([str(resolved.folder), fp]))
"""


def run(cmd: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    return time.perf_counter() - t0


def export_args(fmt: str, adapter: Path, out: Path) -> list[str]:
    kind, what = fmt.split(":")
    args = [PY, "-m", "spill", "export", str(adapter), str(out), "--format", kind]
    dtype = what if what in ("f32", "bf16", "f16") else "f16" if kind == "gguf" else "bf16"
    args += ["--dtype", dtype]
    if what not in ("f32", "bf16", "f16"):
        args += ["--quantize", what]
    return args


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--formats", default=FORMATS)
    ap.add_argument("--json", metavar="OUT")
    a = ap.parse_args()
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="spill-bench-export-"))
    try:
        env = {**os.environ, "SPILL_HOME": str(work / "home"), "HF_HUB_OFFLINE": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        t = run([PY, "-m", "spill", "models", "import", "smollm2:135m", "--dequantize"], env)
        print(f"imported {BASE} in {t:.1f} s (not timed)", flush=True)
        made = subprocess.run(
            [PY, "-c", ADAPTER, BASE, str(work / "adapter")],
            env=env, check=True, capture_output=True, text=True,
        )  # fmt: skip
        base, _ = json.loads(made.stdout.strip().splitlines()[-1])
        shards = sorted(str(p) for p in Path(base).glob("*.safetensors"))
        base_bytes = sum(Path(s).stat().st_size for s in shards)
        print(f"base {base_bytes / 1e6:.1f} MB in {len(shards)} shard(s)", flush=True)
        rows = []
        for fmt in a.formats.split(","):
            spill_t, copy_t, out_bytes = [], [], 0
            for i in range(a.rounds):
                out, copy = work / "out", work / "copy"
                for side in ("spill", "cp") if i % 2 == 0 else ("cp", "spill"):
                    if side == "spill":
                        shutil.rmtree(out, ignore_errors=True)
                        spill_t.append(run(export_args(fmt, work / "adapter", out), env))
                        out_bytes = folder_bytes(out)
                    elif out.is_dir():
                        shutil.rmtree(copy, ignore_errors=True)
                        t = run(["sh", "-c", 'cat "$@" > /dev/null', "sh", *shards], env)
                        copy_t.append(t + run(["cp", "-r", str(out), str(copy)], env))
                    else:  # the first round's cp side: nothing to copy yet
                        shutil.rmtree(out, ignore_errors=True)
                        run(export_args(fmt, work / "adapter", out), env)
                        shutil.rmtree(copy, ignore_errors=True)
                        t = run(["sh", "-c", 'cat "$@" > /dev/null', "sh", *shards], env)
                        copy_t.append(t + run(["cp", "-r", str(out), str(copy)], env))
            s, c = statistics.median(spill_t), statistics.median(copy_t)
            row = {"format": fmt, "out_mb": round(out_bytes / 1e6, 1), "export_s": round(s, 2)}
            row |= {"read+cp_s": round(c, 3), "ratio": round(s / c, 1)}
            rows.append(row)
            print(
                f"{fmt:10s} {row['out_mb']:8.1f} MB  export {s:6.2f} s  read+cp {c:6.3f} s"
                f"  ratio {s / c:5.1f}x",
                flush=True,
            )
        result = {
            "base": BASE,
            "base_mb": round(base_bytes / 1e6, 1),
            "rounds": a.rounds,
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "load_before": load_before,
            "load_after": os.getloadavg(),
            "rows": rows,
        }
        if a.json:
            Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
