"""``spill export`` of adapters tuned on Qwen3, Mistral, SmolLM3, Gemma 3 and Phi-3
(transformers-made folders): the merged HF folder loads in transformers and scores the gold
answers as ``spill eval --adapter`` does on the base (within 1e-5, float32); a GGUF spill's
writer cannot hold (a Gemma 3 whose sliding layers are not llama.cpp's fixed pattern, a window,
NoPE layers off llama.cpp's step, a tokenizer without merges) is refused in one line with
nothing left at OUT. A GGUF of Qwen3, Mistral (written as llama), SmolLM3, Phi-3 (fused, partial
rotary, and longrope as ``rope_factors_long/short``) and Gemma 3 (norms as llama.cpp's 1 + w, a
window shorter than the rows) imports back through spill's importer to the HF export's tensors
bit for bit (Gemma's norms: 1 + w bit for bit) and rotary (longrope's factors, original length
and attention factor), scores the same, and loads in transformers' GGUF loader where it reads
the architecture (qwen3 of head size 128, llama, phi3 rotating the whole head, gemma3 of
query_pre_attn_scalar 256, its default), within 1e-5 of spill; its Q4_0 form imports packed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from spill.models.config import load_config
from tests.conftest import run_spill
from tests.unit.engines import hf_families

ROWS = [
    {"id": 0, "prompt": "Question 5: what is 5 plus 8?", "answer": " 13."},
    {
        "id": 1,
        "prompt": "Question 11: what is 11 plus 14? And then some more words",
        "answer": " 25.",
    },
]
TUNE = ["--steps", "2", "--batch", "4", "--lr", "0.05", "--rank", "4", "--seq-len", "64"]
FLOAT = ["--dtype", "float32"]


ROTARY = ("rope_theta", "rotary_dim", "max_position_embeddings", "rope_short", "rope_long")
ROTARY += ("rope_original", "rope_attention", "rope_scaling", "query_beta")


def _ok(proc):
    assert proc.returncode == 0, proc.stderr
    return proc


def _spill(*args: str, home: Path):
    return run_spill(*args, env={"SPILL_HOME": str(home), "OMP_NUM_THREADS": "1"}, timeout=300)


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _gold_log_probs(folder: Path, model=None) -> list[float]:
    """transformers' summed log-prob of each row's answer after its prompt (spill's tokenizer of
    ``folder``; the model loaded from it unless given)."""
    import torch

    from spill.models.tokenizer import Tokenizer

    model, tok = model or hf_families.load(folder), Tokenizer(folder)
    out = []
    for row in ROWS:
        prompt, answer = tok.encode(row["prompt"]), tok.encode(row["answer"], False)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + answer])).logits[0].double()
        lp = torch.log_softmax(logits, -1)
        out.append(sum(lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(answer)))
    return out


REFUSED = {  # why each variant's GGUF is refused
    "qwen3": "has no BPE merges",  # the tiny tokenizer; test_a_gguf_... gives it a merge
    "mistral": "its sliding-window layers have no GGUF form",
    "smollm3": "its layers without rotary [1] are not llama.cpp's smollm3's (every 4th)",
    "gemma3": "its sliding layers [0, 2] are not llama.cpp's gemma3's (all but every 6th)",
    "phi3": "has no BPE merges",  # its longrope is written (test_a_gguf_... phi3-longrope)
    "phi3-long": "its sliding-window layers have no GGUF form",
}


@pytest.mark.parametrize("variant", list(REFUSED))
def test_the_hf_export_scores_as_spill_with_the_adapter_and_a_gguf_is_refused(
    variant, tmp_path, tiny_models
):
    home = tmp_path / "home"
    model = hf_families.make(variant, tmp_path / variant, tiny_models["llama"])
    train = _jsonl(
        tmp_path / "train.jsonl",
        [
            {"prompt": f"Question {i}: what is {i} plus {i + 3}?", "completion": f" {2 * i + 3}."}
            for i in range(8)
        ],
    )
    state = tmp_path / "state"
    argv = ["tune", str(model), str(train), "--name", "t", "--state", str(state)]
    _ok(_spill(*argv, *TUNE, "--targets", "all", *FLOAT, home=home))
    rows, graded = _jsonl(tmp_path / "rows.jsonl", ROWS), tmp_path / "eval.jsonl"
    adapter = str(state / "adapter")
    _ok(
        _spill(
            "eval",
            str(model),
            str(rows),
            "--out",
            str(graded),
            "--adapter",
            adapter,
            *FLOAT,
            home=home,
        )
    )
    spill_lp = [json.loads(line)["gold_logprob"] for line in graded.read_text().splitlines()]

    hf = tmp_path / "hf"
    _ok(_spill("export", str(state), str(hf), "--dtype", "f32", home=home))
    assert np.allclose(_gold_log_probs(hf), spill_lp, rtol=0, atol=1e-5)

    gguf = tmp_path / "gguf"
    refused = _spill("export", str(state), str(gguf), "--format", "gguf", home=home)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 1 and len(lines) == 1 and "Traceback" not in refused.stderr
    assert lines[0].startswith("spill: error: ") and REFUSED[variant] in lines[0], lines
    assert not gguf.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".exporting")]


# the families whose GGUF spill writes, as transformers makes them: Mistral without a window
# (llama.cpp's llama has none), SmolLM3 with its default NoPE step (every 4th layer)
GGUF_VARIANTS = {
    # head_dim 128: transformers' GGUF loader reads no key_length for qwen3 (Qwen3Config's default)
    "qwen3-128": ("Qwen3", dict(num_hidden_layers=2, head_dim=128, tie_word_embeddings=False)),
    "mistral-full": ("Mistral", dict(num_hidden_layers=2, sliding_window=None)),
    "smollm3-step": ("SmolLM3", dict(num_hidden_layers=4)),
    # Phi-3 without longrope: half the head rotated (rope.dimension_count), and whole, which
    # transformers' GGUF loader reads (it ignores rope.dimension_count for phi3)
    "phi3-half": ("Phi3", dict(num_hidden_layers=2, partial_rotary_factor=0.5)),
    "phi3-whole": ("Phi3", dict(num_hidden_layers=2)),
    # Phi-3 with longrope (rope_factors_long/short, the original length, the attention factor):
    # pretrained on 40 positions, so ROWS[0] (33 tokens) turns by the short factors and ROWS[1]
    # by the long ones; transformers' GGUF loader reads no longrope, so it checks none
    "phi3-longrope": (
        "Phi3",
        dict(num_hidden_layers=2, original_max_position_embeddings=40, **hf_families.PHI3),
    ),
    # Gemma 3 as llama.cpp's gemma3 computes it: all but every 6th layer slide (window 6, base
    # 10000), query_pre_attn_scalar == head_dim == 256 (what transformers' GGUF loader assumes)
    "gemma3-256": (
        "Gemma3",
        dict(num_hidden_layers=6, head_dim=256, query_pre_attn_scalar=256, sliding_window=6),
    ),
    # Ministral 3 as llama.cpp's mistral3: YaRN over 16 positions (its attention factor from
    # mscale 1 over mscale_all_dim 0.5) and llama 4's query temperature, both in the rows' reach
    "ministral3-yarn": (
        "Ministral3",
        dict(
            num_hidden_layers=2,
            head_dim=24,
            rope_parameters=hf_families.YARN | {"mscale": 1.0, "mscale_all_dim": 0.5},
        ),
    ),
}


def _with_a_merge(folder: Path) -> Path:
    """The tokenizer gets one BPE merge ("Ġ t", in place of byte 0xFF's token, which text never
    produces), as a GGUF needs; everything else is unchanged."""
    doc = json.loads((folder / "tokenizer.json").read_text())
    vocab = doc["model"]["vocab"]
    vocab["Ġt"] = vocab.pop("ÿ")
    doc["model"]["merges"] = [["Ġ", "t"]]
    (folder / "tokenizer.json").write_text(json.dumps(doc))
    return folder


def _tensors(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.torch import load_file

    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out |= {k: v.float().numpy() for k, v in load_file(shard).items()}
    return out


@pytest.mark.parametrize("variant", list(GGUF_VARIANTS))
def test_a_gguf_export_imports_back_bit_for_bit_and_scores_as_spill(
    variant, tmp_path, tiny_models, monkeypatch
):
    from spill.models.gguf.importer import import_gguf

    home = tmp_path / "home"
    name, extra = GGUF_VARIANTS[variant]
    if variant not in hf_families.VARIANTS:
        monkeypatch.setitem(hf_families.VARIANTS, variant, (name, extra))
    model = _with_a_merge(hf_families.make(variant, tmp_path / variant, tiny_models["llama"]))
    train = _jsonl(
        tmp_path / "train.jsonl",
        [
            {"prompt": f"Question {i}: what is {i} plus 3?", "completion": f" {i + 3}."}
            for i in range(8)
        ],
    )
    state = tmp_path / "state"
    argv = ["tune", str(model), str(train), "--name", "t", "--state", str(state)]
    _ok(_spill(*argv, *TUNE, "--targets", "all", *FLOAT, home=home))
    hf, out = tmp_path / "hf", tmp_path / "gguf"
    _ok(_spill("export", str(state), str(hf), "--dtype", "f32", home=home))
    _ok(_spill("export", str(state), str(out), "--format", "gguf", "--dtype", "f32", home=home))
    gguf = out / "model-f32.gguf"
    back = import_gguf(gguf, tmp_path / "back")
    # the rotary, longrope included, reads back as the merged folder's
    mine, theirs = load_config(back), load_config(hf)
    assert all(getattr(mine, k) == getattr(theirs, k) for k in ROTARY), variant
    assert bool(theirs.rope_long) == (variant == "phi3-longrope")
    want, got = _tensors(hf), _tensors(back)
    assert set(got) == set(want)
    # llama.cpp's gemma3 holds 1 + w, which spill scales by bit for bit after the import's - 1
    shift = np.float32(1 if name == "Gemma3" else 0)
    for key, w in want.items():
        norm = shift and key.endswith("norm.weight")
        assert np.array_equal(got[key] + shift, w + shift) if norm else np.array_equal(got[key], w)

    rows = _jsonl(tmp_path / "rows.jsonl", ROWS)
    scores = {}
    for label, folder, extra_args in (
        ("adapter", model, ["--adapter", str(state / "adapter")]),
        ("gguf", back, []),
    ):
        graded = tmp_path / f"{label}.jsonl"
        _ok(
            _spill(
                "eval", str(folder), str(rows), "--out", str(graded), *extra_args, *FLOAT, home=home
            )
        )
        scores[label] = [
            json.loads(line)["gold_logprob"] for line in graded.read_text().splitlines()
        ]
    assert np.allclose(scores["gguf"], scores["adapter"], rtol=0, atol=1e-5)

    # Q4_0 (the matrices whose rows split into 32-value blocks), imported kept packed and
    # dequantized: the packed folder scores as its float form
    q4 = tmp_path / "q4"
    _ok(_spill("export", str(state), str(q4), "--format", "gguf", "--quantize", "q4_0", home=home))
    kept = import_gguf(q4 / "model-q4_0.gguf", tmp_path / "kept", keep_quantization=True)
    floats = import_gguf(q4 / "model-q4_0.gguf", tmp_path / "floats")
    assert json.loads((kept / "config.json").read_text())["quantization"]
    for label, folder in (("kept", kept), ("floats", floats)):
        graded = tmp_path / f"{label}.jsonl"
        _ok(_spill("eval", str(folder), str(rows), "--out", str(graded), *FLOAT, home=home))
        scores[label] = [
            json.loads(line)["gold_logprob"] for line in graded.read_text().splitlines()
        ]
    assert np.allclose(scores["kept"], scores["floats"], rtol=0, atol=1e-5)
    assert not np.allclose(scores["floats"], scores["gguf"], rtol=0, atol=1e-5)  # it rounded

    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    written = {"qwen3-128": "qwen3", "mistral-full": "llama", "phi3-whole": "phi3"}
    written = (written | {"gemma3-256": "gemma3"}).get(variant)
    if written in GGUF_CONFIG_MAPPING:  # transformers' own GGUF loader (none for smollm3)
        import torch
        import transformers

        theirs = transformers.AutoModelForCausalLM.from_pretrained(
            str(out), gguf_file=gguf.name, dtype=torch.float32
        ).eval()
        lp = _gold_log_probs(model, theirs)
        assert np.allclose(lp, scores["adapter"], rtol=0, atol=1e-5)


def _tuned_f32_exports(tmp_path: Path, tiny_models, spec) -> tuple[Path, Path]:
    """A model of ``spec`` (a merge in its tokenizer) tuned 2 steps in float32 on all linears,
    exported as an f32 HF folder and an f32 GGUF: (the folder, the GGUF file)."""
    model = _with_a_merge(hf_families.make("x", tmp_path / "base", tiny_models["llama"], spec=spec))
    home, state, hf, out = (tmp_path / n for n in ("home", "state", "hf", "gguf"))
    rows = [
        {"prompt": f"Question {i}: what is {i} plus 3?", "completion": f" {i + 3}."}
        for i in range(8)
    ]
    train = _jsonl(tmp_path / "train.jsonl", rows)
    argv = ["tune", str(model), str(train), "--name", "t", "--state", str(state)]
    _ok(_spill(*argv, *TUNE, "--targets", "all", *FLOAT, home=home))
    _ok(_spill("export", str(state), str(hf), "--dtype", "f32", home=home))
    _ok(_spill("export", str(state), str(out), "--format", "gguf", "--dtype", "f32", home=home))
    return hf, out / "model-f32.gguf"


def _llama_cpp_logits(llama_cpp, gguf: Path, ids: list[int], n_ctx: int) -> np.ndarray:
    """llama.cpp's logits at every position of ``ids`` (one thread, an F32 KV cache)."""
    llm = llama_cpp.Llama(
        model_path=str(gguf),
        n_ctx=n_ctx,
        logits_all=True,
        verbose=False,
        n_threads=1,
        type_k=0,
        type_v=0,  # an F32 KV cache (GGML_TYPE_F32; the default F16 rounds)
    )
    assert llm.n_ctx() == n_ctx
    llm.eval(ids)
    return np.asarray(llm.scores[: len(ids)], dtype=np.float64)


