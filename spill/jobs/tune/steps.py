"""One optimizer step's gradients, in one process or shared by a process group.

In one process the step accumulates its micro-batches in index order. In a group
(``spill.jobs.group``) each rank computes its share, every rank gathers every micro-batch's
gradients and folds them in index order, each as one addition per tensor, exactly as one process
adds them: so the step, and the whole run, are the same bits at any world size (the intra-op
thread count equal).
"""

from __future__ import annotations

import math
import resource

import numpy as np

from spill.engines.base import AdamW, TrainBatch, Trainer
from spill.errors import SpillError
from spill.jobs.group import Group
from spill.jobs.schedule import cosine_lr
from spill.jobs.tune.data import micro_batch_at
from spill.jobs.tune.objectives import Dpo, Orpo, batch_reference, metrics
from spill.jobs.tune.options import TuneOptions
from spill.jobs.tune.pairs import pair_batch_at


class Steps:
    """A step's work on every rank (``spill.jobs.tune.job.run``): ``gradients`` and ``apply``
    (the boundary between steps is the group's: ``Group.boundary``). ``examples`` are rows, or
    ``Pair``s for a preference tune (``refs``: DPO's reference log-probs known so far, NaN where
    not yet computed)."""

    def __init__(
        self,
        trainer: Trainer,
        examples,
        pad_id: int,
        opts: TuneOptions,
        group: Group,
        device: str,
        refs: np.ndarray | None = None,
    ):
        self.trainer, self.examples, self.pad_id = trainer, examples, pad_id
        self.tune, self.seed, self.group = opts.tune, opts.seed, group
        self.device = device  # where the trainer computes: the exchange may go there (NCCL)
        self.accum = self.tune.batch // self.tune.micro_batch
        self.method, self.refs = self.tune.method, refs
        if self.method == "dpo" and refs is None:  # none known yet: a fresh run
            self.refs = np.full((len(examples), 2), np.nan)
        self.fresh: dict[int, np.ndarray] = {}  # this rank's new reference rows, for the others
        self.tokens = 0  # tokens of every rank's micro-batches so far
        self.size: int | None = None  # the gradient vector's length
        self.metrics: dict[str, float] = {}  # the last step's, a preference tune's (TRL's names)

    def _batch(self, index: int):
        t = self.tune
        if self.method == "sft":
            return micro_batch_at(self.examples, self.seed, index, t.micro_batch, self.pad_id)
        return pair_batch_at(
            self.examples, self.seed, index, t.micro_batch, self.pad_id, self.method == "orpo"
        )

    # DPO's reference log-probs come from the first micro-batch that takes a pair: one forward of
    # the base more in that step. A pair first met in a batch of the first epoch is computed in
    # exactly the batch ``micro_batch`` index gives, so a rerun or a resume computes the same bits.
    def _reference(self, batch) -> np.ndarray:
        rows = list(batch.rows)
        if np.isnan(self.refs[rows]).any():
            got = batch_reference(self.trainer, batch)
            for i, r in enumerate(rows):
                if np.isnan(self.refs[r, 0]):
                    self.refs[r] = got[i]
                    self.fresh[r] = got[i]
        return self.refs[rows]

    def _objective(self, batch):
        share = 1.0 / self.accum  # each micro-batch's mean, as TRL's accumulation
        if self.method == "dpo":
            return Dpo(batch, self.tune.beta, share, self._reference(batch))
        if self.method == "orpo":
            return Orpo(batch, self.tune.beta, share)
        return None

    def _train(self, step: int, j: int, batch, total: int) -> tuple[float, np.ndarray]:
        objective = self._objective(batch)
        tb = TrainBatch(
            batch.tokens,
            batch.attention,
            batch.targets,
            1.0 / total,
            self.seed * 1_000_003 + step * self.accum + j,
            objective,
        )
        loss = self.trainer.accumulate(tb)
        return loss, objective.stats if objective is not None else np.zeros(0)

    def gradients(self, step: int) -> float:
        """Accumulate step ``step``'s gradients; returns its loss (summed over micro-batches in
        index order). A loss that is not finite stops the job here, on every rank alike, before
        the step changes anything: its gradients would make the adapter NaN for good."""
        loss = self._gradients(step)
        if not math.isfinite(loss):
            raise SpillError(
                f"step {step + 1} of {self.tune.steps}: the loss is {loss}; the step is not "
                "applied and nothing of it is committed (the newest checkpoint stays current): "
                "lower --lr, or check the model's weights and the training data"
            )
        return loss

    def _gradients(self, step: int) -> float:
        g = self.group
        batches = [self._batch(step * self.accum + j) for j in range(self.accum)]
        total = sum(b.n_targets for b in batches)
        loss, sums = 0.0, None
        if g.world == 1:
            for j, b in enumerate(batches):
                got, stats = self._train(step, j, b, total)
                loss += got
                sums = stats if sums is None else sums + stats
                self.tokens += int(b.attention.sum())
        else:
            done, mine = [], {}
            for j in g.mine(self.accum):
                got, mine[j] = self._train(step, j, batches[j], total)
                tokens = int(batches[j].attention.sum())
                done.append((j, got, tokens, self.trainer.take_grads()))
            if self.size is None:
                self.size = sum(a.size for a in self.trainer.state()[0].values())
            everyone = g.gather(done, self.accum, self.size, self.device)
            stats = {}
            if self.method != "sft":  # each rank's metrics (and new references), in order
                for part, fresh in g.collect((mine, self.fresh)):
                    stats.update(part)
                    for r, values in fresh.items():
                        self.refs[r] = values
                self.fresh = {}
            for j, got, tokens, grads in everyone:
                self.trainer.add_grads(grads)
                loss += got
                if stats:
                    sums = stats[j] if sums is None else sums + stats[j]
                self.tokens += tokens
        if self.method != "sft":
            self.metrics = metrics(self.method, sums, self.tune.batch)
        return loss

    def apply(self, step: int) -> None:
        """AdamW from the step's gradients (call under the guard's ``mutating``)."""
        t = self.tune
        lr = cosine_lr(step, t.lr, t.warmup, t.steps)
        self.trainer.apply(AdamW(lr=lr, step=step + 1, weight_decay=t.weight_decay))


def peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
