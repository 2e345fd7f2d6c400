"""The learning-rate schedule: linear warmup, then cosine decay to zero at the last step.

Same formula as transformers' ``get_cosine_schedule_with_warmup``; ``step`` counts optimizer
steps from 0, so the first step of a run without warmup uses the full rate.
"""

from __future__ import annotations

import math


def cosine_lr(step: int, base_lr: float, warmup: int, total: int) -> float:
    if step < warmup:
        return base_lr * step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return base_lr * max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