@pytest.mark.slow  # llama-cpp-python (built from its sdist)
@pytest.mark.parametrize("scale", [{}, {"mscale": 1.0, "mscale_all_dim": 0.5}])
def test_llama_cpp_runs_a_ministral3_gguf_as_transformers_runs_the_hf_export(
    scale, tmp_path, tiny_models
):
    """A Ministral 3 with YaRN over 16 positions (factor 4; its attention factor the factor's own
    or mscale 1 over mscale_all_dim 0.5) and llama 4's query temperature (beta 0.3), tuned and
    exported as f32 GGUF (llama.cpp's mistral3) and HF: llama.cpp's logits are within 1e-4 of
    transformers' on the HF export at every one of 50 positions, past 16 and 32 where the
    temperature steps."""
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed (it builds from its sdist)"
    )
    import torch

    from spill.models.tokenizer import Tokenizer

    spec = ("Ministral3", dict(num_hidden_layers=2, head_dim=24))
    spec[1]["rope_parameters"] = hf_families.YARN | scale
    hf, gguf = _tuned_f32_exports(tmp_path, tiny_models, spec)
    theirs, tok = hf_families.load(hf), Tokenizer(hf)
    ids = tok.encode(" ".join(f"w{i}" for i in range(20)))[:50]
    assert len(ids) == 50
    got = _llama_cpp_logits(llama_cpp, gguf, ids, 256)
    with torch.no_grad():
        want = theirs(torch.tensor([ids])).logits[0].double().numpy()
    gap = np.abs(got - want).max()
    print(f"\n{len(ids)} tokens: llama.cpp vs transformers {gap:.3g}")
    assert gap <= 1e-4, gap


