"""Quantized bases against float ones (issue 22), for docs/reports/013-quantized.md. Sides
alternate within each round; ratios are printed; nothing here asserts a time.

    python bench/quant.py bytes|generate|qlora|mlx|quality|float-rss [--rounds 1] [--json OUT]

Models live in this bench's own ``SPILL_HOME`` (``--home``), made on first use: the float
import (``--dequantize``, ``@f32``), the kept GGUF (``@q4_1``) and a 4-bit g64 copy (``@q4g64``).

* ``bytes``: one scoring pass (4 x 128 tokens) of SmolLM2, ``--ring 2``, float32 compute, the
  float import vs ``@q4_1``: bytes the runner's reader took from the files during the pass
  (``ShardFiles.pread`` and ``ShardFiles.map`` counted in process; resident parts are loaded at
  open and not counted) and the pass time.
* ``generate``: a generated llama (``tiny:llama:0:<layers>x<hidden>``) and its ``spill models
  quantize --bits 4`` copy, all opened with ``--memory`` = the float32 model / 8: the float
  model and the 4-bit copy in float32 compute, and the 4-bit copy with ``--packed-matmul``
  (torch's int4 kernel, bfloat16): decode tokens/s (a generate of ``--new`` + 1 tokens minus
  one of 1: the prefill cancels) and bytes read per decode step (counted as above), each side
  twice a round: from the page cache, and cold (every read evicts its range first, so every
  pass reads the disk, as for a model larger than memory). The read bound is those bytes / the
  sequential read rate of the quantized files in the same regime (``bench/generate.py``'s
  ``read_rate``, after ``POSIX_FADV_DONTNEED`` for cold); the fraction reached is bound time /
  step time.
* ``qlora``, ``mlx``: see ``bench/quant_tune.py`` (spill tune vs PEFT + bitsandbytes and vs
  ``mlx_lm.lora``, in fresh processes).
* ``quality``: ``spill build projects/tickets`` (a fresh copy, its own state) on the float
  import (``model.name=smollm2:135m@f32``), on the README's embedded model (``smollm2:135m``:
  the GGUF's Q4_1, kept) and on the float import's 4-bit g64 copy (``model.quantize=4``), in
  the measured default numerics; each quantized side's scores beside the float side's and
  report 009's noise floor (``--sides float,q4_1`` picks).
* ``float-rss``: ``bench/tune.py``'s ``peft f32`` and ``spill ring2 f32`` sides (ring-2 float
  tune peak RSS vs PEFT), called rather than copied.

``--json`` merges each subcommand's result into the file under its name (one report).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import quant_tune  # noqa: E402
from bench.generate import generate_all, load_average, open_runner, read_rate  # noqa: E402

PY = sys.executable
SMOL, SMOL_Q = "smollm2:135m@f32", "smollm2:135m@q4_1"  # the float import, the kept GGUF
NOISE = REPO / "docs" / "reports" / "009-noise-floor.json"


def spill_cli(home: Path, *args: str, python: str = PY) -> str:
    """Run ``spill ARGS`` with this bench's home (from ``home``, so ``-m`` imports the
    interpreter's own spill or ``REPO`` on PYTHONPATH, never a stray checkout); stdout."""
    env = quant_tune.env_for(home, None, REPO)
    proc = subprocess.run([python, "-m", "spill", *args], env=env, cwd=home, capture_output=True,
                          text=True)  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"spill {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.stdout


def folder_of(name: str) -> Path:
    from spill.models.resolve import resolve_model

    return Path(resolve_model(name, None).folder)


def ensure_models(home: Path) -> None:
    """The float import, the kept Q4_1 copy and spill's own 4-bit g64 copy, once."""
    models = home / "models"
    if not (models / "smollm2-135m" / "config.json").is_file():
        spill_cli(home, "models", "import", "smollm2:135m", "--dequantize")
    if not (models / "smollm2-135m-q4_1" / "config.json").is_file():
        spill_cli(home, "models", "import", "smollm2:135m")
    if not (models / "quantized" / "smollm2-135m-f32-q4g64" / "config.json").is_file():
        spill_cli(home, "models", "quantize", SMOL, "--bits", "4", "--group-size", "64")


