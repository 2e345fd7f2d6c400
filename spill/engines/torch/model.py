"""A causal LM as resident parts (embeddings, final norm, lm_head) around a ring of layers.

The family module (``llama``, ``qwen2``) is picked once from the config; it supplies the layer
function and the names of a layer's tensors. ``forward`` is the one path every caller takes,
streamed or resident, with or without a KV cache, with or without adapters.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F

from spill.engines.torch import llama, qwen2
from spill.engines.torch.ops import Context, KVCache, context, inv_freq, rms_norm
from spill.engines.torch.ring import Ring, WeightReader
from spill.models.config import ModelConfig
from spill.models.lora import MODULES, LoraConfig

FAMILIES: dict[str, ModuleType] = {"llama": llama, "qwen2": qwen2}
LOGIT_ROWS = 1024  # scoring computes lm_head in chunks of this many rows


def to_float32(arrays: dict[str, np.ndarray], device) -> dict[str, torch.Tensor]:
    """Own float32 copies on ``device`` (never sharing memory with the caller's arrays)."""
    return {
        n: torch.tensor(np.asarray(a, dtype=np.float32), dtype=torch.float32, device=device)
        for n, a in arrays.items()
    }


class Model:
    def __init__(self, cfg: ModelConfig, reader: WeightReader, ring: Ring):
        self.cfg, self.reader, self.ring = cfg, reader, ring
        self.family = FAMILIES[cfg.family]
        self.device, self.dtype = reader.device, reader.dtype
        self.embed = reader.tensor("model.embed_tokens.weight")  # (V, hidden)
        self.norm = reader.tensor("model.norm.weight")
        tied = cfg.tie_word_embeddings or not reader.has("lm_head.weight")
        self.lm_head = self.embed if tied else reader.tensor("lm_head.weight")
        self.freq = inv_freq(cfg).to(self.device)

    @staticmethod
    def layer_loader(cfg: ModelConfig, reader: WeightReader):
        keys = FAMILIES[cfg.family].layer_keys(cfg)

        def load(i: int) -> dict[str, torch.Tensor]:
            found = reader.tensors([f"model.layers.{i}.{k}" for k in keys])
            return {k: found[f"model.layers.{i}.{k}"] for k in keys}

        return load

    def adapters(self, lora: LoraConfig, tensors: dict[str, torch.Tensor]) -> dict[int, dict]:
        """Per layer, per module (``self_attn.q_proj``): ``(A, B, scale)`` from spill's names."""
        return {
            i: {
                MODULES[t]: (
                    tensors[f"layers.{i}.{MODULES[t]}.lora_a"],
                    tensors[f"layers.{i}.{MODULES[t]}.lora_b"],
                    lora.scale,
                )
                for t in lora.targets
            }
            for i in range(self.cfg.num_hidden_layers)
        }

    def context(self, valid, start: int, length: int) -> Context:
        return context(valid, start, length, self.freq, self.dtype)

    def caches(self, batch: int, length: int) -> list[KVCache]:
        c = self.cfg
        return [
            KVCache(batch, c.num_key_value_heads, length, c.head_dim, self.dtype, self.device)
            for _ in range(c.num_hidden_layers)
        ]

    # The pieces of a forward pass, public so a training loop can walk the ring itself (save
    # each layer's input going forward, recompute it from there walking back).
    def embed_ids(self, ids):
        return F.embedding(ids, self.embed)  # (B, T, hidden)

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
        return self.final_norm(x)

    def logits(self, h):
        """h (N, hidden) -> float32 logits (N, V)."""
        return F.linear(h, self.lm_head).float()

    def close(self) -> None:
        self.ring.close()
        self.reader.close()
        self.embed = self.norm = self.lm_head = None
