"""LoRA training through the streaming ring: ``StreamTrainer``, every engine's ``base.Trainer``.

Two walks give the same gradients, bit for bit; the memory budget picks one per run (``plan``): kept
activations (resident layers whose whole step's activations fit the budget: no layer is computed
twice) or recompute (layers stream, or activations do not fit: one layer's graph at a time).
``plan``'s ``keep`` or ``recompute`` (the ``tune.activations`` setting, ``--activations``) forces
the choice (keep still needs resident layers). ``apply`` is the kernel's AdamW with the step count
passed in; ``state()`` is everything needed to continue exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from spill.engines.base import ACTIVATIONS, ActivationPlan, AdamW, TrainBatch
from spill.engines.core.common import (
    activation_bytes,
    check_batch,
    check_lora,
    check_params,
    dropout_seed,
    output_bytes,
)
from spill.engines.core.kernel import Array, LayerLora
from spill.engines.core.model import Model
from spill.errors import EngineError
from spill.models.config import ModelConfig
from spill.models.lora import LoraConfig, layer_targets, param_names


def layer_names(cfg: ModelConfig, lora: LoraConfig, i: int) -> list[str]:
    """Layer ``i``'s adapter tensors: A then B for each module, in ``layer_targets`` order."""
    return [f"layers.{i}.{m}.lora_{ab}" for m in layer_targets(cfg, lora, i) for ab in "ab"]


def layer_adapters(
    cfg: ModelConfig,
    lora: LoraConfig,
    i: int,
    arrays: dict[str, Array],
    dropouts: dict | None = None,
) -> LayerLora:
    """Layer ``i``'s adapters by module (``self_attn.q_proj``, ``mlp.experts.3.up_proj``):
    ``(A, B, scale)``, plus the module's dropout from ``dropouts`` when given."""
    out = {}
    for m in layer_targets(cfg, lora, i):
        stem = f"layers.{i}.{m}"
        entry = (arrays[stem + ".lora_a"], arrays[stem + ".lora_b"], lora.scale)
        if dropouts:
            entry += (dropouts[m],)
        out[m] = entry
    return out