class ByteCounter:
    """Counts the bytes spill's shard reader reads or maps, in this process; with ``cold`` set,
    each read first evicts its range from the page cache (``POSIX_FADV_DONTNEED``), so every
    pass reads from the disk, as it does when the model is larger than the machine's memory."""

    def __init__(self) -> None:
        from spill.engines.core.reader import ShardFiles

        self.n = 0
        self.cold = False
        pread, mapped = ShardFiles.pread, ShardFiles.map

        def counted_pread(this, fd, buffers, offset, shard):
            nbytes = sum(memoryview(b).nbytes for b in buffers)
            self.n += nbytes
            if self.cold:
                os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
            return pread(this, fd, buffers, offset, shard)

        def counted_map(this, r):
            self.n += r.nbytes
            if self.cold:
                os.posix_fadvise(r.fd, r.start, r.nbytes, os.POSIX_FADV_DONTNEED)
            return mapped(this, r)

        ShardFiles.pread, ShardFiles.map = counted_pread, counted_map


def weight_bytes(folder: Path) -> int:
    from spill.models.weights import weight_files

    return sum((folder / s).stat().st_size for s in weight_files(folder).shards)


# --- bytes: one streamed scoring pass, float import vs kept Q4_1 --------------------------------


def bench_bytes(a, home: Path) -> dict:
    counter = ByteCounter()
    rng = np.random.default_rng(0)
    sides = {"float": folder_of(SMOL), "q4_1": folder_of(SMOL_Q)}
    runners = {k: open_runner(f, ring=a.ring, dtype="float32") for k, f in sides.items()}
    for k, r in runners.items():
        print(f"bytes: {k}: {r.info.line()}", flush=True)
    vocab = 49152
    ids = [rng.integers(3, vocab, size=a.length) for _ in range(a.rows)]
    prompts, completions = [x[:1] for x in ids], [x[1:] for x in ids]
    for r in runners.values():  # warm-up: the page cache, the slot pool
        r.score(prompts, completions)
    got: dict[str, list[dict]] = {k: [] for k in sides}
    for rnd in range(a.rounds):
        for k in list(sides) if rnd % 2 == 0 else list(sides)[::-1]:
            before, t = counter.n, time.perf_counter()
            runners[k].score(prompts, completions)
            row = {"bytes": counter.n - before, "seconds": round(time.perf_counter() - t, 3)}
            got[k].append(row)
            print(f"  round {rnd + 1} {k}: {row['bytes'] / 1e6:.1f} MB in {row['seconds']} s")
    for r in runners.values():
        r.close()
    best = {k: min(v, key=lambda x: x["seconds"]) for k, v in got.items()}
    ratios = {
        "bytes float/q4_1": best["float"]["bytes"] / best["q4_1"]["bytes"],
        "pass time float/q4_1": best["float"]["seconds"] / best["q4_1"]["seconds"],
        "weight files float/q4_1": weight_bytes(sides["float"]) / weight_bytes(sides["q4_1"]),
    }
    for k, v in ratios.items():
        print(f"bytes: {k} = {v:.2f}x", flush=True)
    return {
        "ring": a.ring,
        "rows": a.rows,
        "length": a.length,
        "weight_file_bytes": {k: weight_bytes(f) for k, f in sides.items()},
        "passes": got,
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
    }


# --- generate: a model 8x the budget, 4-bit vs float32 ------------------------------------------


