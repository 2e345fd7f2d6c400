"""A real process that writes payloads (checkpoints, row segments) for kill drills; run by
path, not imported (``tests/unit/test_validate.py`` imports its test data).

    python payload_worker.py ckpt <root> <step> [<step> ...]   save these checkpoints
    python payload_worker.py rows <root> <first> <stop>        add rows first..stop-1, then close

Each mode first acquires the run at ``<root>`` (as ``spill tune`` and a row job with ``--state``
do) and releases it when done; a killed worker's run is taken over at once by the next acquire
on this host (its owner process is gone). The drill itself comes from ``SPILL_DRILL`` in the
environment. ``tensors`` is also used by the
tests (through ``runpy``) to know what each step must contain.
"""

from __future__ import annotations

import sys

import numpy as np

IDENTITY = {"model": {"id": "tiny", "fingerprint": "f" * 16}, "input": {"sha256": "0" * 64}}
PRODUCER = {"engine": "torch", "hardware": "cpu", "os": "linux", "numerics": "float32"}


def tensors(step: int) -> tuple[dict, dict, dict]:
    """Deterministic params, AdamW state and state.json content of ``step``."""
    rng = np.random.default_rng(step)
    params = {
        f"layers.{k}.self_attn.{m}.lora_{ab}": rng.standard_normal(shape).astype(np.float32)
        for k in range(2)
        for m in ("q_proj", "v_proj")
        for ab, shape in (("a", (16, 4)), ("b", (4, 16)))
    }
    opt = {
        f"{kind}::{n}": rng.standard_normal(a.shape).astype(np.float32)
        for n, a in params.items()
        for kind in "mv"
    }
    state = {
        "step": step,
        "seed": 3,
        "cursor": 2 * step,
        "model": {"id": "tiny", "fingerprint": "f" * 16},
        "adapter": {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj"]},
        "hyperparameters": {"lr": 1e-4, "schedule": "cosine", "total_steps": 100, "batch": [2, 1]},
        "losses": [1.0 / (i + 1) for i in range(step)],
        "producers": [
            {
                "from_step": 1,
                "to_step": step,
                "engine": "torch",
                "hardware": "cpu",
                "os": "linux",
                "numerics": "float32",
            }
        ],
    }
    return params, opt, state


def main(argv: list[str]) -> None:
    mode, root, *nums = argv
    if mode not in ("ckpt", "rows"):
        raise SystemExit(f"unknown mode {mode}")
    from spill.control.ownership import held
    from spill.store.location import location

    with held(location(root)) as run:
        place = run.place()
        if mode == "ckpt":
            from spill.payloads.checkpoint import save_checkpoint

            for step in map(int, nums):
                save_checkpoint(place, step, *tensors(step))
                print("saved", step, flush=True)
        else:
            from spill.payloads.rows import SegmentWriter

            first, stop = map(int, nums)
            with SegmentWriter(place, IDENTITY, PRODUCER) as w:
                for i in range(first, stop):
                    w.add(f"r{i}", {"id": f"r{i}", "out": i * i})


if __name__ == "__main__":
    main(sys.argv[1:])
