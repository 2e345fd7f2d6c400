"""The streaming ring: decoder layers come from local safetensors into K slots, just in time.

``Ring.walk(order)`` yields ``(index, weights)`` for the layers in any order (forward now, reversed
for a backward pass); weights are valid only until the next step. Three modes: streaming (expand per
use), held (every packed layer loaded once at open, expanded per use: walkers see a streaming ring,
``resident`` is False) and resident (every layer loaded and expanded once at open). The ring never
touches an array; what an engine does around a load lives in ``Hooks``. Streamed and resident runs
get the same arrays, so they are bit-identical.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from spill.engines.base import Stats

Weights = dict[str, Any]  # one layer's arrays, keyed like the HF checkpoint below the layer
# The prefetch thread expands, at most ``EXPANDED`` layers alive at once (the one computing and the
# next): on torch with two threads a layer, dequantizing on the computing thread made a SmolLM2
# decode step 6-14x slower, idle or beside a busy process (equal with one thread; docs/quantized.md,
# ``bench/quant_ring.py where``, which flips ``EXPAND_AHEAD``).
EXPANDED = 2  # expanded layers alive at once when the prefetch thread expands
EXPAND_AHEAD = True  # expand on the prefetch thread; False: on the computing thread, as it uses


# A CUDA side stream for the copy, MLX's bf16 bit-cast on the computing thread, a CPU reader taking
# back a released slot's memory. Both streaming and resident modes hand the compute code the same
# arrays (read from the same bytes, converted the same way).
class Hooks:
    """What an engine changes about loading a layer; these defaults change nothing."""

    expands = False  # ``expand`` makes a new form (the prefetch thread then bounds how many)

    def load(self, fn: Callable[[int], Weights], i: int) -> Weights:
        """Run the loader for layer ``i`` (on the loader thread in streaming mode)."""
        return fn(i)

    def ready(self, w: Weights) -> Weights:
        """On the computing thread, before compute uses ``w``: changes ``w`` in place (the ring
        clears that very dict on release) and returns it."""
        return w

    def expand(self, w: Weights) -> Weights:
        """On the computing thread, each time compute is about to use the loaded layer ``w``:
        the arrays compute takes (a new dict, or ``w`` itself)."""
        return w

    def discard(self, x: Weights, w: Weights) -> None:
        """``expand(w)`` gave ``x`` and compute is done with it (called only when ``x`` is not
        ``w``)."""

    def release(self, w: Weights) -> None:
        """A slot's arrays, just before the ring drops them."""


