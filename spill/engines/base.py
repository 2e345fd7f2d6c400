"""The engine boundary: the few calls every engine (torch, mlx) implements.

Everything crossing it is plain: numpy arrays of token ids in, numpy arrays and dataclasses out.
Tokenization, chat templates, files and jobs stay on spill's side. ``spill.engines.core``
implements ``Runner`` and ``Trainer`` once; a new engine is one package under
``spill/engines/<name>/`` with an ``Engine`` (``core.open.Backend``), a ``core.kernel.Kernel``
and its model families.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from spill.models.config import ModelConfig
from spill.models.lora import LoraConfig
from spill.settings import ACTIVATIONS, LoadOptions  # noqa: F401  (the seam's option types)


@dataclass(frozen=True)
class ModelSpec:
    """A model folder on local disk, already checked and parsed."""

    folder: Path
    config: ModelConfig


@dataclass(frozen=True)
class EngineInfo:
    engine: str
    device: str
    numerics: str  # compute dtype of the base weights; adapters are always float32
    why: str  # why these numerics (a measurement, the device)
    ring: int  # layer slots
    layers: int
    resident: bool
    weights: str = ""  # a quantized base's format ("4-bit affine g32 from Q4_1"); "" for floats
    memory: str = ""  # the budget and its source ("memory 144 MiB (--memory)"); "" for none

    def line(self) -> str:
        mode = (
            "resident" if self.resident else f"streaming, ring {self.ring} of {self.layers} layers"
        )
        weights = f" · weights {self.weights}" if self.weights else ""
        memory = f" · {self.memory}" if self.memory else ""
        return f"engine {self.engine} · device {self.device} · numerics {self.numerics} ({self.why}) · {mode}{weights}{memory}"


@dataclass(frozen=True)
class GenerateParams:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    stop_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Generation:
    tokens: np.ndarray  # (n,) int64, generated ids without the stop token
    finish: str  # "stop", "length" or "cancelled" (``on_token`` asked to end the row)


# called with (row, token id) for each generated token as it is chosen (not a stop token);
# returning True ends that row
OnToken = Callable[[int, int], bool | None]


@dataclass(frozen=True)
class Token:
    """A token as a server reports it: its log-prob under the model's raw logits (log-softmax,
    before temperature), and the ``k`` likeliest (id, log-prob), most likely first."""

    id: int
    logprob: float | None = None  # None: not asked, or a prompt's first token
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Request:
    """One generation that joins a running batch (``Runner.serve``); its callbacks run on the
    thread that runs ``serve``."""

    prompt: np.ndarray  # (n,) int64, n >= 1
    params: GenerateParams
    seed: int = 0
    adapter: str | None = None  # a name given to ``Runner.add_adapter``; None: the base model
    logprobs: int | None = None  # None: none; 0: the chosen token's; k: also the k likeliest
    echo: bool = False  # ``on_prompt`` first sees the prompt's tokens with their log-probs
    on_prompt: Callable[[list[Token]], None] | None = None
    on_token: Callable[[Token], bool | None] | None = None  # True: cancel the row
    on_done: Callable[[Generation], None] | None = None  # once, as the row finishes


# ``Runner.serve``'s source of requests: called between decode steps with ``idle`` (no row is
# running, so it may block); what it returns joins the batch at the next step; None: no more
Take = Callable[[bool], Sequence[Request] | None]


@dataclass
class Stats:
    """Counters a runner keeps: what its ring loaded and generated (tests and benchmarks read
    them to check the ring; no job reports them)."""

    generated_tokens: int = 0
    layer_loads: int = 0
    load_seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    def routed(self) -> dict[str, str]:
        """The final table's words where an MoE model's experts were read as routed
        (``core.experts``): their bytes read against what whole layers would have read."""
        read, whole = self.extra.get("expert_bytes_read"), self.extra.get("expert_bytes_whole")
        if read is None or not whole:
            return {}
        return {"experts_read": f"{_size(read)} of {_size(whole)} ({read / whole:.1%})"}


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"


@dataclass(frozen=True)
class TrainBatch:
    """One micro-batch for LoRA training (see ``spill.jobs.tune.data.micro_batch``)."""

    tokens: np.ndarray  # (B, T) int64, right-padded
    attention: np.ndarray  # (B, T) bool, real tokens
    targets: np.ndarray  # (B, T) bool, tokens whose prediction from position t-1 counts
    scale: float  # the summed token loss is multiplied by this (1 / target tokens in the step)
    dropout_seed: int  # LoRA dropout masks are a pure function of (this, layer, module)
    objective: Objective | None = None  # another loss of the targets' cross-entropies (DPO)


class Objective(Protocol):
    """A loss made from the targets' token cross-entropies other than their scaled sum (preference
    tuning, ``spill.jobs.tune.objectives``): ``(ce, rows, cols) -> (loss, weights)``, ``ce`` the
    float32 cross-entropy of each target in ``np.nonzero(targets[:, 1:])`` order, ``weights`` d
    loss / d ce per target. It runs on the host in numpy, so every engine computes it alike."""

    def __call__(
        self, ce: np.ndarray, rows: np.ndarray, cols: np.ndarray
    ) -> tuple[float, np.ndarray]: ...


@dataclass(frozen=True)
class AdamW:
    lr: float
    step: int  # 1-based count of this update, for bias correction
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0


@dataclass(frozen=True)
class BatchPlan:
    """How many rows a row job's batch holds, and why (``spill.engines.core.batching``)."""

    rows: int  # rows per batch
    why: str  # for the pre-run line: "from the memory budget (...)", "(--batch)"

    def line(self) -> str:
        return f"batch {self.rows} {self.why}"


