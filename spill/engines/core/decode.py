"""The running batch of ``Runner.serve``: its rows, KV caches and valid keys, one decode step
at a time, with rows joining (their prompts computed in the step's walk) and leaving.

Rows are left-padded and flush right: every row's next token goes into the same cache column
``at``, and positions come from the valid keys, so padding and shifts move nothing. A join
rebuilds the caches once: the unfinished rows, then the new ones, flush right at one column,
less the columns no row uses any more (a long-running batch's caches stay as wide as its
widest row). Without joins the steps are exactly ``generate``'s: the same shapes, the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from spill.engines.base import Generation, Request, Stats, Token
from spill.engines.core.common import left_pad
from spill.engines.core.kernel import RowAdapters, Sampler
from spill.engines.core.model import Model

SHRINK = 0.75  # a generating batch drops its finished rows once a quarter of it has finished


@dataclass
class Row:
    req: Request
    lora: dict | None  # its adapter by layer; None: the base model
    sampler: Sampler
    out: list[int] = field(default_factory=list)
    finish: str | None = None

    def end(self, why: str) -> None:
        self.finish = why
        if self.req.on_done is not None:
            self.req.on_done(Generation(np.asarray(self.out, dtype=np.int64), why))


@dataclass
class Batch:
    rows: list[Row]
    caches: list
    valid: np.ndarray  # (B, columns) bool: the keys each row has
    at: int  # the column the next token goes into
    lora: dict | None
    nxt: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # (B,) fed next


def batch_lora(rows: list[Row], model: Model) -> dict | None:
    """The adapters of a batch by layer: the rows' own when they share one, else per row."""
    first = rows[0].lora
    if all(r.lora is first for r in rows):
        return first
    groups: dict[int, tuple[dict, list[int]]] = {}
    for j, r in enumerate(rows):
        if r.lora is not None:
            groups.setdefault(id(r.lora), (r.lora, []))[1].append(j)
    k = model.kernel
    parts = [(lora, np.asarray(idx, np.int64)) for lora, idx in groups.values()]
    parts = [(lora, k.array(idx), idx) for lora, idx in parts]
    out = {}
    for i in range(model.cfg.num_hidden_layers):
        names = {n for lora, _, _ in parts for n in lora.get(i, {})}
        out[i] = {}
        for n in sorted(names):
            on = [(idx, rows, lora[i][n]) for lora, idx, rows in parts if n in lora.get(i, {})]
            pairs = tuple((idx, adapter) for idx, _, adapter in on)
            out[i][n] = RowAdapters(pairs, tuple(rows for _, rows, _ in on))
    return out


def last_logits(model: Model, h) -> np.ndarray:
    k = model.kernel
    return k.numpy(k.logits(h[:, -1]))  # (B, V) float32


def start(model: Model, rows: list[Row]) -> tuple[Batch, np.ndarray]:
    """A batch of ``rows`` after their prompts' walk, and its logits (B, V)."""
    k = model.kernel
    width = max(len(r.req.prompt) for r in rows)
    columns = width + max(r.req.params.max_new_tokens for r in rows)
    ids, prompt_valid = left_pad([r.req.prompt for r in rows], width)
    valid = np.zeros((len(rows), columns), dtype=bool)
    valid[:, :width] = prompt_valid
    caches = k.caches(len(rows), columns)
    lora = batch_lora(rows, model)
    ctx = k.context(valid[:, :width], 0, width)
    h = model.forward(k.array(ids), ctx, caches, lora)
    return Batch(rows, caches, valid, width, lora), last_logits(model, h)


