"""A mixture-of-experts model's tensors as llama.cpp's ``qwen3moe`` GGUF holds them: each routed
layer's experts stacked projection by projection (``ffn_gate_exps``: (experts, out, in)), as
``convert_hf_to_gguf.py`` writes them (``layout``, ``stream``); what that architecture cannot hold
is refused in one line (``refuse``): llama.cpp's qwen3moe routes every layer and always
renormalizes the top-k weights, so dense layers (``mlp_only_layers``, ``decoder_sparse_step`` over
1) and ``norm_topk_prob`` false have no GGUF form. The merge is read projection by projection, so
memory stays at one stacked tensor (one projection of every expert of a layer), not the layer.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from spill.errors import UnsupportedModel
from spill.jobs.export.merge import Inputs, merged, plan
from spill.models.gguf.arch import EXPERT

Layout = list[tuple[str, tuple[int, ...], tuple[str, ...]]]  # (name, shape, merged tensors)


def refuse(inputs: Inputs, arch: str) -> None:
    """One line for an MoE model that llama.cpp's ``arch`` cannot run as spill does."""
    cfg = inputs.config
    dense = [i for i in range(cfg.num_hidden_layers) if i not in cfg.sparse]
    if dense:
        raise UnsupportedModel(
            f"{inputs.base_name}: its layers {dense} have a dense MLP, which llama.cpp's {arch} "
            "has no form for (it routes every layer); export --format hf or --format mlx"
        )
    if not cfg.norm_topk_prob:
        raise UnsupportedModel(
            f"{inputs.base_name}: norm_topk_prob is false, but llama.cpp's {arch} always "
            "renormalizes the top-k weights; export --format hf or --format mlx"
        )


def add_keys(writer, inputs: Inputs) -> None:
    """The expert keys llama.cpp's loader reads (``<arch>.expert_count`` ...)."""
    cfg = inputs.config
    writer.add_expert_count(cfg.experts)
    writer.add_expert_used_count(cfg.experts_per_token)
    writer.add_expert_feed_forward_length(cfg.expert_size)


def layout(inputs: Inputs) -> Layout:
    """``(name, shape, merged tensors)`` in ``plan`` order, every expert's projection of a
    layer stacked in the first one's place (``model.layers.<k>.mlp.experts.gate_proj.weight``
    of (experts, out, in), ``models.gguf.arch.ROUTED``); any other tensor alone."""
    out: Layout = []
    stacks: dict[str, int] = {}  # stacked name -> its index in out
    for name, shape in plan(inputs):
        layer, _, rest = name.removeprefix("model.layers.").partition(".")
        m = EXPERT.fullmatch(rest) if name.startswith("model.layers.") else None
        if m is None:
            out.append((name, shape, (name,)))
            continue
        key = f"model.layers.{layer}.mlp.experts.{m[2]}.weight"
        if key not in stacks:
            stacks[key] = len(out)
            out.append((key, shape, ()))
        k = stacks[key]
        _, first, parts = out[k]
        assert first == shape, (name, shape, first)  # every expert's projection alike
        out[k] = (key, first, (*parts, name))
    return [(n, (len(p), *s) if len(p) > 1 or n != p[0] else s, p) for n, s, p in out]


def stream(inputs: Inputs, tensors: Layout) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, float32 array)`` of every entry of ``tensors``, stacked ones assembled from
    the merge as it comes, one stack held at a time."""
    names = [p for _, _, parts in tensors for p in parts]
    source = merged(inputs, names)
    for name, _, parts in tensors:
        got = [next(source) for _ in parts]
        assert [n for n, _ in got] == list(parts)
        yield name, got[0][1] if parts == (name,) else np.stack([w for _, w in got])
