"""Opening a model on an engine (``open_runner``): the decisions every engine makes, in one order,
once. The core first checks that every tensor the model reads exists with the shape config.json
gives it (a packed linear's weight, scales and biases included: ``common.check_layers``), before any
is read. The engine places the model (device, numerics and why, a weight reader: ``Backend.place``);
the core plans the ring from the memory budget (``common.plan_model_ring``), builds it with the
engine's hooks, and lets the engine read the resident parts into its kernel. Embeddings, the final
norm and lm_head are always resident; decoder layers stream.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any, Protocol

from spill.engines.base import EngineInfo, LoadOptions, ModelSpec, Stats, TuneShape
from spill.engines.core import budget as memory
from spill.engines.core import heap
from spill.engines.core.common import RingPlan, check_layers, plan_model_ring, tune_bytes
from spill.engines.core.experts import Experts
from spill.engines.core.kernel import Kernel
from spill.engines.core.model import Model
from spill.engines.core.ring import Hooks, Ring, Weights
from spill.engines.core.runner import StreamRunner
from spill.errors import UnsupportedModel
from spill.models.config import ModelConfig
from spill.models.family_keys import EXPERT_LINEARS, EXPERTS
from spill.models.weights import WeightFiles, layer_bytes, tensors_bytes, weight_files
from spill.store.written import drop_written

SMALL_HIDDEN = 256  # below this hidden size a CPU computes on one thread (torch's and OpenBLAS's)
# a streamed MoE model's experts are read as routed (``core.experts``); False: inside whole layers,
# as a dense model's streams (bench/moe.py's baseline, ``--whole``)
ROUTED = True
# The expert cache leaves this share of what it could take to the heap: its buffers come and go
# as experts are read and evicted, and the heap held ~300 MiB over its count at the peak of a tune
# of a 17 GB MoE model planned to fill 7808 MiB (RSS 8497 MiB, measured; docs/reports/022).
HEAP_SHARE = 4


@dataclass(frozen=True)
class Placement:
    """Where and how an engine computes one model, decided at open."""

    device: Any  # the engine's device object
    device_name: str  # as ``EngineInfo`` reports it
    dtype: Any  # the engine's compute dtype for base weights
    numerics: str  # "float32" or "bfloat16"
    why: str  # why these numerics (a measurement, the device)
    itemsize: int  # bytes per base weight in ``dtype``
    budget: Callable[[], int]  # the default ring budget, asked only without ``options.memory``
    # ``tensors(names) -> {name: array}``, ``has(name)``, ``drop_behind()``, ``close()``
    reader: Any
    weights_note: str = ""  # what the engine changes about a quantized base's weights, if any
    # the engine's hooks expand a packed layer into ``dtype`` per use (torch); the plan then
    # keeps a quantized model's float form resident where it fits. False: packed is computed on
    expands: bool = False
    # ``(bits, group_size, (out, in)) -> bool``: the packed modules an expanding engine computes
    # on in a packed form of its own (torch's int4 kernel) instead of a float copy; None: none
    computes_packed: Callable[[int, int, tuple[int, int]], bool] | None = None


class Backend(Protocol):
    name: str
    families: dict[str, ModuleType]  # family -> its module (``layer``: one decoder layer's math)

    def place(self, cfg: ModelConfig, folder, options: LoadOptions) -> Placement: ...

    def hooks(self, place: Placement, resident: bool) -> Hooks: ...

    def kernel(self, cfg: ModelConfig, place: Placement) -> Kernel: ...


def layer_loader(reader, keys: Callable[[int], Sequence[str]]) -> Callable[[int], Weights]:
    """``load(i)``: layer ``i``'s tensors (``keys(i)``) keyed below ``model.layers.<i>.``, in
    one read."""

    def load(i: int) -> Weights:
        names = keys(i)
        found = reader.tensors([f"model.layers.{i}.{k}" for k in names])
        return {k: found[f"model.layers.{i}.{k}"] for k in names}

    return load


def _text_part(cfg: ModelConfig, files: WeightFiles) -> str:
    """The pre-run line's words for a multimodal folder of which spill runs the text model."""
    if cfg.text_of is None:
        return ""
    return f"the text model of a {cfg.text_of} folder, its vision tower ignored ({files.ignored} tensors)"


def _weights(model: ModelSpec, place: Placement, plan: RingPlan) -> str:
    """The pre-run line's words for a quantized base (its format and the GGUF types it kept,
    and where an expanding engine dequantizes it)."""
    if not model.config.quantization:
        return ""
    from spill.models.cache import read_marker
    from spill.models.quant import describe

    tensors = read_marker(model.folder).get("tensors") or {}
    kept = [t["ggml_type"] for t in tensors.values() if isinstance(t, dict) and "bits" in t]
    text = describe(model.config.quantization, kept)
    if not place.expands:
        return text
    kernel = place.computes_packed is not None  # 4-bit modules stay packed, in its layout
    if plan.resident:
        return f"{text}, {'int4 matmul' if kernel else 'dequantized to ' + place.numerics} at load"
    held = "held packed" if plan.held else "packed slots"
    how = "int4 matmul" if kernel else "dequantized"
    return f"{text}, {held} ({plan.slot_bytes / 1e6:.1f} MB a layer), {how} per use"


