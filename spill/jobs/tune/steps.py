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

from spill.engines.base import AdamW, TrainBatch, Trainer
from spill.errors import SpillError
from spill.jobs.group import Group
from spill.jobs.schedule import cosine_lr
from spill.jobs.tune.data import micro_batch_at
from spill.jobs.tune.options import TuneOptions


class Steps:
    """A step's work on every rank (``spill.jobs.tune.job.run``): ``gradients`` and ``apply``
    (the boundary between steps is the group's: ``Group.boundary``)."""

    def __init__(
        self, trainer: Trainer, examples, pad_id: int, opts: TuneOptions, group: Group, device: str
    ):
        self.trainer, self.examples, self.pad_id = trainer, examples, pad_id
        self.tune, self.seed, self.group = opts.tune, opts.seed, group
        self.device = device  # where the trainer computes: the exchange may go there (NCCL)
        self.accum = self.tune.batch // self.tune.micro_batch
        self.tokens = 0  # tokens of every rank's micro-batches so far
        self.size: int | None = None  # the gradient vector's length

    def _train(self, step: int, j: int, batch, total: int) -> float:
        tb = TrainBatch(
            batch.tokens,
            batch.attention,
            batch.targets,
            1.0 / total,
            self.seed * 1_000_003 + step * self.accum + j,
        )
        return self.trainer.accumulate(tb)

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
        t, g = self.tune, self.group
        batches = [
            micro_batch_at(
                self.examples, self.seed, step * self.accum + j, t.micro_batch, self.pad_id
            )
            for j in range(self.accum)
        ]
        total = sum(b.n_targets for b in batches)
        loss = 0.0
        if g.world == 1:
            for j, b in enumerate(batches):
                loss += self._train(step, j, b, total)
                self.tokens += int(b.attention.sum())
            return loss
        done = []
        for j in g.mine(self.accum):
            got = self._train(step, j, batches[j], total)
            done.append((j, got, int(batches[j].attention.sum()), self.trainer.take_grads()))
        if self.size is None:
            self.size = sum(a.size for a in self.trainer.state()[0].values())
        everyone = g.gather(done, self.accum, self.size, self.device)
        for _j, got, tokens, grads in everyone:
            self.trainer.add_grads(grads)
            loss += got
            self.tokens += tokens
        return loss

    def apply(self, step: int) -> None:
        """AdamW from the step's gradients (call under the guard's ``mutating``)."""
        t = self.tune
        lr = cosine_lr(step, t.lr, t.warmup, t.steps)
        self.trainer.apply(AdamW(lr=lr, step=step + 1, weight_decay=t.weight_decay))


def peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