def bench_generate(a, home: Path) -> dict:
    from spill.models.config import load_config

    name = f"tiny:llama:0:{a.layers}x{a.hidden}"
    qname = f"{name}@q4g{a.group}"
    ffolder = folder_of(name)
    if not _has(qname):
        spill_cli(home, "models", "quantize", name, "--bits", "4", "--group-size", str(a.group))
    qfolder = folder_of(qname)
    cfg = load_config(ffolder)
    float32_bytes = cfg.layer_params() * a.layers * 4
    memory = float32_bytes // 8
    counter = ByteCounter()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, size=32) for _ in range(a.batch)]
    runners = {
        "float32": open_runner(ffolder, memory=memory, dtype="float32"),
        "q4": open_runner(qfolder, memory=memory, dtype="float32"),
        "q4 int4mm": open_runner(qfolder, memory=memory, packed_matmul=True),
    }
    print(f"generate: {name}, float32 {float32_bytes / 1e6:.0f} MB = 8x --memory "
          f"{memory / 1e6:.0f} MB; batch {a.batch}, {a.new} decode steps", flush=True)  # fmt: skip
    for k, r in runners.items():
        print(f"generate: {k}: {r.info.line()}", flush=True)
        generate_all(r, prompts, a.batch, 2)  # warm-up
    qfiles = [qfolder / s for s in _shards(qfolder)]
    regimes = ("page_cache", "cold")  # cold: every read evicts its range first (a model > RAM)
    got: dict[str, dict[str, list[dict]]] = {g: {k: [] for k in runners} for g in regimes}
    reads: list[dict] = []
    for rnd in range(a.rounds):
        reads.append({"cold": read_rate(qfiles, True), "page_cache": read_rate(qfiles, False)})
        for regime in regimes:
            counter.cold = regime == "cold"
            for k in list(runners) if rnd % 2 == 0 else list(runners)[::-1]:
                sps, step_bytes = decode_step(runners[k], prompts, a.new, counter)
                got[regime][k].append({"steps_per_s": sps, "tokens_per_s": sps * a.batch,
                                       "bytes_per_step": step_bytes})  # fmt: skip
                print(f"  round {rnd + 1} {regime} {k}: {sps * a.batch:.2f} tok/s, "
                      f"{step_bytes / 1e6:.1f} MB a step", flush=True)  # fmt: skip
        counter.cold = False
        print(f"  round {rnd + 1} read {reads[-1]['cold'] / 1e9:.2f} GB/s cold, "
              f"{reads[-1]['page_cache'] / 1e9:.2f} GB/s page cache", flush=True)  # fmt: skip
    infos = {k: r.info.line() for k, r in runners.items()}
    for r in runners.values():
        r.close()
    speed: dict[str, dict] = {}
    fraction: dict[str, dict] = {}
    for regime in regimes:
        best = {k: max(v, key=lambda x: x["steps_per_s"]) for k, v in got[regime].items()}
        rate = max(x[regime] for x in reads)
        speed[regime], fraction[regime] = {}, {}
        for side in ("q4", "q4 int4mm"):
            q = best[side]
            fraction[regime][side] = q["steps_per_s"] * q["bytes_per_step"] / rate
            speed[regime][side] = q["tokens_per_s"] / best["float32"]["tokens_per_s"]
            print(f"generate ({regime}): {side}/float32 tokens/s = {speed[regime][side]:.2f}x "
                  f"(goal >= 3x); fraction of its read bound at {rate / 1e9:.2f} GB/s = "
                  f"{fraction[regime][side]:.2f} (goal >= 0.8)")  # fmt: skip
    return {
        "model": name,
        "quantized": qname,
        "float32_bytes": float32_bytes,
        "memory": memory,
        "batch": a.batch,
        "new_tokens": a.new,
        "engine_lines": infos,
        "weight_file_bytes": {"float": weight_bytes(ffolder), "q4": weight_bytes(qfolder)},
        "read_Bps": reads,
        "sides": got,
        "over_float32_tokens_per_s": _rounded(speed),
        "fraction_of_read_bound": _rounded(fraction),
    }


def _rounded(d: dict) -> dict:
    return {k: _rounded(v) if isinstance(v, dict) else round(v, 3) for k, v in d.items()}


def decode_step(runner, prompts, new: int, counter: ByteCounter) -> tuple[float, float]:
    """(decode steps/s, bytes read a decode step): a generate of ``new`` + 1 tokens minus one
    of 1 token, in time and in bytes (the prefill cancels)."""
    n0 = counter.n
    _, one = generate_all(runner, prompts, len(prompts), 1)
    n1 = counter.n
    _, many = generate_all(runner, prompts, len(prompts), new + 1)
    return new / max(many - one, 1e-9), ((counter.n - n1) - (n1 - n0)) / new


def _shards(folder: Path) -> list[str]:
    from spill.models.weights import weight_files

    return list(weight_files(folder).shards)


def _has(name: str) -> bool:
    from spill.errors import SpillError

    try:
        folder_of(name)
    except SpillError:
        return False
    return True


# --- quality: the tickets build on the float import vs spill's 4-bit g64 copy --------------------


def build_tickets(home: Path, overrides: list[str], python: str) -> dict:
    work = Path(tempfile.mkdtemp(prefix="spill-quant-quality-"))
    root = work / "tickets"
    shutil.copytree(REPO / "projects" / "tickets", root, ignore=shutil.ignore_patterns(".spill"))
    env = quant_tune.env_for(home, None, REPO)
    t = time.perf_counter()
    proc = subprocess.run([python, "-m", "spill", "build", str(root), "--json", *overrides],
                          env=env, cwd=work, capture_output=True, text=True)  # fmt: skip
    seconds = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"spill build exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    stages = json.loads(proc.stdout)["stages"]
    shutil.rmtree(work)
    return {
        "overrides": overrides,
        "seconds": round(seconds, 1),
        "prerun": [ln for ln in proc.stderr.splitlines() if "engine " in ln][:1],
        "scores": {s: stages[s]["result"].get("accuracy") for s in ("eval:base", "eval")},
        "gold_logprob_per_token": {
            s: stages[s]["result"].get("gold_logprob_per_token") for s in ("eval:base", "eval")
        },
        "numerics": stages["tune"]["producers"][0]["numerics"],
    }


