"""Validation loss for ``spill tune`` (``Validation``): the adapter's token-mean loss on rows it
never trains on, every ``eval_every`` steps and at the last step, on rank 0. The number at step N is
the same bits whether or not the run was killed and resumed on the same engine. It is committed with
the checkpoint (``state["valid"]``: ``[step, loss]`` pairs), and so is the best adapter so far when
``keep_best`` asks for it (``best::<param>`` tensors beside the moments, ``state["best"]``), so that
the exported adapter is that one even after a resume.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from spill.errors import SpillError
from spill.jobs.tune.data import Example, data_fingerprint, load_examples
from spill.jobs.tune.objectives import log1mexp
from spill.jobs.tune.pairs import Pair, load_pairs


def identity(path: Path | None, every: int, keep_best: bool) -> dict | None:
    """What a checkpoint records of its validation (None: none, as before validation existed)."""
    if path is None:
        return None
    return {"data": data_fingerprint(path), "every": every, "keep_best": keep_best}


def refuse(found: dict | None, want: dict | None, where: str, error: type[SpillError]) -> None:
    """A checkpoint continues only with the validation it was made with, else its record of
    validation losses would mix two sets of rows (or have holes)."""
    if found == want:
        return
    fresh = "use the same --valid, --eval-every and --keep-best, or another --state to start fresh"
    if found is None or want is None:
        had = "with" if found else "without"
        has = "with" if want else "without"
        raise error(f"{where} was made {had} validation (--valid), this run is {has}; {fresh}")
    label = {"data": "validation file", "every": "--eval-every", "keep_best": "--keep-best"}
    key = next(k for k in label if found.get(k) != want.get(k))
    raise error(
        f"{where} was made with {label[key]} {found.get(key)!r}, this run has "
        f"{want.get(key)!r}; {fresh}"
    )


# Computed with the engine's scoring pass (no dropout, no gradients), over the rows in file order in
# chunks of ``micro_batch`` rows: a chunking fixed by the run's settings, not by the memory budget,
# so the number at step N is the same bits whether or not the run was killed and resumed.
@dataclass
class Validation:
    """The validation rows and what has been measured on them so far in this run."""

    examples: list[Example]
    every: int
    total: int  # the run's --steps: the last step is always measured
    chunk: int  # rows per scoring pass (the run's micro-batch)
    keep_best: bool
    losses: list[list] = field(default_factory=list)  # [step, loss]
    best: dict | None = None  # {"step", "loss"}
    best_params: dict[str, np.ndarray] | None = None

    method: str = "sft"  # a preference tune's rows are pairs, its loss the method's
    beta: float = 0.1
    refs: np.ndarray | None = None  # DPO: the base's log-probs of the pairs, on first use

    @classmethod
    def open(cls, path: Path, tok, opts) -> Validation:
        t = opts.tune
        if t.method == "sft":
            examples = load_examples(Path(path), tok, t.seq_len)
        else:
            examples = load_pairs(Path(path), tok, t.seq_len, bos=t.method == "orpo")
        if not examples:
            raise SpillError(f"{path}: no validation rows; give --valid a JSONL file with rows")
        return cls(
            examples,
            t.eval_every,
            t.steps,
            t.micro_batch,
            t.keep_best,
            method=t.method,
            beta=t.beta,
        )

    def _loss(self, runner) -> float:
        if self.method == "sft":
            return token_mean_loss(runner, self.examples, self.chunk)
        policy = pair_logprobs(runner, self.examples, self.chunk)
        if self.method == "orpo":
            return orpo_loss(self.examples, policy, self.beta)
        return dpo_loss(self.examples, policy, self.refs, self.beta)

    def restore(self, state: dict, opt: dict[str, np.ndarray]) -> None:
        """What a checkpoint committed: its validation losses, and its best adapter."""
        self.losses = [list(p) for p in state.get("valid", [])]
        self.best = state.get("best")
        best = {k[6:]: a for k, a in opt.items() if k.startswith("best::")}
        self.best_params = best or None

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step == self.total

    def measure(self, runner, lora, params: dict[str, np.ndarray], step: int) -> float:
        """The loss at ``step`` (``params`` after that step's update), recorded; a new lowest
        one keeps ``params`` as the best adapter."""
        if self.method == "dpo" and self.refs is None:  # the same bits on every resume
            self.refs = pair_logprobs(runner, self.examples, self.chunk)
        runner.use_adapter(lora, params)
        try:
            loss = self._loss(runner)
        finally:
            runner.use_adapter(None, None)
        self.losses.append([step, loss if math.isfinite(loss) else None])
        if (
            self.keep_best
            and math.isfinite(loss)
            and (self.best is None or loss < self.best["loss"])
        ):
            self.best = {"step": step, "loss": loss}
            self.best_params = {k: a.copy() for k, a in params.items()}
        return loss

    def last(self) -> float | None:
        return self.losses[-1][1] if self.losses else None

    def kept(self, last: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The adapter to export: the best one when ``keep_best`` found one, else ``last``."""
        return self.best_params if self.keep_best and self.best_params else last

    def record(self) -> dict:
        """What adapter.json says of the validation: every loss, and which step it holds."""
        chosen = self.best if self.keep_best and self.best else None
        return {"losses": self.losses, "kept": "best" if chosen else "last"} | (
            {"step": chosen["step"], "loss": chosen["loss"]} if chosen else {}
        )

    def summary(self) -> dict:
        """The final table's columns."""
        last = self.last()
        out = {"valid_loss": round(last, 6) if last is not None else None}
        if self.best:
            out |= {"best_step": self.best["step"], "best_valid_loss": round(self.best["loss"], 6)}
        return out

    def state(self) -> dict:
        """The checkpoint state's keys."""
        return {"valid": self.losses} | ({"best": self.best} if self.best else {})

    def arrays(self) -> dict[str, np.ndarray]:
        """The checkpoint's ``best::`` tensors (none unless ``keep_best``)."""
        return {f"best::{k}": a for k, a in (self.best_params or {}).items()}


def token_mean_loss(runner, examples: list[Example], chunk: int) -> float:
    """Mean negative log-likelihood of the target tokens over all rows: each row split where
    its first target token is, scored, and only its target tokens counted (a chat's user turns
    after the first answer are context, as in training). Summed in float64 in row order."""
    total, count = 0.0, 0
    for i in range(0, len(examples), chunk):
        rows = examples[i : i + chunk]
        firsts = [max(1, int(np.argmax(e.targets[1:])) + 1) for e in rows]
        prompts = [e.ids[:f] for e, f in zip(rows, firsts, strict=True)]
        completions = [e.ids[f:] for e, f in zip(rows, firsts, strict=True)]
        scores = runner.score(prompts, completions)
        for e, f, lp in zip(rows, firsts, scores, strict=True):
            mask = e.targets[f:]
            total -= float(np.asarray(lp, np.float64)[mask].sum())
            count += int(mask.sum())
    return total / max(count, 1)


# A pair's sequences are scored from their first token: every later token's log-prob, so ORPO's
# NLL (the whole chosen sequence) and both methods' answer sums come from the one pass.
def pair_logprobs(runner, pairs: list[Pair], chunk: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each pair's (chosen, rejected) token log-probs from the second token on (float64), in
    chunks of ``chunk`` pairs, under the runner's adapter."""
    out = []
    for i in range(0, len(pairs), chunk):
        seqs = [s for q in pairs[i : i + chunk] for s in (q.chosen, q.rejected)]
        got = [
            np.asarray(g, np.float64)
            for g in runner.score([s[:1] for s in seqs], [s[1:] for s in seqs])
        ]
        out += list(zip(got[::2], got[1::2], strict=True))
    return out


def _answers(pairs: list[Pair], scored) -> np.ndarray:
    """(P, 2): each answer's summed log-prob (token j + 1's log-prob is at j)."""
    return np.array(
        [
            (c[q.prompt - 1 :].sum(), r[q.prompt - 1 :].sum())
            for q, (c, r) in zip(pairs, scored, strict=True)
        ]
    )


def dpo_loss(pairs: list[Pair], policy, reference, beta: float) -> float:
    """DPO's mean loss over the pairs, as ``objectives.Dpo`` computes a batch's."""
    logps, refs = _answers(pairs, policy), _answers(pairs, reference)
    z = beta * ((logps[:, 0] - refs[:, 0]) - (logps[:, 1] - refs[:, 1]))
    return float(np.logaddexp(0.0, -z).mean())


def orpo_loss(pairs: list[Pair], policy, beta: float) -> float:
    """ORPO's loss over the pairs, as ``objectives.Orpo`` computes a batch's: the chosen
    sequences' token-mean NLL minus beta x the mean log-sigmoid of the log odds ratio."""
    nll = -sum(c.sum() for c, _ in policy) / sum(len(c) for c, _ in policy)
    counts = np.array([(len(q.chosen) - q.prompt, len(q.rejected) - q.prompt) for q in pairs])
    mean = _answers(pairs, policy) / counts
    odds = (mean[:, 0] - mean[:, 1]) - (log1mexp(mean[:, 0]) - log1mexp(mean[:, 1]))
    return float(nll + beta * np.logaddexp(0.0, -odds).mean())