@dataclass(frozen=True)
class ActivationPlan:
    """Whether a trainer keeps a step's activations (no recompute) and why: the estimate of a
    micro-batch's activations against the memory budget, or what forced the choice."""

    keep: bool
    need: int  # bytes, estimated
    budget: int  # bytes
    forced: str = ""  # what decided instead of the budget ("layers stream", --activations)
    outputs: int = 0  # bytes of base outputs the recompute keeps from the forward (0: none)

    def line(self) -> str:
        gb = 1e9
        est = f"est. {self.need / gb:.2f} GB"
        if self.forced:
            why = f"{self.forced}; {est}"
        else:
            why = f"{est} {'of' if self.keep else '>'} {self.budget / gb:.1f} GB budget"
        reuse = (
            f"; reuses {self.outputs / gb:.2f} GB of forward matmul outputs" if self.outputs else ""
        )
        return f"activations {'kept' if self.keep else 'recomputed'} ({why}){reuse}"


class Trainer(Protocol):
    """A LoRA adapter being trained on an engine: float32 parameters and AdamW moments.

    Arrays cross the boundary as float32 numpy, named as in ``spill.models.lora``
    (``layers.<k>.<module>.lora_a``); the optimizer moments use the same names.
    """

    def set_state(
        self, params: dict[str, np.ndarray], m: dict[str, np.ndarray], v: dict[str, np.ndarray]
    ) -> None: ...

    def state(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]:
        """(params, m, v) as float32 numpy copies."""
        ...

    def plan(self, rows: int, length: int, activations: str = "auto") -> ActivationPlan:
        """Decide once for the run whether (rows, length) micro-batches keep their activations
        (``auto``: when they fit the budget; or ``keep``, ``recompute``; unplanned, each
        micro-batch decides for its own shape); the results do not depend on it."""
        ...

    def accumulate(self, batch: TrainBatch) -> float:
        """Forward and backward through the ring; add ``scale`` x d(loss sum) to the gradients.

        Returns the micro-batch's summed token loss times ``scale``; with ``batch.objective``,
        the gradients and the loss are the objective's.
        """
        ...

    def token_losses(self, batch: TrainBatch) -> np.ndarray:
        """Each target's cross-entropy under the base alone, float32, computed as ``accumulate``
        computes it (the same bits at a zero adapter): DPO's reference."""
        ...

    def take_grads(self) -> np.ndarray:
        """The accumulated gradients as one float32 vector, then zero them."""
        ...

    def add_grads(self, flat: np.ndarray) -> None:
        """Add a ``take_grads`` vector (of any process) to the gradients."""
        ...

    def apply(self, opt: AdamW) -> None:
        """One AdamW update from the accumulated gradients, then zero them."""
        ...


class Runner(Protocol):
    info: EngineInfo
    stats: Stats
    # free device memory in bytes now; None: the host's (a CPU, MLX's unified memory)
    free_memory: Callable[[], int] | None

    def plan_batch(self, tokens: int, rows: int) -> BatchPlan:
        """The batch a row job of ``rows`` rows of at most ``tokens`` tokens runs at: as many
        rows as the memory left after the ring allows (at most 64), so that each walk over the
        layers serves them all."""
        ...

    def generate(
        self,
        prompts: Sequence[np.ndarray],
        params: GenerateParams,
        seeds: Sequence[int],
        on_token: OnToken | None = None,
    ) -> list[Generation]:
        """KV-cached generation for a batch; row r samples from its own generator ``seeds[r]``;
        ``on_token`` sees every token as it is chosen (see ``OnToken``)."""
        ...

    def score(
        self, prompts: Sequence[np.ndarray], completions: Sequence[np.ndarray]
    ) -> list[np.ndarray]:
        """Log-prob (float32) of each completion token given its prompt and the tokens before it."""
        ...

    def serve(self, take: Take) -> None:
        """Continuous batching: requests from ``take`` join the running batch at the next
        decode step (their prompts computed in the same walk over the layers) and leave as they
        finish; rows on different adapters share the batch. Returns once ``take`` gave None and
        the running rows finished. ``generate`` is this loop with one batch."""
        ...

    def add_adapter(self, name: str, lora: LoraConfig, params: dict[str, np.ndarray]) -> None:
        """A LoRA adapter that ``serve``'s requests name (``Request.adapter``)."""
        ...

    def use_adapter(self, lora: LoraConfig | None, params: dict[str, np.ndarray] | None) -> None:
        """Apply a LoRA adapter (float32 numpy, spill names) to later generate/score calls;
        ``None`` goes back to the base model."""
        ...

    def trainer(self, lora: LoraConfig) -> Trainer:
        """A trainer for a LoRA adapter on this runner's base weights (state set by the caller)."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class TuneShape:
    """What a tune will train, so that the opener reserves its state and the activations of its
    micro-batches out of a budget before the ring plans from what is left."""

    lora: LoraConfig
    rows: int  # a micro-batch's rows
    length: int  # tokens a row may have


class Engine(Protocol):
    name: str

    def open(self, model: ModelSpec, options: LoadOptions, tune: TuneShape | None = None) -> Runner:
        """``tune``: the runner will train (its needs come out of ``--memory`` first)."""
        ...
