"""MLX on a quantized base on a CPU (issue 22): when to dequantize a packed matrix per use, and
what that costs in memory. Sides alternate within each round; ratios are printed; nothing here
asserts a time.

    python bench/quant_mlx.py rows [--rounds 5] [--one-thread] [--json OUT]
    python bench/quant_mlx.py memory [--sides per use,plain,quantized_matmul] [--json OUT]

``--json`` merges the result into OUT under ``mlx_rows``, ``mlx_rows_one_thread`` or
``mlx_memory`` (docs/reports/013-quantized.json keeps them beside ``bench/quant.py``'s).

* ``rows``: ``mx.quantized_matmul`` (and its vjp with respect to ``x``) against the engine's
  dequantized product (``ops.dense_matmul_t``: ``mx.dequantize`` in float32, then ``x @ W.T``
  through the BLAS, and ``g @ W`` dequantized again for the vjp) on SmolLM2-135M's linears
  (4-bit g32, F16 scales and biases, as its Q4_1 import), its tied 8-bit head, and a 1B-sized
  MLP matrix (2048 x 8192), for x of 1 to 512 rows; the fastest of ``--rounds`` each. Prints the
  smallest row count from which the dequantized forward wins on every shape: what
  ``ops.DENSE_ROWS`` is set from.
* ``memory``: one LoRA step (r16 on all seven linears, 4 x 128 tokens, float32) on
  ``smollm2:135m@q4_1`` held resident, activations kept (the kernel's ``stack_vjp``: one lazy
  graph over all 30 layers and the head): MLX's peak memory and the step's time, with the
  engine's per-use dequantization, with a plain one (the dequantized matrix an ordinary input of
  the product, so the backward keeps every layer's float matrix), and with ``quantized_matmul``
  everywhere (as before: minutes a step). Needs the model in spill's cache (``spill models import
  smollm2:135m``; ``SPILL_HOME`` picks the cache).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from spill.engines.mlx import blas, ops  # noqa: E402  (loads OpenBLAS before mlx.core)

# isort: split
import mlx.core as mx  # noqa: E402

ROWS = (1, 2, 3, 4, 6, 8, 16, 64, 512)
BIG_ROWS = 64  # the head and the 1B matrix: quantized_matmul takes seconds past this
# SmolLM2-135M's decoder layer: (in, out, how many): q/o, k/v, gate/up, down
LAYER = ((576, 576, 2), (576, 192, 2), (576, 1536, 2), (1536, 576, 1))
OTHERS = {"head 576x49152 8-bit": (576, 49152, 8), "1B mlp 2048x8192": (2048, 8192, 4)}
MODEL = "smollm2:135m@q4_1"


def _packed(n_in: int, n_out: int, bits: int, seed: int, dense: int | None) -> ops.Packed:
    w = mx.random.normal((n_out, n_in), key=mx.random.key(seed)) * 0.02
    q, s, b = mx.quantize(w, group_size=32, bits=bits)
    s, b = s.astype(mx.float16), b.astype(mx.float16)  # as the GGUF import stores them
    mx.eval(q, s, b)
    return ops.Packed(q, s, b, bits, 32, mx.float32, dense)


def _best(fn, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _sides(p: ops.Packed, rows: int) -> dict:
    """The four timed callables of one shape at ``rows`` rows."""
    dense = ops.Packed(p.weight, p.scales, p.biases, p.bits, p.group_size, p.dtype, 1)
    quant = ops.Packed(p.weight, p.scales, p.biases, p.bits, p.group_size, p.dtype, None)
    n_in, n_out = p.scales.shape[1] * 32, p.weight.shape[0]
    x = mx.random.normal((rows, n_in), key=mx.random.key(rows))
    g = mx.random.normal((rows, n_out), key=mx.random.key(rows + 1))
    mx.eval(x, g)

    def fwd(w):
        return lambda: mx.eval(ops.matmul_t(x, w))

    def vjp(w):
        return lambda: mx.eval(mx.vjp(lambda h: [ops.matmul_t(h, w)], [x], [g])[1])

    return {"q": fwd(quant), "dense": fwd(dense), "q vjp": vjp(quant), "dense vjp": vjp(dense)}


def bench_rows(a) -> dict:
    if a.one_thread:
        blas.set_threads(True)
    layer = [(_packed(i, o, 4, k, None), n) for k, (i, o, n) in enumerate(LAYER)]
    others = {k: _packed(i, o, b, 10 + j, None) for j, (k, (i, o, b)) in enumerate(OTHERS.items())}
    print(f"mlx {mx.__version__} on the CPU, BLAS {blas.describe()}, "
          f"{'one BLAS thread' if a.one_thread else 'the BLAS threads'}, float32, fastest of "
          f"{a.rounds}; ms (dequantized / quantized_matmul)", flush=True)  # fmt: skip
    table: dict[str, dict] = {}
    for rows in a.rows:
        row: dict[str, dict] = {"SmolLM2 layer (7 linears)": dict.fromkeys(_sides_keys(), 0.0)}
        for p, n in layer:
            sides = _sides(p, rows)
            for k, fn in sides.items():
                row["SmolLM2 layer (7 linears)"][k] += n * _best(fn, a.rounds) * 1e3
        if rows <= BIG_ROWS:
            for name, p in others.items():
                row[name] = {k: _best(fn, a.rounds) * 1e3 for k, fn in _sides(p, rows).items()}
        table[str(rows)] = row
        words = [
            f"{name}: fwd {t['dense']:.2f}/{t['q']:.2f} ({t['dense'] / t['q']:.2f}x), "
            f"vjp {t['dense vjp']:.2f}/{t['q vjp']:.2f} ({t['dense vjp'] / t['q vjp']:.2f}x)"
            for name, t in row.items()
        ]
        print(f"{rows:>4} rows: " + "; ".join(words), flush=True)
    wins = [int(r) for r, row in table.items() if all(t["dense"] < t["q"] for t in row.values())]
    first = min((r for r in wins if all(int(s) in wins for s in table if int(s) >= r)), default=0)
    print(f"rows: the dequantized forward is faster on every shape from {first} rows "
          f"(ops.DENSE_ROWS = {ops.DENSE_ROWS})", flush=True)  # fmt: skip
    return {"blas": blas.describe(), "one_thread": a.one_thread, "rounds": a.rounds,
            "ms": table, "dense_faster_from_rows": first}  # fmt: skip


def _sides_keys() -> tuple[str, ...]:
    return ("q", "dense", "q vjp", "dense vjp")


# --- memory: one resident kept-activations step on SmolLM2@q4_1 ----------------------------------


def _plain(group_size: int, bits: int, dtype):
    """The dequantized product without a custom vjp: the float matrix is an input of the matmul,
    which its vjp keeps until the backward reaches it."""

    def product(x, w, scales, biases):
        return x @ ops._dequantize(w, scales, biases, group_size, bits, dtype).T

    return product


def _step(folder: Path) -> dict:
    from spill.engines.base import AdamW, LoadOptions, ModelSpec, TrainBatch
    from spill.engines.mlx import ENGINE
    from spill.models.config import load_config
    from spill.models.lora import LoraConfig, init_params

    cfg = load_config(folder)
    runner = ENGINE.open(ModelSpec(folder, cfg), LoadOptions(dtype="float32", resident=True))
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    lora = LoraConfig(rank=16, alpha=32, targets=targets)
    trainer = runner.trainer(lora)
    trainer.set_state(init_params(cfg, lora, 1), {}, {})
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, cfg.vocab_size, size=(4, 128)).astype(np.int64)
    ones = np.ones(tokens.shape, dtype=bool)
    plan = trainer.plan(*tokens.shape)
    batch = TrainBatch(tokens, ones, ones, 1.0 / tokens.size, 0)
    trainer.accumulate(batch)  # warm-up: the allocator's cache, the BLAS's buffers
    trainer.apply(AdamW(lr=1e-4, step=1))
    mx.synchronize()
    start = mx.get_active_memory()
    mx.reset_peak_memory()
    t = time.perf_counter()
    trainer.accumulate(batch)
    trainer.apply(AdamW(lr=1e-4, step=2))
    seconds = time.perf_counter() - t
    peak = mx.get_peak_memory() - start
    line = runner.info.line()
    runner.close()
    layer = cfg.layer_params() * 4
    return {"kept": plan.keep, "activations_estimate_mb": plan.need / 1e6,
            "peak_above_start_mb": peak / 1e6, "step_s": seconds, "line": line,
            "float32_layers_mb": layer * cfg.num_hidden_layers / 1e6}  # fmt: skip


def bench_memory(a) -> dict:
    from spill.models.resolve import resolve_model

    folder = Path(resolve_model(MODEL, None).folder)
    product, threshold = ops.dense_matmul_t, ops.DENSE_ROWS
    sides = {  # (the product function, ops.DENSE_ROWS while the runner opens)
        "per use": (product, threshold),
        "plain": (_plain, threshold),
        "quantized_matmul": (product, 10**9),  # every product packed: minutes a step
    }
    got = {}
    for side, (fn, rows) in sides.items():
        if a.sides and side not in a.sides.split(","):
            continue
        ops.dense_matmul_t, ops.DENSE_ROWS = fn, rows
        try:
            got[side] = _step(folder)
        finally:
            ops.dense_matmul_t, ops.DENSE_ROWS = product, threshold
        r = got[side]
        print(f"memory: {side}: peak {r['peak_above_start_mb']:.0f} MB above the start, step "
              f"{r['step_s']:.2f} s, kept {r['kept']} (activations est. "
              f"{r['activations_estimate_mb']:.0f} MB; the 30 layers in float32 "
              f"{r['float32_layers_mb']:.0f} MB)", flush=True)  # fmt: skip
    for side, r in got.items():
        print(f"memory: {side}: {r['line']}")
    peak = {k: r["peak_above_start_mb"] for k, r in got.items()}
    if "per use" in peak:
        for k in (k for k in peak if k != "per use"):
            print(f"memory: {k} - per use = {peak[k] - peak['per use']:.0f} MB peak, step time "
                  f"{got[k]['step_s'] / got['per use']['step_s']:.1f}x", flush=True)  # fmt: skip
    return {"model": MODEL, "sides": got}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["rows", "memory"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=list(ROWS))
    ap.add_argument("--one-thread", action="store_true", help="rows: OpenBLAS on one thread")
    ap.add_argument("--sides", default="", help="memory: per use,plain,quantized_matmul (all)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    mx.set_default_device(mx.cpu)
    result = bench_rows(a) if a.what == "rows" else bench_memory(a)
    if a.json:
        doc = json.loads(a.json.read_text()) if a.json.is_file() else {}
        # keys of their own in docs/reports/013-quantized.json, beside bench/quant.py's
        doc[f"mlx_{a.what}" + ("_one_thread" if a.one_thread else "")] = result
        a.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
