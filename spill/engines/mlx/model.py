"""A causal LM in MLX as resident parts (embeddings, final norm, lm_head) around a ring of layers.

The family module (``llama``, ``qwen2``) is picked once from the config; it supplies the layer
function and the names of a layer's tensors. ``forward`` is the one path every caller takes,
streamed or resident, with or without a KV cache, with or without adapters. It evaluates after
every layer: MLX is lazy, and a graph that still referenced a released slot would keep its
weights alive (and run the whole model at the end, defeating the ring).
"""

from __future__ import annotations

from types import ModuleType

import mlx.core as mx
import numpy as np

from spill.engines.mlx import llama, qwen2
from spill.engines.mlx.ops import Context, KVCache, context, inv_freq, rms_norm
from spill.engines.mlx.ring import Ring, WeightReader
from spill.models.config import ModelConfig
from spill.models.lora import MODULES, LoraConfig

FAMILIES: dict[str, ModuleType] = {"llama": llama, "qwen2": qwen2}
LOGIT_ROWS = 1024  # scoring computes lm_head in chunks of this many rows


def to_float32(arrays: dict[str, np.ndarray]) -> dict[str, mx.array]:
    """Own float32 copies (``mx.array`` copies, so nothing is shared with the caller)."""
    return {n: mx.array(np.asarray(a, dtype=np.float32)) for n, a in arrays.items()}


class Model:
    def __init__(self, cfg: ModelConfig, reader: WeightReader, ring: Ring):
        self.cfg, self.reader, self.ring = cfg, reader, ring
        self.family = FAMILIES[cfg.family]
        self.dtype = reader.dtype
        self.embed = reader.tensor("model.embed_tokens.weight")  # (V, hidden)
        self.norm = reader.tensor("model.norm.weight")
        tied = cfg.tie_word_embeddings or not reader.has("lm_head.weight")
        self.lm_head = self.embed if tied else reader.tensor("lm_head.weight")
        self.freq = inv_freq(cfg)
        mx.eval(self.embed, self.norm, self.lm_head, self.freq)

    @staticmethod
    def layer_loader(cfg: ModelConfig, reader: WeightReader):
        keys = FAMILIES[cfg.family].layer_keys(cfg)

        def load(i: int) -> dict[str, mx.array]:
            found = reader.tensors([f"model.layers.{i}.{k}" for k in keys])
            return {k: found[f"model.layers.{i}.{k}"] for k in keys}

        return load

    def adapters(self, lora: LoraConfig, arrays: dict[str, mx.array]) -> dict[int, dict]:
        """Per layer, per module (``self_attn.q_proj``): ``(A, B, scale)`` from spill's names."""
        return {
            i: {
                MODULES[t]: (
                    arrays[f"layers.{i}.{MODULES[t]}.lora_a"],
                    arrays[f"layers.{i}.{MODULES[t]}.lora_b"],
                    lora.scale,
                )
                for t in lora.targets
            }
            for i in range(self.cfg.num_hidden_layers)
        }

    def context(self, valid, start: int, length: int) -> Context:
        ctx = context(valid, start, length, self.freq, self.dtype)
        mx.eval(ctx.cos, ctx.sin, ctx.mask)
        return ctx

    def caches(self, batch: int, length: int) -> list[KVCache]:
        c = self.cfg
        return [
            KVCache(batch, c.num_key_value_heads, length, c.head_dim, self.dtype)
            for _ in range(c.num_hidden_layers)
        ]

    # The pieces of a forward pass, public so a training loop can walk the ring itself.
    def embed_ids(self, ids):
        return self.embed[ids]  # (B, T, hidden)

    def layer(self, w: dict, x, ctx: Context, cache=None, lora=None):
        return self.family.layer(self.cfg, w, x, ctx, cache, lora)

    def final_norm(self, x):
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps)

    def forward(self, ids, ctx: Context, caches=None, lora=None):
        """ids (B, T) -> final-normed hidden states (B, T, hidden), walking every layer.

        ``lora``, when given, maps a layer index to that layer's adapters.
        """
        x = self.embed_ids(ids)
        for i, w in self.ring.walk(range(self.cfg.num_hidden_layers)):
            cache = caches[i] if caches is not None else None
            x = self.layer(w, x, ctx, cache, lora.get(i) if lora else None)
            mx.eval(x, *(cache.arrays() if cache is not None else ()))
        return self.final_norm(x)

    def logits(self, h):
        """h (N, hidden) -> float32 logits (N, V)."""
        return (h @ self.lm_head.T).astype(mx.float32)

    def close(self) -> None:
        self.ring.close()
        self.reader.close()
        self.embed = self.norm = self.lm_head = None
