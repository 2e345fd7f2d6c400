"""The core's plain helpers: plans, checks and numpy bookkeeping around the ring.

Plain Python and numpy only: the ring plan, argument checks that raise the same
``EngineError`` on every engine, the adapter's tensor shapes, the LoRA dropout seed hash, the
AdamW bias corrections, and the numpy bookkeeping of batching and scoring.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass

import numpy as np

from spill.engines.base import (
    AdamW,
    GenerateParams,
    LoadOptions,
    ModelSpec,
    Stats,
    TrainBatch,
    TuneShape,
)
from spill.engines.core.kernel import LOGIT_ROWS
from spill.engines.core.ring import EXPANDED
from spill.errors import EngineError, ModelError
from spill.models.config import ModelConfig
from spill.models.lora import EXPERT_TARGETS, LoraConfig, layer_targets
from spill.models.quant import Spec, check_packed
from spill.models.weights import WeightFiles

# -- opening: the ring plan and the checks on the weights -------------------------------------


def plan_ring(
    layers: int, layer_bytes: int, ring: int | None, resident: bool, budget: int
) -> tuple[int, bool]:
    """(slots, resident) for ``layers`` layers of ``layer_bytes`` each.

    ``resident`` wins, then a forced ``ring``; otherwise everything is resident when it fits
    in ``budget`` bytes, else the ring takes as many slots as fit (at least 2, to overlap).
    """
    if resident:
        return layers, True
    if ring is not None:
        if ring < 1:
            raise EngineError(f"ring {ring} is too small; use --ring 1 or more (2 streams)")
        return min(ring, layers), False
    if layers * layer_bytes <= budget:
        return layers, True
    return min(max(2, budget // max(layer_bytes, 1)), layers), False


@dataclass(frozen=True)
class RingPlan:
    """How a model's decoder layers live: ``slots`` of ``slot_bytes`` each (a layer as read:
    packed for a quantized model); ``resident``: every layer in its compute form for the run;
    ``held``: every layer as read, expanded into its compute form per use."""

    slots: int
    resident: bool
    held: bool
    slot_bytes: int
    expand_bytes: int  # a layer's compute form when it differs from the slot's (else 0)

    def layer_memory(self) -> int:
        """Bytes the layers take once the ring is full."""
        if self.resident:
            return self.slots * (self.expand_bytes or self.slot_bytes)
        return self.slots * self.slot_bytes + EXPANDED * self.expand_bytes


def plan_model_ring(
    cfg: ModelConfig,
    itemsize: int,
    options: LoadOptions,
    available: Callable[[], int],
    packed_bytes: int | None = None,
    compute_bytes: int | None = None,
    routed: bool = True,
) -> RingPlan:
    """The ring plan of a model whose weights take ``itemsize`` bytes each in the compute dtype;
    ``available()`` is the device's default budget, asked only when ``options.memory`` gives
    none. ``packed_bytes``: a quantized layer's bytes as read, where the engine expands it into
    the compute dtype (torch). Then the float model resident if it fits, else the packed model
    held if it fits, else packed slots streamed (``EXPANDED`` expanded layers beside them).
    ``compute_bytes``: the expanded layer's bytes when the engine computes on a packed form of
    its own (torch's int4 kernel): resident in that form if it fits (or asked), else streamed."""
    # a layer as compute takes it (an MoE layer's routed experts left out unless ``routed``)
    float_bytes = compute_bytes or cfg.layer_params(routed=routed) * itemsize
    # Resident parts come out of the default budget; an explicit one is the ring's own.
    head_bytes = cfg.vocab_size * cfg.hidden_size * itemsize
    head_bytes *= 1 if cfg.tie_word_embeddings else 2
    budget = options.budget
    if budget is None:
        budget = max(0, available() - head_bytes)
    layers = cfg.num_hidden_layers
    if packed_bytes is None or (compute_bytes is None and packed_bytes >= float_bytes):
        slots, resident = plan_ring(layers, float_bytes, options.ring, options.resident, budget)
        return RingPlan(slots, resident, False, float_bytes, 0)
    fits = options.ring is None and layers * float_bytes <= budget
    if fits or (compute_bytes is not None and options.resident):
        return RingPlan(layers, True, False, packed_bytes, float_bytes)
    expanded = EXPANDED * float_bytes  # the layer computing and the next, expanded
    held = options.ring is None and layers * packed_bytes + expanded <= budget
    if compute_bytes is None and (options.resident or held):
        return RingPlan(layers, False, True, packed_bytes, float_bytes)
    room = max(0, budget - expanded)
    slots, _ = plan_ring(layers, packed_bytes, options.ring, False, room)
    return RingPlan(slots, False, False, packed_bytes, float_bytes)


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a model reads but lm_head, by name, with the shape config.json gives it (a
    packed linear's float shape, (out, in)), decoder layers first."""
    h = cfg.hidden_size
    shapes = {
        f"model.layers.{i}.{k}": shape
        for i in range(cfg.num_hidden_layers)
        for k, shape in cfg.layer_shapes(i).items()
    }
    return shapes | {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}


def check_layers(model: ModelSpec, files: WeightFiles) -> None:
    """Fail at open, by name, before any tensor is read or a buffer sized: every tensor the model
    reads exists with the shape config.json gives it, and each packed linear is one packed form
    whose weight, scales and biases fit it (``quant.check_packed``)."""
    cfg, have = model.config, files.tensor_shard
    shapes = weight_shapes(cfg)
    if not cfg.tie_word_embeddings and "lm_head.weight" in have:  # else the embedding is the head
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    missing = [n for n in shapes if n not in have]
    if missing:
        raise ModelError(
            f"{model.folder}: tensor {missing[0]!r} is missing ({len(missing)} in all); "
            "fetch the model again"
        )
    for name, shape in shapes.items():
        module = name.removesuffix(".weight")
        parts = {p: f"{module}.{p}" for p in ("weight", "scales", "biases")}
        if module != name and (parts["scales"] in have or parts["biases"] in have):
            if not cfg.quantization:
                raise ModelError(
                    f"{files.folder / 'config.json'}: {module} is quantized but config.json has "
                    "no quantization; re-import or re-quantize the model"
                )
            found = {
                p: (str(files.folder / have[n]), files.tensor_info(n)) if n in have else None
                for p, n in parts.items()
            }
            check_packed(module, Spec(*cfg.quant_spec(module)), shape, found)
            continue
        actual = tuple(files.tensor_info(name)["shape"])
        if actual != shape:
            raise ModelError(
                f"{files.folder / have[name]}: {name} is {list(actual)}, where config.json makes "
                f"it {list(shape)}; the file is damaged or not this config's: fetch, import or "
                "quantize the model again"
            )


def tensor_spans(
    files: WeightFiles, names, dtypes: Container[str]
) -> list[tuple[str, int, int, str]]:
    """(shard, start, end, name) of each tensor, sorted into file order; raises for a missing
    tensor or one whose dtype is not in ``dtypes``."""
    spans = []
    for name in names:
        shard = files.tensor_shard.get(name)
        if shard is None:
            raise ModelError(f"{files.folder}: tensor {name!r} is missing; fetch the model again")
        info = files.headers[shard][name]
        if info["dtype"] not in dtypes:
            raise ModelError(
                f"{files.folder / shard}: tensor {name!r} has unsupported dtype "
                f"{info['dtype']}; convert the model to F32, F16 or BF16"
            )
        spans.append((shard, *info["data_offsets"], name))
    spans.sort()
    return spans


def sync_ring_stats(stats: Stats, ring) -> None:
    stats.extra["ring_max_live"] = ring.max_live
    stats.extra["ring_wait_seconds"] = ring.wait_seconds


# -- adapters and training ----------------------------------------------------------------------


def param_shapes(cfg: ModelConfig, lora: LoraConfig) -> dict[str, tuple[int, int]]:
    """Each adapter tensor's shape by name, in ``param_names`` order."""
    out = {}
    for k in range(cfg.num_hidden_layers):
        for m, (fan_in, fan_out) in layer_targets(cfg, lora, k).items():
            out[f"layers.{k}.{m}.lora_a"] = (fan_in, lora.rank)
            out[f"layers.{k}.{m}.lora_b"] = (lora.rank, fan_out)
    return out


def check_params(cfg: ModelConfig, lora: LoraConfig, arrays: dict, what: str) -> None:
    """Raise, naming the first difference, unless ``arrays`` holds exactly the adapter's tensors."""
    want = param_shapes(cfg, lora)
    missing = [n for n in want if n not in arrays]
    extra = sorted(set(arrays) - set(want))
    if missing or extra:
        first = f"{missing[0]!r} is missing" if missing else f"{extra[0]!r} is unexpected"
        raise EngineError(
            f"{what}: {first} for a rank-{lora.rank} adapter on {', '.join(lora.targets)}; "
            "give the tensors of the same LoRA config"
        )
    for name, shape in want.items():
        if tuple(arrays[name].shape) != shape:
            raise EngineError(
                f"{what}: {name!r} has shape {tuple(arrays[name].shape)}, expected {shape}; "
                "give the tensors of the same model and LoRA config"
            )


def check_lora(lora: LoraConfig) -> None:
    if lora.rank < 1 or not 0.0 <= lora.dropout < 1.0:
        raise EngineError(
            f"LoRA rank {lora.rank}, dropout {lora.dropout}: use rank >= 1, dropout in [0, 1)"
        )


def dropout_seed(seed: int, layer: int, module: str) -> int:
    """The seed of one module's dropout mask in one micro-batch (each engine keys its own
    generator with it, so a recompute draws the forward's mask)."""
    digest = hashlib.sha256(f"spill-lora-dropout:{seed}:{layer}:{module}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def check_batch(batch: TrainBatch, vocab: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens as int64, attention, targets) of a training batch, checked."""
    tokens = np.asarray(batch.tokens)
    attention = np.asarray(batch.attention, dtype=bool)
    targets = np.asarray(batch.targets, dtype=bool)
    if tokens.ndim != 2 or attention.shape != tokens.shape or targets.shape != tokens.shape:
        raise EngineError("a training batch needs tokens, attention and targets of one (B, T)")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
        raise EngineError(f"training token ids must lie in [0, {vocab})")
    if (targets & ~attention).any():
        raise EngineError("a training target falls on padding; targets must be real tokens")
    return tokens.astype(np.int64), attention, targets


def activation_bytes(
    cfg: ModelConfig, lora: LoraConfig, rows: int, length: int, itemsize: int
) -> int:
    """What a whole step's kept activations take for a (rows, length) micro-batch: per token and
    layer, the tensors autograd saves (two norms, q/k/v/o and their rotary copies, the repeated
    KV heads, the MLP's four intermediates, each adapter's float32 input and rank-r product) plus
    the attention weights (heads x length per token, float32). SmolLM2-135M at 4 x 128 in float32:
    1.16 GB estimated, 1.04 to 1.09 GB of peak RSS measured over the recompute walk
    (docs/reports/011-speed-tune.md)."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    base = (6 * h + 6 * q + 4 * kv + 5 * inter) * itemsize
    # a token passes experts_per_token experts' adapters of each expert target
    per = sum(
        cfg.experts_per_token if cfg.experts and t in EXPERT_TARGETS else 1 for t in lora.targets
    )
    adapters = per * lora.rank * 4 + 4 * h * 2  # the float32 adapter inputs
    attention = 2 * cfg.num_attention_heads * length * 4
    return rows * length * cfg.num_hidden_layers * (base + adapters + attention)


def tune_bytes(cfg: ModelConfig, tune: TuneShape, itemsize: int) -> int:
    """The least a tune holds beside the layers: its state (adapters, both moments, gradients,
    float32), the layer inputs the recompute keeps for a micro-batch, one layer's activations
    while it is recomputed, and the head's chunk (float32 logits, their log-softmax and
    gradient)."""
    lora, rows, length = tune.lora, tune.rows, tune.length
    params = sum(math.prod(s) for s in param_shapes(cfg, lora).values())
    state = 4 * 4 * params
    inputs = rows * length * cfg.num_hidden_layers * cfg.hidden_size * itemsize
    layer = activation_bytes(cfg, lora, rows, length, itemsize) // cfg.num_hidden_layers
    head = 3 * LOGIT_ROWS * cfg.vocab_size * 4
    return state + inputs + layer + head


def output_bytes(
    cfg: ModelConfig, names: frozenset[str], rows: int, length: int, itemsize: int
) -> int:
    """What keeping the base outputs of the linears ``names`` (``mlp.gate_proj``) of every layer
    takes for a (rows, length) micro-batch."""
    width = {m: out for m, (_, out) in cfg.linear_shapes().items()}
    per_token = sum(width[n] for n in names if n in width) * itemsize
    return rows * length * cfg.num_hidden_layers * per_token


def long_rope(cfg: ModelConfig, valid: np.ndarray, start: int, length: int) -> bool:
    """Whether a forward of ``length`` tokens at ``start`` (valid keys (B, S)) turns by longrope's
    long factors: transformers' choice per forward, its longest position + 1 past
    ``original_max_position_embeddings`` (positions count valid tokens, as ``context``'s)."""
    if not cfg.rope_long:
        return False
    positions = np.maximum(np.cumsum(valid, axis=-1) - 1, 0)[:, start : start + length]
    return int(positions.max(initial=0)) + 1 > cfg.rope_original


def adamw_factors(opt: AdamW) -> tuple[float, float]:
    """(step size, sqrt of the second bias correction) of torch's AdamW, as Python floats."""
    if opt.step < 1:
        raise EngineError(f"AdamW step {opt.step}: steps count from 1")
    step_size = opt.lr / (1 - opt.beta1**opt.step)
    bc2_sqrt = (1 - opt.beta2**opt.step) ** 0.5
    return step_size, bc2_sqrt


# -- generation and scoring ---------------------------------------------------------------------


def check_rows(rows: Sequence[np.ndarray], what: str, vocab: int) -> None:
    for r, row in enumerate(rows):
        row = np.asarray(row)
        if row.ndim != 1 or (len(row) and (row.min() < 0 or row.max() >= vocab)):
            raise EngineError(f"{what} {r}: token ids must be a 1-D array in [0, {vocab})")


def check_generate(
    prompts: Sequence[np.ndarray], params: GenerateParams, seeds: Sequence[int], vocab: int
) -> None:
    if len(seeds) != len(prompts):
        raise EngineError(f"{len(prompts)} prompts but {len(seeds)} seeds; give one per row")
    check_rows(prompts, "prompt", vocab)
    if any(len(p) == 0 for p in prompts):
        raise EngineError("an empty prompt cannot be continued; give at least one token")
    if params.temperature < 0 or not 0 < params.top_p <= 1:
        raise EngineError("sampling needs temperature >= 0 and top_p in (0, 1]")


def check_score(
    prompts: Sequence[np.ndarray], completions: Sequence[np.ndarray], vocab: int
) -> None:
    if len(prompts) != len(completions):
        raise EngineError(f"{len(prompts)} prompts but {len(completions)} completions")
    check_rows(prompts, "prompt", vocab)
    check_rows(completions, "completion", vocab)
    if any(len(p) == 0 for p in prompts):
        raise EngineError("scoring needs at least one prompt token before the completion")


def left_pad(rows: Sequence[np.ndarray], length: int) -> tuple[np.ndarray, np.ndarray]:
    """ids (B, length) int64 and valid (B, length) bool, each row flush right."""
    ids = np.zeros((len(rows), length), dtype=np.int64)
    valid = np.zeros((len(rows), length), dtype=bool)
    for r, row in enumerate(rows):
        n = len(row)
        if n:
            ids[r, length - n :] = np.asarray(row, dtype=np.int64)
            valid[r, length - n :] = True
    return ids, valid
