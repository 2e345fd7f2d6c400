"""The preference losses of a micro-batch of pairs, as TRL defines them, and their metrics.

DPO (TRL's ``DPOTrainer``, ``loss_type="sigmoid"``): ``-logsigmoid(beta * ((c - c_ref) - (r -
r_ref)))`` of the answers' summed log-probs with and without the adapter, meaned over the pairs.
ORPO (TRL's ``ORPOTrainer``): the chosen sequences' mean token NLL (prompt and answer) minus
``beta`` x the mean ``logsigmoid`` of the log odds ratio of the answers' mean log-probs. Each is an
``engines.base.Objective`` in float64 numpy (every engine computes it alike); ``stats`` are
per-pair sums of TRL's metrics (``STATS``), so a step's are its micro-batches' sums over pairs.
"""

from __future__ import annotations

import numpy as np

from spill.engines.base import TrainBatch
from spill.jobs.tune.pairs import PairBatch

REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
STATS = {
    "dpo": (*REWARDS, "logps/chosen", "logps/rejected"),
    "orpo": (*REWARDS, "logps/chosen", "logps/rejected", "nll_loss", "log_odds_ratio",
             "log_odds_chosen"),
}  # fmt: skip


def _logsigmoid(z: np.ndarray) -> np.ndarray:
    return -np.logaddexp(0.0, -z)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return np.exp(_logsigmoid(z))


def log1mexp(x: np.ndarray) -> np.ndarray:
    """log(1 - exp(x)) for x < 0, split at -ln 2 as TRL does."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(x < -np.log(2.0), np.log1p(-np.exp(x)), np.log(-np.expm1(x)))


class Pairwise:
    """What both losses share: the batch, the loss's share of the step (``share``: 1 / the
    step's micro-batches, TRL's gradient accumulation) and ``stats`` once called."""

    method = ""

    def __init__(self, batch: PairBatch, beta: float, share: float):
        self.batch, self.beta, self.share = batch, beta, share
        self.stats = np.zeros(len(STATS[self.method]))

    def _sums(self, values: np.ndarray, rows: np.ndarray, on: np.ndarray) -> np.ndarray:
        """Per row of the batch, the sum of ``values`` where ``on``."""
        return np.bincount(rows, weights=values * on, minlength=2 * self.batch.pairs)

    def _answers(self, rows, cols) -> np.ndarray:
        return self.batch.answer[rows, cols + 1].astype(np.float64)


def answer_logps(batch: PairBatch, ce, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """(2P,) float64: each sequence's answer log-prob summed from the targets' cross-entropies;
    the one sum DPO's policy and its reference both take, so at a zero adapter they are equal."""
    on = batch.answer[rows, cols + 1].astype(np.float64)
    return -np.bincount(rows, weights=np.asarray(ce, np.float64) * on, minlength=2 * batch.pairs)


class Dpo(Pairwise):
    method = "dpo"

    def __init__(self, batch: PairBatch, beta: float, share: float, refs: np.ndarray):
        super().__init__(batch, beta, share)
        self.refs = np.asarray(refs, dtype=np.float64)  # (P, 2): the base's chosen, rejected

    def __call__(self, ce: np.ndarray, rows: np.ndarray, cols: np.ndarray):
        p, beta = self.batch.pairs, self.beta
        on = self._answers(rows, cols)
        logps = answer_logps(self.batch, ce, rows, cols)
        chosen, rejected = logps[:p] - self.refs[:, 0], logps[p:] - self.refs[:, 1]
        z = beta * (chosen - rejected)
        loss = float(-_logsigmoid(z).mean() * self.share)
        dz = -_sigmoid(-z) * self.share / p  # d loss / d z, per pair
        dlogps = np.concatenate([beta * dz, -beta * dz])
        c, r = beta * chosen, beta * rejected
        self.stats = np.array(
            [c.sum(), r.sum(), (c > r).sum(), (c - r).sum(), logps[:p].sum(), logps[p:].sum()]
        )
        return loss, -dlogps[rows] * on  # ce = -log-prob


class Orpo(Pairwise):
    method = "orpo"

    def __call__(self, ce: np.ndarray, rows: np.ndarray, cols: np.ndarray):
        p, beta = self.batch.pairs, self.beta
        ce = np.asarray(ce, np.float64)
        chosen_rows = (rows < p).astype(np.float64)  # every target of a chosen sequence
        n_chosen = chosen_rows.sum()
        nll = float((ce * chosen_rows).sum() / n_chosen)
        on = self._answers(rows, cols)
        counts = np.bincount(rows, weights=on, minlength=2 * p)
        mean = -self._sums(ce, rows, on) / counts  # each answer's mean token log-prob
        c, r = mean[:p], mean[p:]
        odds = (c - r) - (log1mexp(c) - log1mexp(r))
        ratio = _logsigmoid(odds)
        loss = float((nll - beta * ratio.mean()) * self.share)
        dodds = -beta * _sigmoid(-odds) / p * self.share
        # d odds / d c = 1 / (1 - e^c); d odds / d r = -1 / (1 - e^r)
        dmean = np.concatenate([dodds / -np.expm1(c), dodds / np.expm1(r)])
        weights = chosen_rows * self.share / n_chosen - dmean[rows] / counts[rows] * on
        rc, rr = beta * c, beta * r
        self.stats = p * np.array(
            [rc.mean(), rr.mean(), (rc > rr).mean(), (rc - rr).mean(), c.mean(), r.mean(), nll,
             ratio.mean(), odds.mean()]
        )  # fmt: skip
        return loss, weights


def metrics(method: str, sums: np.ndarray, pairs: int) -> dict[str, float]:
    """A step's metrics under TRL's names, from its micro-batches' ``stats`` summed."""
    return {k: float(v) / pairs for k, v in zip(STATS[method], sums, strict=True)}


def batch_reference(trainer, batch: PairBatch) -> np.ndarray:
    """(P, 2) float64: each pair's chosen and rejected answer log-prob under the base (the adapter
    off), from the trainer's own forward of this very micro-batch (``Trainer.token_losses``),
    summed as ``Dpo`` sums; so at a zero adapter (step 1) every reward is exactly 0, as in TRL."""
    ce = trainer.token_losses(TrainBatch(batch.tokens, batch.attention, batch.targets, 1.0, 0))
    logps = answer_logps(batch, ce, *np.nonzero(batch.targets[:, 1:]))
    return np.stack([logps[: batch.pairs], logps[batch.pairs :]], axis=1)
