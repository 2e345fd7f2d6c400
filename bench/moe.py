"""Decode an MoE model with its experts read as routed, or inside whole streamed layers (issue 41,
docs/reports/022-moe.md). Run it inside a memory limit with bench/memory_limit.py:

    python bench/memory_limit.py --limit 8GiB --files M/*.safetensors --json J -- \
        python bench/moe.py M --batch 1 --tokens 8 [--whole] [--packed-matmul] --json OUT

Greedy decoding of ``--batch`` prompts of ``--prompt`` tokens on ``--engine`` under the
budget the cgroup sets (``core.budget``): ``--tokens`` new tokens a prompt, the decode rate and
the reader's bytes counted from the moment every row has its first token (the prefill done) to
the end: ``(tokens - 1) x batch`` tokens. The routed-expert bound of a step is what it would read with no cache: each
sparse layer's attention, norms and router, plus the experts its tokens chose (their union, as
stored: packed weights, scales and biases). ``--whole`` reads every expert of a layer with it
(``core.open.ROUTED`` off), the way a dense model streams.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spill.engines.base import GenerateParams, LoadOptions, ModelSpec  # noqa: E402
from spill.engines.core import experts as routed_experts  # noqa: E402
from spill.engines.core import open as opening  # noqa: E402
from spill.models.config import load_config  # noqa: E402


def bound_counter(cfg) -> dict:
    """Wrap ``Experts.read`` to add each call's routed-expert bound (core + chosen experts)."""
    seen = {"bytes": 0}
    original = routed_experts.Experts.read

    def read(self, i, chosen):
        core = [f"model.layers.{i}.{k}" for k in cfg.layer_keys(i, routed=False)]
        chosen_names = [n for e in chosen for n in self.names(i, e)]
        seen["bytes"] += self.file_bytes(core) + self.file_bytes(chosen_names)
        return original(self, i, chosen)

    routed_experts.Experts.read = read
    return seen


def decode(runner, prompts, tokens: int, seen: dict) -> dict:
    """One greedy call of ``tokens`` new tokens a prompt: its decode steps (after every row's
    first token, prefill included before it) timed and counted apart from the prefill."""
    reader, mark = runner.model.kernel.reader, {}
    firsts = set()

    def on_token(row: int, token: int) -> None:
        firsts.add(row)
        if len(firsts) == len(prompts) and not mark:  # the prefill's tokens are all out
            mark.update(t=time.perf_counter(), b=reader.bytes_read, bound=seen["bytes"])

    out = runner.generate(
        prompts, GenerateParams(max_new_tokens=tokens), list(range(len(prompts))), on_token
    )
    new = (tokens - 1) * len(prompts)
    return {
        "new_tokens": new,
        "decode_tokens_per_s": round(new / (time.perf_counter() - mark["t"]), 4),
        "read_gb_per_token": round((reader.bytes_read - mark["b"]) / new / 1e9, 4),
        "bound_gb_per_token": round((seen["bytes"] - mark["bound"]) / new / 1e9, 4),
        "tokens": [g.tokens.tolist() for g in out],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--whole", action="store_true", help="experts inside whole streamed layers")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--engine", choices=("torch", "mlx"), default="torch")
    p.add_argument("--memory", help="a budget of its own (default: the cgroup's, core.budget)")
    p.add_argument(
        "--packed-matmul", action="store_true", help="4-bit modules through torch's int4 kernel"
    )
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    opening.ROUTED = not a.whole
    cfg = load_config(a.model)
    seen = bound_counter(cfg)
    from spill.engines import resolve

    engine = resolve(a.engine)

    t = time.perf_counter()
    runner = engine.open(
        ModelSpec(a.model, cfg),
        LoadOptions(dtype=a.dtype, memory=a.memory, packed_matmul=a.packed_matmul),
    )
    opened = time.perf_counter() - t
    print(f"opened in {opened:.1f} s: {runner.info}", flush=True)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, a.prompt) for _ in range(a.batch)]
    got = decode(runner, prompts, a.tokens, seen)
    extra = dict(runner.stats.extra)
    runner.close()
    figures = {
        "side": "whole layers" if a.whole else "routed experts",
        "engine": a.engine,
        "batch": a.batch,
        "packed_matmul": a.packed_matmul,
        "numerics": runner.info.numerics,
        "open_s": round(opened, 1),
        **got,
        "experts": {k: v for k, v in extra.items() if k.startswith("expert")},
        "weights": runner.info.weights,
        "memory": runner.info.memory,
    }
    if a.whole:
        figures["bound_gb_per_token"] = None  # the routed side counts it
    print(json.dumps({k: v for k, v in figures.items() if k != "tokens"}, indent=1), flush=True)
    if a.json:
        a.json.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