@pytest.mark.slow  # llama-cpp-python builds from its sdist (~17 min here); 21 s once it is in
def test_llama_cpp_reads_the_longrope_factors_as_transformers_reads_the_hf_export(
    tmp_path, tiny_models, monkeypatch
):
    """A Phi-3 pretrained on 256 positions (of 1024), tuned and exported as f32 GGUF and HF:
    llama.cpp picks the factors by its context size (the long ones where it exceeds the
    original), transformers per forward (where the forward does), so a 29-token prompt at a
    context of 256 turns both by the short factors and a 409-token one at 512 both by the long
    ones; llama.cpp's logits (F32 KV cache) are within 1e-4 of transformers' on the HF export
    at every position (measured 1.7e-6 and 5.7e-6; the 29-token prompt at 512, long factors in
    llama.cpp only, 1.23 apart)."""
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed (it builds from its sdist)"
    )
    import torch

    from spill.models.tokenizer import Tokenizer

    spec = ("Phi3", dict(num_hidden_layers=2, original_max_position_embeddings=256))
    spec[1].update(max_position_embeddings=1024, **hf_families.PHI3)
    # not a folder named phi3: llama.cpp reads general.name (the folder's name) as a Phi-3's and
    # looks up Phi-3's special tokens, which the tiny vocabulary lacks ("unordered_map::at")
    hf, gguf = _tuned_f32_exports(tmp_path, tiny_models, spec)
    theirs, tok = hf_families.load(hf), Tokenizer(hf)
    short = tok.encode("Question 5: what is 5 plus 8?")
    long = tok.encode(" ".join(f"word{i}" for i in range(60)))
    assert len(short) < 256 < len(long) < 512
    # the short prompt at 512 too: llama.cpp turns it by the long factors, transformers by the
    # short ones (the factors matter, and the rule that picks them is each one's own)
    for ids, n_ctx, same in ((short, 256, True), (long, 512, True), (short, 512, False)):
        got = _llama_cpp_logits(llama_cpp, gguf, ids, n_ctx)
        with torch.no_grad():
            want = theirs(torch.tensor([ids])).logits[0].double().numpy()
        gap = np.abs(got - want).max()
        print(f"\n{len(ids)} tokens at n_ctx {n_ctx}: llama.cpp vs transformers {gap:.3g}")
        assert gap <= 1e-4 if same else gap > 1e-2, gap


