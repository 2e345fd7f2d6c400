"""How many rows one walk over the layers serves: a row job's batch from the memory budget.

``plan_batch`` gives a row job (run, eval, distill), which knows all its rows before it starts, the
largest batch whose KV cache and activations fit (``row_bytes`` a row, in bytes); ``--batch``
(``eval.batch``, ``teacher.batch``) overrides. The rows may use ``ROWS_FRACTION`` of the memory left
free once the layers are in memory, and a batch is at most ``MAX_BATCH`` rows; where the device's
free memory is not known the batch is ``FALLBACK_BATCH``.
"""

from __future__ import annotations

from spill.engines.base import BatchPlan
from spill.models.config import ModelConfig

# A decode step reads every layer's weights once whatever the batch (from the file when layers
# stream, from memory when they are resident: on a CPU the weights are far larger than the caches),
# so the rows of a batch share that read: the more rows, the less each token costs. Measured on
# SmolLM2-135M, float32, 2 cores (docs/reports/011): batch 64 makes 3.3x the tokens/s of batch 8
# resident, and more streamed.
# MAX_BATCH: past that a decode step is compute-bound on a CPU anyway, and a larger batch only
# delays commits (segments are pushed between batches) and loses more work to a preemption that
# outlasts the grace period. ROWS_FRACTION: a streamed ring's slots count as taken before its first
# walk; the ring's ``--memory`` budget stays the ring's. FALLBACK_BATCH, the old fixed default, is
# for a runner that cannot tell the device's free memory (a discrete GPU whose engine gives none).
MAX_BATCH = 64  # rows per batch at most (see the comment above)
FALLBACK_BATCH = 8  # the batch when the device's free memory is not known
ROWS_FRACTION = 0.5  # share of the memory left free after the ring that the rows may use
SAFETY = 1.5  # on top of the named buffers (allocator slack, temporaries)


# The arithmetic, per row of ``tokens`` tokens (prompt plus generated or scored tokens):
# - KV cache: 2 (keys, values) x layers x kv heads x head dim x tokens, in the compute dtype;
# - one layer's activations at the prefill (layers run one at a time and free theirs): the
#   residual, the normed input, q/k/v, the attention output and the MLP's gate, up and product,
#   in the compute dtype, plus the attention weights (heads x tokens x tokens, float32, twice:
#   scores and probabilities, as the math kernel of ``scaled_dot_product_attention`` keeps them);
# - the last position's float32 logits and their host copy (2 x vocab x 4 bytes);
# all times ``SAFETY`` for the allocator's slack and temporaries the sum does not name.
def row_bytes(cfg: ModelConfig, itemsize: int, tokens: int) -> int:
    """Bytes one row of ``tokens`` tokens needs at its peak (KV cache + one layer's activations
    + the last position's logits), with ``SAFETY``; see the comment above."""
    t = max(1, tokens)
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    cache = 2 * cfg.num_hidden_layers * kv * t * itemsize
    per_token = 3 * cfg.hidden_size + q + 2 * kv + q + 3 * cfg.intermediate_size
    acts = t * per_token * itemsize + 2 * cfg.num_attention_heads * t * t * 4
    logits = 2 * cfg.vocab_size * 4
    return int(SAFETY * (cache + acts + logits))


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def plan_batch(
    cfg: ModelConfig,
    itemsize: int,
    tokens: int,
    rows: int,
    free: int | None,
) -> BatchPlan:
    """The batch for ``rows`` rows of at most ``tokens`` tokens each, given ``free`` bytes that
    the rows may use (None: unknown on this device, so ``FALLBACK_BATCH``)."""
    rows = max(1, rows)
    if free is None:
        return BatchPlan(min(FALLBACK_BATCH, rows), "(the device's free memory is not known)")
    need = row_bytes(cfg, itemsize, tokens)
    fit = max(1, free // need)
    n = min(fit, MAX_BATCH, rows)
    limit = "all the rows" if n == rows else "the cap" if n == MAX_BATCH else "what fits"
    why = (
        f"from the memory budget ({_mib(need)} a row of {tokens} tokens, "
        f"{free / 2**30:.1f} GiB for rows; {limit})"
    )
    return BatchPlan(n, why)