class StreamTrainer:
    """float32 LoRA parameters, AdamW moments and accumulated gradients as kernel arrays."""

    def __init__(
        self,
        model: Model,
        lora: LoraConfig,
        budget: Callable[[int], int] | None = None,
    ):
        check_lora(lora)
        self.model, self.kernel, self.lora = model, model.kernel, lora
        # bytes activations may take now, given the bytes the trainer's own state holds
        self.budget = budget or (lambda held: model.kernel.memory_budget())
        self.names = param_names(model.cfg, lora)
        self._ready = False
        self.params: dict[str, Array] = {}
        self.m: dict[str, Array] = {}
        self.v: dict[str, Array] = {}
        self.grads: dict[str, Array] = {}
        self._plan: ActivationPlan | None = None  # None: each micro-batch decides for itself

    # -- state -------------------------------------------------------------------------------

    def set_state(
        self, params: dict[str, np.ndarray], m: dict[str, np.ndarray], v: dict[str, np.ndarray]
    ) -> None:
        """Adopt copies of (params, m, v); empty moments mean zeros (a fresh run). Zeroes grads."""
        cfg, k = self.model.cfg, self.kernel
        check_params(cfg, self.lora, params, "trainer params")
        self.params = k.params(params)
        for what, given in (("m", m), ("v", v)):
            if given:
                check_params(cfg, self.lora, given, f"trainer moment {what}")
                setattr(self, what, k.params(given))
            else:
                setattr(self, what, {n: k.zeros_like(p) for n, p in self.params.items()})
        self.grads = {n: k.zeros_like(p) for n, p in self.params.items()}
        k.sync(self.params, self.m, self.v, self.grads)
        self._ready = True

    def held_bytes(self) -> int:
        """Bytes the trainer's own state takes: adapters, both moments, gradients."""
        return sum(a.nbytes for d in (self.params, self.m, self.v, self.grads) for a in d.values())

    def state(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]:
        """(params, m, v) as float32 numpy copies."""

        def copy(arrays):
            return {n: self.kernel.numpy(arrays[n]) for n in self.names}

        return copy(self.params), copy(self.m), copy(self.v)

    # -- forward and backward through the ring -----------------------------------------------

    # LoRA dropout masks are a pure function of (``batch.dropout_seed``, layer, module): the
    # module's seed (``common.dropout_seed``) keys the kernel's generator, so the recompute draws
    # the forward's masks (each engine draws its own masks; with dropout 0 the engines compute the
    # same function).
    def _lora(self, i: int, seed: int):
        """Layer ``i``'s adapters as a function of its leaves (in ``layer_names`` order)."""
        dropouts = None
        if self.lora.dropout > 0:
            p = self.lora.dropout
            dropouts = {
                m: self.kernel.dropout(p, dropout_seed(seed, i, m))
                for m in layer_targets(self.model.cfg, self.lora, i)
            }
        cfg, names = self.model.cfg, layer_names(self.model.cfg, self.lora, i)

        def build(leaves: Sequence[Array]) -> LayerLora:
            arrays = dict(zip(names, leaves, strict=True))
            return layer_adapters(cfg, self.lora, i, arrays, dropouts)

        return names, build

    # Both walks run the same ops in the same order on the same inputs (the recompute's forward of a
    # layer is the kept forward of that layer), so streamed, resident, kept and recomputed gradients
    # are bit-identical; tests check it with exact equality.
    def plan(self, rows: int, length: int, activations: str = "auto") -> ActivationPlan:
        """Decide, for every later micro-batch, whether activations are kept: with ``auto`` they
        are when the layers are resident and a (rows, length) micro-batch's activations fit the
        budget (half the memory available now, after the weights were loaded, and within an
        explicit ``--memory``); ``keep`` or ``recompute`` decide instead (keep needs resident
        layers)."""
        self._plan = self._decide(rows, length, activations)
        return self._plan

    def _decide(self, rows: int, length: int, activations: str = "auto") -> ActivationPlan:
        m, k = self.model, self.kernel
        if activations not in ACTIVATIONS:
            raise EngineError(f"activations {activations!r}: use {', '.join(ACTIVATIONS)}")
        need = activation_bytes(m.cfg, self.lora, rows, length, k.itemsize)
        inputs = rows * length * m.cfg.num_hidden_layers * m.cfg.hidden_size * k.itemsize
        budget = self.budget(self.held_bytes())
        # routed experts stream even where the rest of each layer is resident
        resident = m.ring.resident and m.ring.experts is None
        streams = "layers stream" if not m.ring.resident else "experts stream"
        if activations == "keep" and not resident:
            return ActivationPlan(False, need, budget, streams)
        if activations != "auto":
            return ActivationPlan(
                activations == "keep", need, budget, f"--activations {activations}"
            )
        if resident and need <= budget:
            return ActivationPlan(True, need, budget)
        # routed experts: their cache took the room kept outputs would (a 17 GB MoE model's tune
        # kept 0.35 GB beyond its plan and was OOM-killed inside 8 GiB, docs/reports/022)
        names = k.kept_outputs() if m.ring.experts is None else frozenset()
        outputs = output_bytes(m.cfg, names, rows, length, k.itemsize) if names else 0
        # the layer inputs the recompute keeps come first out of the same budget
        room = budget - inputs
        why = "" if resident else streams
        return ActivationPlan(False, need, budget, why, outputs if outputs <= room else 0)

    def accumulate(self, batch: TrainBatch) -> float:
        """Forward and backward through the ring; add ``scale`` x d(loss sum) to the gradients
        (with ``batch.objective``: d(its loss)). Returns the micro-batch's summed token loss
        times ``scale`` (or the objective's loss)."""
        tokens, attention, targets = check_batch(batch, self.model.cfg.vocab_size)
        if not self._ready:
            raise EngineError("the trainer has no state yet; call set_state first")
        rows, cols = np.nonzero(targets[:, 1:])  # the hidden state at cols predicts cols + 1
        if len(rows) == 0:
            return 0.0
        plan = self._plan or self._decide(*tokens.shape)
        if plan.keep:
            return self._kept(tokens, attention, rows, cols, batch)
        return self._recompute(tokens, attention, rows, cols, batch, plan.outputs > 0)

    def token_losses(self, batch: TrainBatch) -> np.ndarray:
        """Each target's cross-entropy under the base alone (no adapter), float32 in
        ``np.nonzero(targets[:, 1:])`` order: the forward ``accumulate`` runs, with the very ops,
        so at a zero adapter (a fresh run) the two give the same bits (DPO's reference)."""
        tokens, attention, targets = check_batch(batch, self.model.cfg.vocab_size)
        m, k = self.model, self.kernel
        rows, cols = np.nonzero(targets[:, 1:])
        with k.inference():
            ctx = k.context(attention, 0, tokens.shape[1])
            x = k.embed_ids(k.array(tokens))
            for i, w in m.ring.walk(range(m.cfg.num_hidden_layers)):
                x = k.layer(i, w, x, ctx, None, None)
                k.sync(x)
            return k.target_ces(x, tokens, rows, cols)

    # Kept activations: one forward over every layer and the head records what backward needs, and
    # backward runs once through it (the kernel's ``stack_vjp``: one autograd graph on torch, one
    # ``mx.vjp`` over the stack on MLX).
    def _kept(self, tokens, attention, rows, cols, batch: TrainBatch) -> float:
        """One forward over the resident layers that keeps what backward needs, then backward."""
        m, k, seed = self.model, self.kernel, batch.dropout_seed
        ctx = k.context(attention, 0, tokens.shape[1])
        ws, names, leaves, builds = [], [], [], []
        for i, w in m.ring.walk(range(m.cfg.num_hidden_layers)):  # resident: never evicts
            layer_names_i, build = self._lora(i, seed)
            ws.append(w)
            names.append(layer_names_i)
            leaves.append([self.params[n] for n in layer_names_i])
            builds.append(build)
        x = k.embed_ids(k.array(tokens))
        loss, got = k.stack_vjp(
            ws, x, ctx, leaves, builds, tokens, rows, cols, batch.scale, batch.objective
        )
        for layer_names_i, gs in zip(names, got, strict=True):
            for name, g in zip(layer_names_i, gs, strict=True):
                self.grads[name] = self.grads[name] + g
        k.sync(list(self.grads.values()))
        return loss

    # Recompute: forward keeps each layer's input hidden state (and, when they fit the budget too,
    # the base outputs of the kernel's ``kept_outputs`` linears, which the recompute then takes
    # instead of computing them again: the same bits, half a layer's matmuls fewer on torch); the
    # kernel's head (final norm, lm_head, a float32 cross-entropy over the target tokens) gives the
    # loss and its gradient at the last layer's output. Backward walks the ring in reverse,
    # recomputes each layer from its saved input through the kernel's ``layer_vjp`` with respect to
    # that input and the layer's LoRA tensors, and hands the input's gradient down. So only one
    # layer's graph exists at a time, and resident mode can run the very same code (its ring just
    # never evicts).
    def _recompute(self, tokens, attention, rows, cols, batch: TrainBatch, reuse: bool) -> float:
        """Keep each layer's input (and with ``reuse`` some of its matmul outputs); backward
        recomputes each layer from them, one at a time."""
        m, k, seed = self.model, self.kernel, batch.dropout_seed
        layers = m.cfg.num_hidden_layers
        ctx = k.context(attention, 0, tokens.shape[1])
        saved: list = [None] * layers  # each layer's input (B, T, hidden)
        outputs: list = [{} if reuse else None for _ in range(layers)]
        x = k.embed_ids(k.array(tokens))
        for i, w in m.ring.walk(range(layers)):
            saved[i] = x
            names, build = self._lora(i, seed)
            x = k.layer(i, w, x, ctx, None, build([self.params[n] for n in names]), outputs[i])
            k.sync(x)
        loss, grad = k.head_vjp(x, tokens, rows, cols, batch.scale, batch.objective)
        for i, w in m.ring.walk(range(layers - 1, -1, -1)):
            x, saved[i] = saved[i], None
            names, build = self._lora(i, seed)
            leaves = [self.params[n] for n in names]
            # nothing below layer 0 takes a gradient
            given, outputs[i] = outputs[i], None
            grad, got = k.layer_vjp(i, w, x, ctx, leaves, build, grad, i > 0, given)
            for name, g in zip(names, got, strict=True):
                self.grads[name] = self.grads[name] + g
            k.sync([self.grads[n] for n in names], *([grad] if grad is not None else []))
        return loss

    # -- gradients across processes ----------------------------------------------------------

    def take_grads(self) -> np.ndarray:
        """The accumulated gradients as one float32 vector (``names`` order), then zero them:
        what one micro-batch adds, for a process group to share (``spill.jobs.group``)."""
        k = self.kernel
        flat = np.concatenate([k.numpy(self.grads[n]).ravel() for n in self.names])
        self.grads = {n: k.zeros_like(p) for n, p in self.params.items()}
        k.sync(list(self.grads.values()))
        return flat

    def add_grads(self, flat: np.ndarray) -> None:
        """Add a ``take_grads`` vector to the gradients: one addition per tensor, as
        ``accumulate`` adds one micro-batch, so folding micro-batches in their order gives
        the bits one process accumulating them in that order gets."""
        k, at = self.kernel, 0
        for n in self.names:
            shape = self.params[n].shape
            size = int(np.prod(shape))
            piece = flat[at : at + size].reshape(shape)
            self.grads[n] = self.grads[n] + k.params({n: piece})[n]
            at += size
        k.sync(list(self.grads.values()))

    # -- the optimizer -----------------------------------------------------------------------

    # The step count is passed in: the trainer carries no hidden counters.
    def apply(self, opt: AdamW) -> None:
        """One AdamW update from the accumulated gradients, then zero them. An expert no token
        reached has zero gradients and is still stepped (decay, moments), as torch's AdamW
        steps PEFT's one tensor over all experts and mlx-lm's optimizer ``LoRASwitchLinear``'s."""
        self.kernel.adamw(opt, self.names, self.params, self.m, self.v, self.grads)