def test_a_gemma3_vision_folders_adapter_exports_its_text_model(tmp_path, tiny_models):
    """An adapter tuned on a ``gemma3`` (vision) folder's text model: the merged HF folder is
    that text model, a ``gemma3_text`` folder (the vision tower is not part of it), and scores as
    ``spill eval --adapter`` on the vision folder within 1e-5 in transformers."""
    home = tmp_path / "home"
    model = hf_families.make_vision(tmp_path / "gemma3", tiny_models["llama"], tied=False)
    train = _jsonl(
        tmp_path / "train.jsonl",
        [
            {"prompt": f"Question {i}: what is {i} plus 3?", "completion": f" {i + 3}."}
            for i in range(8)
        ],
    )
    state, graded = tmp_path / "state", tmp_path / "eval.jsonl"
    argv = ["tune", str(model), str(train), "--name", "t", "--state", str(state)]
    tuned = _ok(_spill(*argv, *TUNE, "--targets", "all", *FLOAT, home=home))
    assert "its vision tower ignored" in tuned.stderr
    rows = _jsonl(tmp_path / "rows.jsonl", ROWS)
    adapter = ["--adapter", str(state / "adapter")]
    _ok(_spill("eval", str(model), str(rows), "--out", str(graded), *adapter, *FLOAT, home=home))
    spill_lp = [json.loads(line)["gold_logprob"] for line in graded.read_text().splitlines()]

    hf = tmp_path / "hf"
    _ok(_spill("export", str(state), str(hf), "--dtype", "f32", home=home))
    config = json.loads((hf / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and "vision_config" not in config
    assert not [k for k in _tensors(hf) if "vision" in k or "projector" in k]
    assert np.allclose(_gold_log_probs(hf), spill_lp, rtol=0, atol=1e-5)
