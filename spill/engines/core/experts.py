"""A streamed MoE model's routed experts, read when its tokens route to them (``Experts``).

A sparse layer's attention, norms and router come through the ring; its experts stay on disk. The
family asks for the experts its tokens chose (``need``, read before the first is used) and takes each
expert's weights from the layer's dict (``Routed``). Experts read stay in a cache bounded in bytes
inside the memory budget (``Experts._evict`` says which go first); a decode step reads only the
experts not cached, a tune step the union its batch routes to.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from spill.engines.base import Stats
from spill.engines.core.ring import Hooks, Weights
from spill.models.config import ModelConfig
from spill.models.family_keys import EXPERT_LINEARS, EXPERTS
from spill.models.weights import WeightFiles


class Routed(dict):
    """A sparse layer's weights whose experts (``mlp.experts.<e>.*``) are read when asked for:
    each lookup gives the expert's tensor in the compute form, made then."""

    def __init__(self, w: Weights, layer: int, experts: Experts):
        super().__init__(w)
        self.layer, self.experts = layer, experts
        self.made: list[tuple[Weights, Weights]] = []  # (compute form, as read) handed out

    def __missing__(self, key: str):
        if not key.startswith(EXPERTS):
            raise KeyError(key)
        return self.experts.expert(self, key)


def need(w: Weights, chosen: Iterable[int]) -> None:
    """Read the experts ``chosen`` of a layer at once where they stream (``w`` is ``Routed``)."""
    if isinstance(w, Routed):
        w.experts.read(w.layer, list(chosen))


class Experts:
    """Routed experts by (layer, expert), read through ``reader`` (an engine's weight reader,
    ``hooks.ready`` applied once) and kept within ``cache`` bytes (``_evict`` says which go
    first); ``stats.extra`` counts the bytes read against what whole layers would have
    read."""

    def __init__(
        self,
        cfg: ModelConfig,
        reader,
        hooks: Hooks,
        files: WeightFiles,
        cache: int,
        stats: Stats | None = None,
    ):
        self.cfg, self.reader, self.hooks, self.files = cfg, reader, hooks, files
        self.capacity, self.stats = cache, stats or Stats()
        # (layer, expert) -> (tensors, bytes), least recently used first
        self._cache: OrderedDict[tuple[int, int], tuple[Weights, int]] = OrderedDict()
        self._stale: OrderedDict[tuple[int, int], None] = OrderedDict()  # not chosen last time
        self._layer: dict[int, set[int]] = {}  # layer -> its experts cached
        self.held = 0  # bytes of the cached experts, as read
        self.read_bytes = 0  # expert bytes read from the files so far
        self.whole = 0  # what reading every expert of each sparse layer walked would have read
        self.reads = self.hits = 0
        every = range(cfg.experts)
        self._all = {
            i: self.file_bytes([n for e in every for n in self.names(i, e)]) for i in cfg.sparse
        }

    def attach(self, i: int, w: Weights) -> Weights:
        """Layer ``i``'s weights as the family computes with them."""
        if i not in self.cfg.sparse:
            return w
        for e in self._layer.get(i, ()):  # stale unless this walk chooses them again
            self._stale[(i, e)] = None
        self.whole += self._all[i]
        self._note()
        return Routed(w, i, self)

    def names(self, i: int, e: int) -> list[str]:
        return [f"model.layers.{i}.{EXPERTS}{e}.{p}.weight" for p in EXPERT_LINEARS]

    def file_bytes(self, names: list[str]) -> int:
        """Bytes ``names`` take in the files (a packed weight's scales and biases too)."""
        have, total = self.files.tensor_shard, 0
        for name in names:
            module = name.removesuffix(".weight")
            for part in (name, f"{module}.scales", f"{module}.biases"):
                if part in have:
                    lo, hi = self.files.tensor_info(part)["data_offsets"]
                    total += hi - lo
        return total

    # Each expert is read on its own: a read's buffer holds exactly that expert's tensors, so
    # evicting it frees what the cache counted (experts read together shared the buffers of the
    # contiguous ranges they made, and an evicted one kept its neighbours' memory alive: a tune
    # inside 8 GiB was OOM-killed so).
    def read(self, i: int, chosen: list[int]) -> None:
        """Have layer ``i``'s experts ``chosen`` cached, those missing read, in file order."""
        missing = [e for e in chosen if (i, e) not in self._cache]
        self.hits += len(chosen) - len(missing)
        for e in missing:
            mine = self.names(i, e)
            nbytes = self.file_bytes(mine)
            self._cache[(i, e)] = (self.hooks.ready(self.reader.tensors(mine)), nbytes)
            self._layer.setdefault(i, set()).add(e)
            self.held += nbytes
            self.read_bytes += nbytes
        self.reads += len(missing)
        for e in chosen:
            self._cache.move_to_end((i, e))
            self._stale.pop((i, e), None)
        keep = len(chosen)  # the layer's own, just used (the newest), stay whatever the capacity
        while self.held > self.capacity and len(self._cache) > keep:
            self._evict(keep)
        self._note()

    # What goes first: an expert its layer did not choose the last time the walk came by (the
    # oldest such first), since routing has moved on; when every cached expert was chosen then,
    # the most recently used one of another layer. A walk goes through the layers in turn, so
    # when the experts it chooses outgrow the cache, the one used last is needed again last:
    # least recently used first would evict each expert just before the next walk asks for it
    # (a batch-8 decode of a 30B-A3B shape found none of its ~1,700 experts a step in the cache
    # so; docs/reports/022-moe.md).
    def _evict(self, keep: int) -> None:
        """Let one expert go (the comment above says which), none of the ``keep`` newest."""
        if self._stale:
            key, _ = self._stale.popitem(last=False)
        else:
            key = next(k for n, k in enumerate(reversed(self._cache)) if n >= keep)
        _, nbytes = self._cache.pop(key)
        self._layer[key[0]].discard(key[1])
        self.held -= nbytes

    def expert(self, w: Routed, key: str):
        """The layer ``w``'s expert tensor ``key`` (``mlp.experts.3.up_proj.weight``) in its
        compute form, remembered until ``detach``."""
        name = f"model.layers.{w.layer}.{key}"
        e = int(key[len(EXPERTS) :].split(".", 1)[0])
        if (w.layer, e) not in self._cache:
            self.read(w.layer, [e])
        loaded = {name: self._cache[(w.layer, e)][0][name]}
        made = self.hooks.expand(loaded)
        if made is not loaded:
            w.made.append((made, loaded))
        return made[name]

    def detach(self, w: Weights) -> None:
        """The layer's use of ``w`` is over: the compute forms made for it go back to the
        engine (its pool: the next layer's expand reuses their memory, no page faults)."""
        if isinstance(w, Routed):
            for made, loaded in w.made:
                self.hooks.discard(made, loaded)
            w.made.clear()

    def _note(self) -> None:
        self.stats.extra.update(
            expert_bytes_read=self.read_bytes,
            expert_bytes_whole=self.whole,
            experts_read=self.reads,
            experts_found=self.hits,
            expert_cache_bytes=self.held,
        )

    def close(self) -> None:
        self._cache.clear()
        self._stale.clear()
        self._layer.clear()
        self.held = 0
