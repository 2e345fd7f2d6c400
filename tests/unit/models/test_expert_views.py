"""A Qwen3-MoE folder's experts read under the hub's per-expert names whatever layout stores them
(per expert, transformers 5's fused gate_up_proj, mlx-lm's stacked switch_mlp, quantized or not):
the same bytes, exactly, through spill's reader; a stack that does not split is refused."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from spill.engines.core.reader import ShardFiles
from spill.errors import ModelError
from spill.models.weights import fingerprint, weight_files
from spill.store.safetensors_io import read_header

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
save_file = pytest.importorskip("safetensors.torch").save_file
load_file = pytest.importorskip("safetensors.torch").load_file

EXPERTS, MLP = 6, "model.layers.0.mlp"  # layer 1 is dense (mlp_only_layers)
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
DTYPES = {"F32", "BF16", "U32"}


def _config():
    return transformers.Qwen3MoeConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=112,
        moe_intermediate_size=32,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        mlp_only_layers=[1],
    )


def _names(part: str = "weight") -> list[str]:
    return [f"{MLP}.experts.{e}.{p}.{part}" for e in range(EXPERTS) for p in PROJECTIONS]


def _write(folder, tensors, config_from):
    folder.mkdir()
    shutil.copy(config_from / "config.json", folder / "config.json")
    save_file({n: t.contiguous() for n, t in tensors.items()}, folder / "model.safetensors")
    return folder


def _mlx_stacked(hub_tensors: dict) -> dict:
    """mlx-lm's qwen3_moe layout (its ``sanitize``): each projection's experts stacked."""
    out = {n: t for n, t in hub_tensors.items() if ".mlp.experts." not in n}
    for p in PROJECTIONS:
        stack = [hub_tensors[f"{MLP}.experts.{e}.{p}.weight"] for e in range(EXPERTS)]
        out[f"{MLP}.switch_mlp.{p}.weight"] = torch.stack(stack)  # (E, rows, cols)
    return out


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def layouts(request, tmp_path_factory):
    """{layout: folder}: the hub's per-expert folder (save_pretrained), transformers 5's fused
    in-memory layout (the model's own state_dict) and mlx-lm's stacked one, of one model."""
    root = tmp_path_factory.mktemp("moe")
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(_config()).to(request.param)
    model.save_pretrained(root / "hub")
    hub = load_file(root / "hub" / "model.safetensors")
    return {
        "hub": root / "hub",
        "fused": _write(root / "fused", model.state_dict(), root / "hub"),
        "mlx": _write(root / "mlx", _mlx_stacked(hub), root / "hub"),
    }


def _read(folder, names) -> dict[str, bytes]:
    """Each tensor's bytes as spill's engines read them: ``ShardFiles.ranges`` and ``pread``."""
    shards = ShardFiles(weight_files(folder))
    out = {}
    try:
        for r in shards.ranges(names, DTYPES):
            buf = np.empty(r.nbytes, np.uint8)
            shards.pread(r.fd, [buf], r.start, r.shard)
            out |= {name: buf[a:b].tobytes() for a, b, name, _ in r.tensors}
    finally:
        shards.close()
    return out


def _bytes(t) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_every_layout_reads_the_hub_bytes(layouts):
    hub = load_file(layouts["hub"] / "model.safetensors")  # safetensors' own reading
    names = _names() + ["model.layers.1.mlp.gate_proj.weight", f"{MLP}.gate.weight"]
    want = {n: _bytes(hub[n]) for n in names}
    for layout, folder in layouts.items():
        assert _read(folder, names) == want, layout
        files = weight_files(folder)
        assert not any("gate_up_proj" in n or "switch_mlp" in n for n in files.tensor_shard)
        assert files.viewed == {"hub": 0, "fused": 2, "mlx": 3}[layout]


def test_views_look_like_the_per_expert_folders_entries(layouts):
    hub = weight_files(layouts["hub"])
    assert hub.stored is None and hub.stored_headers() is hub.headers
    for layout in ("fused", "mlx"):
        files = weight_files(layouts[layout])
        assert set(files.tensor_shard) == set(hub.tensor_shard), layout
        for n in _names():
            a, b = hub.tensor_info(n), files.tensor_info(n)
            assert (a["dtype"], a["shape"]) == (b["dtype"], b["shape"]), n
            assert (
                a["data_offsets"][1] - a["data_offsets"][0]
                == b["data_offsets"][1] - b["data_offsets"][0]
            )


def _on_disk_fingerprint(folder) -> str:
    """``fingerprint`` written out over the shards' own headers, as read from disk."""
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    doc = {
        "config": json.loads((folder / "config.json").read_bytes()),
        "shards": [[s, (folder / s).stat().st_size] for s in shards],
        "headers": [read_header(folder / s) for s in shards],
        "sha256": [hashlib.sha256((folder / s).read_bytes()).hexdigest() for s in shards],
    }
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(raw).hexdigest()


def test_fingerprint_hashes_the_headers_on_disk(layouts):
    got = {layout: fingerprint(folder) for layout, folder in layouts.items()}
    assert got == {layout: _on_disk_fingerprint(folder) for layout, folder in layouts.items()}
    assert len(set(got.values())) == 3  # the same weights in another layout are other files


def _refused(tmp_path, hub_folder, tensors) -> str:
    folder = _write(tmp_path / "bad", tensors, hub_folder)
    with pytest.raises(ModelError) as err:
        weight_files(folder)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_refuses_a_gate_up_stack_that_does_not_split(layouts, tmp_path):
    tensors = load_file(layouts["fused"] / "model.safetensors")
    tensors[f"{MLP}.experts.gate_up_proj"] = tensors[f"{MLP}.experts.gate_up_proj"][:, :-1]
    says = _refused(tmp_path, layouts["hub"], tensors)
    assert "gate_up_proj has the shape [6, 63, 64]" in says and "gate_proj/up_proj" in says


def test_refuses_stacks_of_one_layer_with_other_expert_counts(layouts, tmp_path):
    tensors = load_file(layouts["mlx"] / "model.safetensors")
    down = f"{MLP}.switch_mlp.down_proj.weight"
    tensors[down] = tensors[down][:5]
    says = _refused(tmp_path, layouts["hub"], tensors)
    assert re.search(r"holds [56] experts but \S+ holds [56];", says) and "holds 5" in says


def test_refuses_experts_stored_in_two_layouts(layouts, tmp_path):
    tensors = load_file(layouts["hub"] / "model.safetensors")
    tensors |= {
        n: t
        for n, t in load_file(layouts["mlx"] / "model.safetensors").items()
        if "switch_mlp" in n
    }
    assert "stored both alone and in" in _refused(tmp_path, layouts["hub"], tensors)


def test_mlx_lm_quantized_experts_read_per_expert(layouts, tmp_path):
    """``mlx_lm convert -q`` of the hub folder: each expert's packed weight, scales and biases
    are what ``mx.quantize`` makes of that expert alone."""
    mx = pytest.importorskip("mlx.core", reason="mlx is not installed")
    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install mlx-lm)")
    hub = load_file(layouts["hub"] / "model.safetensors")
    if hub[_names()[0]].dtype != torch.float32:
        pytest.skip("one quantized folder is enough: made from the float32 one")
    src = tmp_path / "hf"
    shutil.copytree(layouts["hub"], src)
    config = json.loads((src / "config.json").read_text())
    # the hub's Qwen3-MoE configs name these as mlx-lm reads them; transformers 5 renames them
    config |= {"num_experts": EXPERTS, "rope_theta": config["rope_parameters"]["rope_theta"]}
    (src / "config.json").write_text(json.dumps(config))
    out = tmp_path / "q"
    argv = [
        sys.executable,
        "-m",
        "mlx_lm",
        "convert",
        "--hf-path",
        str(src),
        "--mlx-path",
        str(out),
    ]
    argv += ["-q", "--q-group-size", "32", "--q-bits", "4"]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    subprocess.run(argv, check=True, capture_output=True, env=env, timeout=300)
    names = [n for part in ("weight", "scales", "biases") for n in _names(part)]
    got = _read(out, names)
    for e in range(EXPERTS):
        for p in PROJECTIONS:
            module = f"{MLP}.experts.{e}.{p}"
            w = mx.array(hub[f"{module}.weight"].numpy())
            for part, a in zip(
                ("weight", "scales", "biases"), mx.quantize(w, group_size=32, bits=4), strict=True
            ):
                assert got[f"{module}.{part}"] == bytes(memoryview(a)), f"{module}.{part}"
    assert weight_files(out).viewed == 9
