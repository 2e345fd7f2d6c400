"""llama.cpp decoding a GGUF greedily, timed the way bench/moe.py times spill (issue 41,
docs/reports/022-moe.md): the same prompts (``--batch`` rows of ``--prompt`` token ids drawn
from seed 0), one prefill of every row, then ``--tokens - 1`` decode steps of one token a row;
the rate and the bytes this process read from disk (``/proc/self/io``: the model is mapped, so
its page faults are the reads) counted from the moment every row has its first token.

    python bench/memory_limit.py --limit 8GiB --files OUT/model-q4_0.gguf --json J -- \
        python bench/moe_llama_cpp.py OUT/model-q4_0.gguf --batch 1 --tokens 8 --json OUT

Needs ``llama_cpp`` (llama-cpp-python, built from source) importable; it runs llama.cpp's own
C API (``llama_decode`` over a batch holding one sequence a row), with mmap on, as ``llama-cli``
would, on ``--threads`` threads. Weight repacking is off (``llama-cli --no-repack``): on this CPU
llama.cpp otherwise copies every Q4_0 matrix into an interleaved layout in anonymous memory,
the whole model (measured: OOM-killed at 8 GiB two minutes into loading); ``--repack`` turns it
on for a model that fits.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time
from pathlib import Path

import numpy as np


def read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


class Llama:
    """A mapped model and one context of ``rows`` sequences."""

    def __init__(self, path: Path, rows: int, ctx: int, threads: int, repack: bool) -> None:
        import llama_cpp as ll

        self.ll = ll
        ll.llama_backend_init()
        mp = ll.llama_model_default_params()
        mp.use_mmap, mp.use_extra_bufts = True, repack
        self.model = ll.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {path}")
        self.vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        cp = ll.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = ctx * rows, ctx * rows, ctx * rows
        cp.n_seq_max, cp.n_threads, cp.n_threads_batch = rows, threads, threads
        self.ctx = ll.llama_init_from_model(self.model, cp)
        self.batch = ll.llama_batch_init(ctx * rows, 0, rows)

    def step(self, entries: list[tuple[int, int, int, bool]]) -> dict[int, int]:
        """Decode (token, position, row, wanted) entries; each wanted row's greedy next token."""
        b = self.batch
        b.n_tokens = len(entries)
        for j, (token, pos, row, wanted) in enumerate(entries):
            b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = token, pos, 1, int(wanted)
            b.seq_id[j][0] = row
        if rc := self.ll.llama_decode(self.ctx, b):
            raise SystemExit(f"llama_decode returned {rc}")
        out = {}
        for j, (_, _, row, wanted) in enumerate(entries):
            if wanted:
                ptr = self.ll.llama_get_logits_ith(self.ctx, j)
                logits = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                               shape=(self.vocab,))  # fmt: skip
                out[row] = int(np.argmax(logits))
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("gguf", type=Path)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repack", action="store_true", help="llama.cpp's CPU weight repacking")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    rng = np.random.default_rng(0)  # bench/moe.py's prompts
    prompts = [rng.integers(3, 250, a.prompt).tolist() for _ in range(a.batch)]

    t = time.perf_counter()
    llama = Llama(a.gguf, a.batch, a.prompt + a.tokens, a.threads, a.repack)
    opened = time.perf_counter() - t
    t = time.perf_counter()
    entries = [
        (tok, pos, row, pos == len(ids) - 1)
        for row, ids in enumerate(prompts)
        for pos, tok in enumerate(ids)
    ]
    last = llama.step(entries)
    prefill = time.perf_counter() - t
    tokens = [[last[r]] for r in range(a.batch)]
    t, b = time.perf_counter(), read_bytes()
    for s in range(a.tokens - 1):
        last = llama.step([(last[r], a.prompt + s, r, True) for r in range(a.batch)])
        for r in range(a.batch):
            tokens[r].append(last[r])
    took, read = time.perf_counter() - t, read_bytes() - b
    new = (a.tokens - 1) * a.batch
    figures = {
        "side": "llama.cpp (mmap)",
        "batch": a.batch,
        "threads": a.threads,
        "repack": a.repack,
        "open_s": round(opened, 1),
        "prefill_s": round(prefill, 1),
        "new_tokens": new,
        "decode_tokens_per_s": round(new / took, 4),
        "read_gb_per_token": round(read / new / 1e9, 4),
        "tokens": tokens,
    }
    print(json.dumps({k: v for k, v in figures.items() if k != "tokens"}, indent=1), flush=True)
    if a.json:
        a.json.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