def bench_quality(a, home: Path) -> dict:
    # the float import; the README's embedded model (the GGUF's Q4_1, kept); and spill's 4-bit
    # g64 copy of the float import asked the project's way (model.quantize)
    sides = {
        "float": [f"model.name={SMOL}"],
        "q4_1": [f"model.name={SMOL_Q}"],
        "q4g64": [f"model.name={SMOL}", "model.quantize=4", "model.group_size=64"],
    }
    extra = [f"tune.steps={a.steps}"] if a.steps else []
    got = {}
    for k, overrides in sides.items():
        if a.sides and k not in a.sides.split(","):
            continue
        got[k] = build_tickets(home, [*overrides, *extra], a.python or PY)
        print(f"quality: {k}: {json.dumps(got[k])}", flush=True)
    floor = json.loads(NOISE.read_text())["projects"]["tickets"]["stages"]
    for side in [k for k in got if k != "float"] if "float" in got else ():
        for stage in ("eval:base", "eval"):
            acc = floor[stage]["accuracy"]
            mine, ref = got[side]["scores"][stage], got["float"]["scores"][stage]
            print(f"quality: {stage}: float {ref:.3f}, {side} {mine:.3f} (diff {mine - ref:+.3f}); "
                  f"noise floor: spread {acc['spread']:.3f}, tolerance {acc['tolerance']:.3f}",
                  flush=True)  # fmt: skip
    return {"builds": got, "steps_override": a.steps, "noise_floor_009": floor}


# --- float-rss: bench/tune.py's ring-2 side against PEFT -------------------------------------------


def bench_float_rss(a, home: Path) -> dict:
    from bench import tune

    out = home.parent / "float-rss.json"
    argv = ["--rounds", str(a.rounds), "--steps", str(a.steps or 6), "--threads", "1"]
    argv += ["--home", str(home.parent / "tune"), "--sides", "peft f32,spill ring2 f32"]
    tune.main([*argv, "--json", str(out)])
    return json.loads(out.read_text())


# --- the driver -----------------------------------------------------------------------------------

BENCHES = {
    "bytes": bench_bytes,
    "generate": bench_generate,
    "qlora": quant_tune.bench_qlora,
    "mlx": quant_tune.bench_mlx,
    "quality": bench_quality,
    "float-rss": bench_float_rss,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=list(BENCHES))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--home", type=Path, default=Path(tempfile.gettempdir()) / "spill-bench-quant")
    ap.add_argument("--ring", type=int, default=2, help="bytes: the ring of both sides")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--layers", type=int, default=16, help="generate: the tiny model's layers")
    ap.add_argument("--hidden", type=int, default=1024, help="generate: its hidden size")
    ap.add_argument("--group", type=int, default=64, help="generate: the 4-bit copy's group")
    ap.add_argument("--batch", type=int, default=1, help="generate: rows decoded together")
    ap.add_argument("--new", type=int, default=8, help="generate: decode steps timed")
    ap.add_argument("--steps", type=int, default=0, help="tune steps (quality: 0 = the project's)")
    ap.add_argument(
        "--sides",
        default="",
        help="quality: float,q4g64; mlx: spill mlx resident,spill mlx ring2 (default: all)",
    )
    ap.add_argument("--python", help="the interpreter of spill's sides (default: this one)")
    ap.add_argument("--peft-python", default="/tmp/bench-venv/bin/python",
                    help="qlora/mlx: the interpreter with peft, bitsandbytes and mlx-lm")  # fmt: skip
    ap.add_argument("--spill-model", default=SMOL_Q, help="mlx: the model spill tunes")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    home = a.home / "home"
    home.mkdir(parents=True, exist_ok=True)
    os.environ["SPILL_HOME"] = str(home)  # this process's resolves and workers alike
    ensure_models(home)
    result = BENCHES[a.what](a, home)
    result["machine"] = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "load_average_after": load_average(),
    }
    if a.json:
        doc = json.loads(a.json.read_text()) if a.json.is_file() else {}
        doc[a.what] = result
        a.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1].startswith("_"):
        print(json.dumps(quant_tune.WORKERS[sys.argv[1]](json.loads(sys.argv[2]))))
        sys.exit(0)
    sys.exit(main())