# A prefetch thread loads up to K-1 layers ahead of the one being computed; K semaphore permits
# bound how many layers are alive at once, and a layer's slot is released (its dict cleared) when
# the walk moves past it. In resident mode every layer is loaded once and the walk only looks them
# up; in held mode nothing keeps a layer's weights past its step. A slot holds a layer as loaded,
# which for a quantized model is its packed form; ``Hooks.expand`` gives the form compute uses (the
# torch engine dequantizes; an engine that computes on packed weights keeps the default, which
# changes nothing).
class Ring:
    """K slots of decoder layers over a loader ``load(i) -> {key: array}``."""

    def __init__(
        self,
        load: Callable[[int], Weights],
        layers: int,
        slots: int,
        resident: bool,
        stats: Stats,
        hooks: Hooks | None = None,
        held: bool = False,
        between: Callable[[], object] | None = None,
        experts: Any = None,
    ):
        assert slots >= 1
        # resident: every layer's compute form lives for the run (a walker may keep it);
        # held: every layer is loaded once, as loaded, and expanded per use
        self._load_fn, self.layers, self.slots, self.resident = load, layers, slots, resident
        self.held = held and not resident
        self.hooks = hooks or Hooks()
        self.between = between or (lambda: None)  # after each layer's use (a budget's heap trim)
        # a streamed MoE model's routed experts (``core.experts.Experts``): a sparse layer's
        # weights are handed out attached to them, its experts read as routed
        self.experts = experts
        self.stats = stats
        self._lock = threading.Lock()
        self._live: set[int] = set()
        self.max_live = 0
        self.wait_seconds = 0.0  # time the walk waited on the loader
        self._resident: list[Weights] = []
        if resident:  # the loaded form is dropped once expanded (a packed one is garbage)
            self._resident = [self.hooks.expand(self._ready(i)) for i in range(layers)]
        elif self.held:
            self._resident = [self._ready(i) for i in range(layers)]

    def _ready(self, i: int) -> Weights:
        return self.hooks.ready(self._load(i))

    def live(self) -> set[int]:
        """Indices of the layers loaded right now."""
        with self._lock:
            return set(self._live)

    def _load(self, i: int) -> Weights:
        t = time.perf_counter()
        w = self.hooks.load(self._load_fn, i)
        with self._lock:
            self._live.add(i)
            self.max_live = max(self.max_live, len(self._live))
            self.stats.layer_loads += 1
            self.stats.load_seconds += time.perf_counter() - t
        return w

    def _release(self, i: int, w: Weights) -> None:
        self.hooks.release(w)
        w.clear()
        with self._lock:
            self._live.discard(i)

    def walk(self, order: Sequence[int]) -> Iterator[tuple[int, Weights]]:
        """Yield ``(i, weights)`` for each layer in ``order``; weights live until the next step,
        so a lazy engine evaluates what it computed from them before moving on."""
        order = list(order)
        if self.resident:
            for i in order:
                yield from self._attached(i, self._resident[i])
                self.between()
            return
        streaming = not self.held
        ahead = EXPAND_AHEAD and self.hooks.expands
        permits = threading.Semaphore(self.slots)
        expanded = threading.Semaphore(EXPANDED)
        ready: queue.Queue = queue.Queue()
        stop = threading.Event()

        def prefetch():
            for i in order:
                if streaming:
                    permits.acquire()
                    if stop.is_set():
                        return
                try:
                    w = self._load(i) if streaming else self._resident[i]
                    if ahead:
                        expanded.acquire()
                        if stop.is_set():
                            ready.put((i, w, w, None))  # released by the walk's cleanup
                            return
                        ready.put((i, w, self.hooks.expand(w), None))
                    else:
                        ready.put((i, w, w, None))
                except BaseException as e:  # handed to the walk, which raises it
                    ready.put((i, None, None, e))
                    return

        loader = threading.Thread(target=prefetch, name="spill-ring", daemon=True)
        loader.start()

        def done(i: int, w: Weights, x: Weights) -> None:
            if x is not w:
                self.hooks.discard(x, w)
            if streaming:
                self._release(i, w)

        try:
            for _ in order:
                t = time.perf_counter()
                i, w, x, error = ready.get()
                self.wait_seconds += time.perf_counter() - t
                if error is not None:
                    raise error
                try:
                    if ahead:
                        yield from self._attached(i, self.hooks.ready(x))
                    else:
                        yield from self._use(i, self.hooks.ready(w))
                finally:
                    done(i, w, x)
                    expanded.release()
                    permits.release()
                self.between()
        finally:
            stop.set()
            for _ in order:
                permits.release()  # the loader never blocks again
                expanded.release()
            loader.join()
            while not ready.empty():
                i, w, x, _ = ready.get()
                if w is not None:
                    done(i, w, x)

    def _use(self, i: int, w: Weights) -> Iterator[tuple[int, Weights]]:
        x = self.hooks.expand(w)
        try:
            yield from self._attached(i, x)
        finally:
            if x is not w:
                self.hooks.discard(x, w)

    def _attached(self, i: int, w: Weights) -> Iterator[tuple[int, Weights]]:
        """``(i, w)``, a sparse layer's weights attached to its routed experts while used."""
        if self.experts is None:
            yield i, w
            return
        routed = self.experts.attach(i, w)
        try:
            yield i, routed
        finally:
            self.experts.detach(routed)

    def close(self) -> None:
        if self.experts is not None:
            self.experts.close()
        for w in self._resident:
            w.clear()
        self._resident = []