def step(model: Model, b: Batch, joining: list[Row]) -> np.ndarray:
    """Feed ``b.nxt`` and walk the layers once, with ``joining``'s prompts in the same walk;
    returns the logits (B, V) of the batch as it is afterwards (the joined rows last)."""
    k, at = model.kernel, b.at
    b.valid[:, at] = True
    ctx = k.context(b.valid[:, : at + 1], at, 1)
    ids = k.array(b.nxt[:, None].astype(np.int64))
    if not joining:
        b.at += 1
        return last_logits(model, model.forward(ids, ctx, b.caches, b.lora))
    width = max(len(r.req.prompt) for r in joining)
    jids, jvalid = left_pad([r.req.prompt for r in joining], width)
    jcaches = k.caches(len(joining), width)
    walked = model.forward_many(
        [
            (ids, ctx, b.caches, b.lora),
            (k.array(jids), k.context(jvalid, 0, width), jcaches, batch_lora(joining, model)),
        ]
    )
    keep = np.flatnonzero([r.finish is None for r in b.rows])
    logits = np.concatenate([last_logits(model, walked[0])[keep], last_logits(model, walked[1])])
    # the kept rows' keys (from the first column any of them uses) and the new prompts, flush
    # right at one column, with room for the longest of what every row may still draw
    used = at + 1
    lo = int(b.valid[keep, :used].argmax(axis=1).min()) if len(keep) else used
    span = used - lo
    right = max(span, width)
    kept = [b.rows[j] for j in keep]
    rows = kept + joining
    room = max(r.req.params.max_new_tokens - len(r.out) for r in rows)
    columns = right + room + 1
    parts = [
        (b.caches, keep, lo, right - span),
        (jcaches, np.arange(len(joining)), 0, right - width),
    ]
    b.caches = k.rebuild([p for p in parts if len(p[1])], columns)
    valid = np.zeros((len(rows), columns), dtype=bool)
    valid[: len(keep), right - span : right] = b.valid[keep, lo:used]
    valid[len(keep) :, right - width : right] = jvalid
    b.rows, b.valid, b.at, b.lora = rows, valid, right, batch_lora(rows, model)
    return logits


def token(tok: int, logits: np.ndarray, top: int | None) -> Token:
    """``tok`` with its log-prob under ``logits`` (V,) and the ``top`` likeliest, when asked."""
    if top is None:
        return Token(tok)
    lp = log_softmax(logits)
    return Token(tok, float(lp[tok]), likeliest(lp, top))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def likeliest(lp: np.ndarray, top: int) -> tuple[tuple[int, float], ...]:
    """The ``top`` largest entries of ``lp`` (V,) as (id, log-prob), largest first."""
    top = min(top, len(lp))
    if top <= 0:
        return ()
    idx = np.argpartition(-lp, top - 1)[:top]
    idx = idx[np.argsort(-lp[idx], kind="stable")]
    return tuple((int(i), float(lp[i])) for i in idx)


def choose(b: Batch, logits: np.ndarray, stats: Stats) -> None:
    """Each unfinished row's next token from its logits: greedy (the first index on ties) or
    drawn from its own sampler; a stop token, a cancel, or the row's last token ends it."""
    b.nxt = logits.argmax(axis=-1)  # a finished row is fed its argmax; nothing reads its output
    for j, r in enumerate(b.rows):
        if r.finish is not None:
            continue
        p = r.req.params
        if p.temperature > 0:
            b.nxt[j] = r.sampler(logits[j], p.temperature, p.top_p)
        tok = int(b.nxt[j])
        stats.generated_tokens += 1
        if tok in p.stop_ids:
            r.end("stop")
            continue
        r.out.append(tok)
        seen = r.req.on_token
        if seen is not None and seen(token(tok, logits[j], r.req.logprobs)):
            r.end("cancelled")  # the caller wants no more of this row
        elif len(r.out) >= p.max_new_tokens:
            r.end("length")


def shrink(model: Model, b: Batch) -> Batch | None:
    """``b`` less its finished rows once a quarter of it has finished; None when all have."""
    still = np.flatnonzero([r.finish is None for r in b.rows])
    if len(still) == 0:
        return None
    if len(still) <= SHRINK * len(b.rows):  # finished rows stop taking compute
        model.kernel.keep_rows(b.caches, still)
        b.rows = [b.rows[j] for j in still]
        b.nxt, b.valid = b.nxt[still], b.valid[still]
        b.lora = batch_lora(b.rows, model)
    return b
