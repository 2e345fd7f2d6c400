"""The torch ring on a quantized base (issue 22): the dequantizer, where it runs, and what a
streamed pass reads. Each compares two things measured in the same run, alternating, and prints
the ratio; nothing here asserts a time.

    python bench/quant_ring.py dequant    # per layer: the int32 shift/mask dequantizer vs today's
    python bench/quant_ring.py where      # dequantize on the computing vs the prefetch thread
    python bench/quant_ring.py where --busy   # the same with a second process spinning a core
    python bench/quant_ring.py ring       # smollm2:135m@q4_1 vs its float import, both --ring 2

Models come from spill's cache (``SPILL_HOME``): ``spill models import smollm2:135m`` and
``spill models import smollm2:135m --dequantize`` first.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import numpy as np
import torch

from spill.engines.base import GenerateParams, LoadOptions, ModelSpec
from spill.engines.core import ring as ring_module
from spill.engines.torch import ENGINE, quant
from spill.models.config import load_config
from spill.models.resolve import resolve_model
from spill.models.weights import layer_bytes, weight_files

QUANT, FLOAT = "smollm2:135m@q4_1", "smollm2:135m@f32"


def old_dequantize_into(out, weight, scales, biases, bits, group_size):
    """The dequantizer before this change: int32 shifts and masks per chunk of rows."""
    rows, cols = out.shape
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=weight.device)
    mask = (1 << bits) - 1
    step = max(1, (1 << 22) // max(cols, 1))
    for r in range(0, rows, step):
        w = weight[r : r + step]
        q = (w.unsqueeze(-1) >> shifts) & mask
        q = q.reshape(w.shape[0], -1, group_size).to(torch.float32)
        x = q * scales[r : r + step].to(torch.float32).unsqueeze(-1)
        x = x + biases[r : r + step].to(torch.float32).unsqueeze(-1)
        out[r : r + step].copy_(x.reshape(w.shape[0], cols))
    return out


def folder(name: str):
    return resolve_model(name, progress=lambda line: print(line, file=sys.stderr)).folder


def open_runner(name: str, **opts):
    f = folder(name)
    return ENGINE.open(ModelSpec(f, load_config(f)), LoadOptions(dtype="float32", **opts))


def dequant(rounds: int) -> None:
    runner = open_runner(QUANT, ring=2)
    reader = runner.model.kernel.reader
    layer = reader.tensors([f"model.layers.3.{k}" for k in runner.model.cfg.layer_keys()])
    packed = [p for p in layer.values() if isinstance(p, quant.Packed)]
    outs = [torch.empty(p.shape) for p in packed]
    sides = {
        "old": lambda p, o: old_dequantize_into(
            o, p.weight, p.scales, p.biases, p.bits, p.group_size
        ),
        "new": lambda p, o: quant.dequantize(p, o),
    }
    for p, o in zip(packed, outs, strict=True):  # the two give the same bits
        a = sides["old"](p, o.clone())
        assert torch.equal(a.view(torch.int32), sides["new"](p, o).view(torch.int32))
    times = {k: [] for k in sides}
    for _ in range(rounds):
        for name, fn in sides.items():
            t = time.perf_counter()
            for p, o in zip(packed, outs, strict=True):
                fn(p, o)
            times[name].append(time.perf_counter() - t)
    old, new = (float(np.median(times[k])) for k in ("old", "new"))
    threads = torch.get_num_threads()
    print(
        f"dequantize one SmolLM2 layer (4-bit g32 -> float32, {threads} threads, {rounds} rounds):"
    )
    print(f"  old {old * 1e3:.2f} ms, new {new * 1e3:.2f} ms, old/new {old / new:.2f}x")
    runner.close()


def _passes(runner, prompts, completions) -> tuple[float, float]:
    """(seconds of one scoring pass, seconds per generated token, 8 greedy tokens)."""
    t = time.perf_counter()
    runner.score(prompts, completions)
    score = time.perf_counter() - t
    t = time.perf_counter()
    runner.generate(prompts[:1], GenerateParams(8), [0])
    return score, (time.perf_counter() - t) / 8


def where(rounds: int, busy: bool) -> None:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 40000, 96) for _ in range(2)]
    completions = [rng.integers(10, 40000, 32) for _ in range(2)]
    spinner = None
    if busy:
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    sides = {"compute": False, "prefetch": True}  # ring.EXPAND_AHEAD
    got = {k: ([], []) for k in sides}
    try:
        for _ in range(rounds):
            for name, ahead in sides.items():
                ring_module.EXPAND_AHEAD = ahead
                runner = open_runner(QUANT, ring=2)
                try:
                    _passes(runner, prompts, completions)  # warm: the pools fill
                    score, token = _passes(runner, prompts, completions)
                finally:
                    runner.close()
                    ring_module.EXPAND_AHEAD = True
                got[name][0].append(score)
                got[name][1].append(token)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    s = {k: (float(np.median(a)), float(np.median(b))) for k, (a, b) in got.items()}
    load = "a second process spinning one core" if busy else "idle"
    print(f"{QUANT} --ring 2, float32, {torch.get_num_threads()} threads, {load}, {rounds} rounds:")
    for k, (score, token) in s.items():
        print(
            f"  dequantize on the {k} thread: score 2x128 {score:.3f} s, decode {token * 1e3:.1f} ms/token"
        )
    (cs, ct), (ps, pt) = s["compute"], s["prefetch"]
    print(f"  prefetch/compute time: score {ps / cs:.2f}x, decode {pt / ct:.2f}x")


def ring(rounds: int) -> None:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 40000, 96) for _ in range(4)]
    completions = [rng.integers(10, 40000, 32) for _ in range(4)]
    got = {name: [] for name in (QUANT, FLOAT)}
    read, lines = {}, {}
    for name in got:
        f = folder(name)
        cfg = load_config(f)
        slot = layer_bytes(cfg, weight_files(f), 4)
        print(
            f"{name}: slot {slot / 1e6:.2f} MB (float32 layer {cfg.layer_params() * 4 / 1e6:.2f} MB)"
        )
    for _ in range(rounds):
        for name in got:
            runner = open_runner(name, ring=2)
            try:
                before = runner.model.kernel.reader.bytes_read
                t = time.perf_counter()
                runner.score(prompts, completions)
                got[name].append(time.perf_counter() - t)
                read[name] = runner.model.kernel.reader.bytes_read - before
                lines[name] = runner.info.line()
            finally:
                runner.close()
    for name, line in lines.items():
        print(f"  {name}: {line}")
    q, f = (float(np.median(got[n])) for n in (QUANT, FLOAT))
    print(f"scoring pass 4x128, --ring 2, float32, {rounds} rounds (median):")
    print(
        f"  bytes read: {QUANT} {read[QUANT] / 1e6:.1f} MB, {FLOAT} {read[FLOAT] / 1e6:.1f} MB, "
        f"float/quantized {read[FLOAT] / read[QUANT]:.2f}x"
    )
    print(f"  pass time: {QUANT} {q:.3f} s, {FLOAT} {f:.3f} s, float/quantized {f / q:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["dequant", "where", "ring"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--busy", action="store_true", help="a second process spins one core")
    args = ap.parse_args()
    if args.what == "dequant":
        dequant(args.rounds * 4)
    elif args.what == "where":
        where(args.rounds, args.busy)
    else:
        ring(args.rounds)


if __name__ == "__main__":
    main()