def _plan(cfg: ModelConfig, files, place: Placement, options: LoadOptions, routed: bool):
    """The ring's plan, its layers with their routed experts or without (``common.plan_model_ring``;
    a quantized layer's slot sized by its packed bytes, ``models.weights.layer_bytes``)."""
    packed = compute = None
    if cfg.quantization and place.expands:
        packed = layer_bytes(cfg, files, place.itemsize, routed=routed)
        if place.computes_packed is not None:
            compute = layer_bytes(cfg, files, place.itemsize, place.computes_packed, routed)
    return plan_model_ring(cfg, place.itemsize, options, place.budget, packed, compute, routed)


# While a sparse layer computes, the routed experts it made are alive in their compute form until
# it is done (a tune's backward needs them; the engine's pool takes them back after): all of the
# layer's, since a micro-batch or a prompt of a few dozen tokens routes to nearly every expert (a
# batch-8 decode counted as 64 experts sat at 7.9 GB of an 8 GiB limit, docs/reports/022).
def _routed_bytes(cfg: ModelConfig, files, place: Placement) -> int:
    """Bytes a sparse layer's experts take in their compute form."""
    i = cfg.sparse[0]
    one = [f"model.layers.{i}.{EXPERTS}0.{p}.weight" for p in EXPERT_LINEARS]
    # an expanding engine computes on the float form of what it does not compute packed
    packed = (place.computes_packed or (lambda *_: False)) if place.expands else None
    each = tensors_bytes(cfg, files, one, place.itemsize, packed)
    return each * cfg.experts


def _experts(cfg: ModelConfig, experts: Experts | None) -> str:
    """The pre-run line's words for an MoE model's experts read as routed."""
    if experts is None:
        return ""
    return (
        f"experts read as routed ({cfg.experts_per_token} of {cfg.experts} a token, "
        f"a cache of {experts.capacity / 2**20:.0f} MiB)"
    )


def open_runner(
    engine: Backend, model: ModelSpec, options: LoadOptions, tune: TuneShape | None = None
) -> StreamRunner:
    cfg = model.config
    if cfg.family not in engine.families:
        raise UnsupportedModel(
            f"the {engine.name} engine has no {cfg.family!r} family; "
            f"use {' or '.join(sorted(engine.families))}"
        )
    if cfg.quantization and not getattr(engine, "quantized", False):
        raise UnsupportedModel(
            f"{model.folder}: quantized weights; the {engine.name} engine cannot compute on them "
            "yet: use --engine torch, or the float copy (`spill models import ... --dequantize`, "
            "smollm2:135m@f32)"
        )
    files = weight_files(model.folder)
    check_layers(model, files)  # before the engine places it (the int4 kernel's file reads it)
    place = engine.place(cfg, model.folder, options)
    layers = cfg.num_hidden_layers
    # --memory (or the cgroup's limit) is the whole budget: the ring plans from what the
    # resident parts leave of it, and the reader leaves no page cache behind (core.budget)
    budget = memory.resolve(options.budget)
    resident = memory.resident_bytes(cfg, place.itemsize)
    # a tune's state and its micro-batch's least activations (recomputed) come out of M first
    reserve = 0 if tune is None else tune_bytes(cfg, tune, place.itemsize)
    share = memory.ring_share(budget, resident + reserve)
    between = None
    if share is not None:
        options = replace(options, memory=share)
        place.reader.drop_behind()
        between = heap.trim if heap.return_between_layers() else None
    drop_written(share is not None)
    plan = _plan(cfg, files, place, options, True)
    # an MoE model whose layers stream reads each sparse layer's experts as routed
    routed = ROUTED and bool(cfg.experts) and not (plan.resident or plan.held)
    plan = _plan(cfg, files, place, options, False) if routed else plan
    using = _routed_bytes(cfg, files, place) if routed else 0
    memory.check_fits(budget, resident, plan.layer_memory() + using, plan.slots, reserve)
    stats = Stats()
    hooks = engine.hooks(place, plan.resident or plan.held)  # held layers: read, never mapped
    keys = [cfg.layer_keys(i, not routed) for i in range(layers)]  # once, not per load
    loader = layer_loader(place.reader, keys.__getitem__)
    experts = None
    if routed:
        room = budget.total if budget.total is not None else place.budget()
        left = max(0, room - resident - reserve - plan.layer_memory() - using)
        cache = left - left // HEAP_SHARE
        experts = Experts(cfg, place.reader, hooks, files, cache, stats)
    ring = Ring(
        loader, layers, plan.slots, plan.resident, stats, hooks, plan.held, between, experts
    )
    info = EngineInfo(
        engine=engine.name,
        device=place.device_name,
        numerics=place.numerics,
        why=place.why,
        ring=plan.slots,
        layers=layers,
        resident=plan.resident or plan.held,
        weights=", ".join(
            w
            for w in (
                _text_part(cfg, files),
                _weights(model, place, plan),
                place.weights_note,
                _experts(cfg, experts),
            )
            if w
        ),
        memory=budget.words(),
    )
    kernel = engine.kernel(cfg, place)
    # the routed experts in use and their cache are the layers' too (a tune's budget counts them)
    held = plan.layer_memory() + using + (experts.capacity if experts is not None else 0)
    return StreamRunner(Model(kernel, ring), info, stats, share, held)
