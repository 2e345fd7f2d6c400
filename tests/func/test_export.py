"""``spill export`` through the real CLI: a short tune of each tiny family (its tokenizer given
one BPE merge, as llama.cpp needs of a GGUF), merged and written as an HF folder (and GGUF, and
mlx-lm) that other tools load, checked against spill's own ``run --adapter`` and ``eval
--adapter`` on the base; what ``--quantize`` costs the tune; and the one-line refusals.

What is exact and what is close: the float32 merge is ``W + scale * (A @ B).T``; spill's own
forward computes ``x @ W.T + scale * (x @ A) @ B`` instead, so log-probs agree to float32
rounding (1e-5), and greedy tokens equal (the tiny models have no near ties on these prompts).
Re-reading what spill wrote (a bf16 export against the f32 one, spill's GGUF import of its own
GGUF) is exact.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from spill.ground.hashing import file_sha256
from spill.ground.validate import validate
from spill.models.sources.tiny import write_tiny
from spill.models.weights import fingerprint
from spill.store.safetensors_io import bf16_bits_to_float32, float32_to_bf16_bits
from tests.conftest import run_spill

ENV = {"OMP_NUM_THREADS": "1"}
GEN = ["--max-new-tokens", "6", "--dtype", "float32"]
ROWS = [
    {"id": 0, "prompt": "Question 5: what is 5 plus 8?", "answer": " 13."},
    {"id": 1, "prompt": "one two", "answer": " three"},
    {"id": 2, "prompt": "Question 11: what is 11 plus 14?", "answer": " 25."},
]


def _spill(*args: str, home: Path | None = None) -> subprocess.CompletedProcess:
    env = ENV | ({"SPILL_HOME": str(home)} if home else {})
    return run_spill(*args, env=env, timeout=300)


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stderr
    return proc


def _one_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _tune(root: Path, model: Path, home: Path, *extra: str) -> Path:
    """A short, hard tune on every linear, so the adapter changes greedy answers."""
    rows = [
        {"prompt": f"Question {i}: what is {i} plus {i + 3}?", "completion": f" {2 * i + 3}."}
        for i in range(24)
    ]
    train, state = _jsonl(root / "train.jsonl", rows), root / "state"
    _ok(
        _spill(
            "tune",
            str(model),
            str(train),
            "--name",
            "t",
            "--state",
            str(state),
            "--steps",
            "4",
            "--batch",
            "4",
            "--lr",
            "0.05",
            "--rank",
            "4",
            "--seq-len",
            "64",
            "--ckpt-every",
            "4",
            "--dtype",
            "float32",
            "--targets",
            "all",
            *extra,
            home=home,
        )  # fmt: skip
    )
    return state


def _with_a_merge(out: Path, family: str) -> Path:
    """A tiny model whose tokenizer has one BPE merge ("Ġ t" -> "Ġt"), as llama.cpp needs of a
    GGUF: the token of byte 0xFF (never in UTF-8, so never produced from text) becomes the
    merged token, keeping the vocabulary's size; the folder is recorded again."""
    from spill.models.cache import MARKER
    from spill.models.integrity import record

    folder = write_tiny(out, family=family, seed=7)
    doc = json.loads((folder / "tokenizer.json").read_text())
    vocab = doc["model"]["vocab"]
    vocab["Ġt"] = vocab.pop("ÿ")
    doc["model"]["merges"] = [["Ġ", "t"]]
    (folder / "tokenizer.json").write_text(json.dumps(doc))
    (folder / MARKER).unlink()
    record(folder, stat_cache=False, source="tiny", family=family, seed=7)
    return folder


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tuned(request, tmp_path_factory) -> dict:
    """A tuned tiny model of each family (its tokenizer with a merge, so that its GGUF serves
    llama.cpp), its float32 HF export, and spill's own answers."""
    root = tmp_path_factory.mktemp(f"export-{request.param}")
    home = root / "home"
    model = _with_a_merge(root / "base", request.param)
    state = _tune(root, model, home)
    rows = _jsonl(root / "rows.jsonl", ROWS)
    hf = root / "hf"
    done = _ok(_spill("export", str(state), str(hf), "--dtype", "f32", "--shard-size", "100K"))
    ran, graded = root / "run.jsonl", root / "eval.jsonl"
    adapter = state / "adapter"
    _ok(_spill("run", str(model), str(rows), "--out", str(ran), "--adapter", str(adapter), *GEN))
    _ok(
        _spill("eval", str(model), str(rows), "--out", str(graded), "--adapter", str(adapter), *GEN)
    )
    base_out = root / "base.jsonl"
    _ok(_spill("run", str(model), str(rows), "--out", str(base_out), *GEN))
    return {
        "family": request.param,
        "model": model,
        "state": state,
        "adapter": adapter,
        "hf": hf,
        "stdout": done.stdout,
        "stderr": done.stderr,
        "run": _read(ran),
        "eval": _read(graded),
        "base": _read(base_out),
        "root": root,
    }


def _transformers(folder: Path, **kw):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, **kw
    )
    return model.eval()


def _greedy_and_logprobs(model, folder: Path) -> tuple[list[str], list[float]]:
    """What transformers generates greedily (6 tokens, stopping where spill stops) and the gold
    answers' summed log-probs, with prompts encoded by spill's tokenizer of ``folder``."""
    import torch

    from spill.models.tokenizer import Tokenizer

    tok = Tokenizer(folder)
    outputs, logprobs = [], []
    for row in ROWS:
        prompt, answer = tok.encode(row["prompt"]), tok.encode(row["answer"], False)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + answer])).logits[0].double()
            lp = torch.log_softmax(logits, -1)
            gen = model.generate(
                torch.tensor([prompt]), max_new_tokens=6, do_sample=False, top_p=None,
                top_k=None, eos_token_id=list(tok.eos_ids), pad_token_id=tok.pad_id,
            )  # fmt: skip
        logprobs.append(sum(lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(answer)))
        outputs.append(tok.decode(gen[0, len(prompt) :].tolist()))
    return outputs, logprobs


def _tensors(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of an HF folder's shards, as float32 (bf16 widened)."""
    from spill.store.safetensors_io import read_header

    kinds = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        header = read_header(shard)
        raw = shard.read_bytes()
        start = 8 + int.from_bytes(raw[:8], "little")
        for name, info in header.items():
            if name == "__metadata__":
                continue
            lo, hi = info["data_offsets"]
            a = np.frombuffer(raw[start + lo : start + hi], dtype=kinds[info["dtype"]])
            a = bf16_bits_to_float32(a) if info["dtype"] == "BF16" else a.astype(np.float32)
            out[name] = a.reshape(info["shape"])
    return out


# --- hf ---------------------------------------------------------------------------------------


def test_the_hf_export_loads_in_transformers_and_answers_as_spill_run_with_the_adapter(tuned):
    outputs, logprobs = _greedy_and_logprobs(_transformers(tuned["hf"]), tuned["hf"])
    assert outputs == [r["output"] for r in tuned["run"]]
    assert outputs != [r["output"] for r in tuned["base"]]  # the merge changed the model
    spill_lp = [r["gold_logprob"] for r in tuned["eval"]]
    # merged weights (W + s*B@A rounded once to float32) against the adapter applied beside W:
    # each answer's log-prob is a sum whose rounding grows with it (on an AVX-512 CI machine
    # 1.2e-5 on -35.6, 3.3e-7 of it), so a relative term beside the absolute one
    assert np.allclose(logprobs, spill_lp, rtol=1e-6, atol=1e-5), (logprobs, spill_lp)


def test_spill_runs_its_own_hf_export_as_the_base_with_the_adapter(tuned, tmp_path):
    import shutil

    rows, out = _jsonl(tmp_path / "rows.jsonl", ROWS), tmp_path / "run.jsonl"
    model = tmp_path / "merged"
    shutil.copytree(tuned["hf"], model)  # a run records its files' sha256 in the folder
    _ok(_spill("run", str(model), str(rows), "--out", str(out), *GEN))
    assert [r["output"] for r in _read(out)] == [r["output"] for r in tuned["run"]]


def test_the_hf_export_is_sharded_and_export_json_records_every_file(tuned):
    hf = tuned["hf"]
    record = json.loads((hf / "export.json").read_text())
    validate(record, "export")
    assert record["format"] == "hf" and record["dtype"] == "f32"
    assert record["base"]["fingerprint"] == fingerprint(tuned["model"])
    assert record["base"]["dequantized"] is False
    assert record["adapter"]["folder"] == str(tuned["adapter"].resolve())
    on_disk = {p.name for p in hf.iterdir()} - {"export.json"}
    assert set(record["files"]) == on_disk
    for name, f in record["files"].items():
        assert f["sha256"] == file_sha256(hf / name) and f["size"] == (hf / name).stat().st_size
    shards = sorted(p.name for p in hf.glob("*.safetensors"))
    n = len(shards)
    assert n > 1 and shards == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    assert set(index["weight_map"]) == set(_tensors(hf))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (hf / name).read_bytes() == (tuned["model"] / name).read_bytes()  # the template too
    config = json.loads((hf / "config.json").read_text())
    assert config["torch_dtype"] == "float32"
    assert str(hf) in tuned["stdout"] and "config.json" in tuned["stdout"]


def test_a_bf16_and_an_f16_export_are_the_f32_merge_rounded(tuned, tmp_path):
    merged = _tensors(tuned["hf"])
    for dtype in ("bf16", "f16"):
        out = tmp_path / dtype
        done = _ok(_spill("export", str(tuned["adapter"]), str(out), "--dtype", dtype, "--json"))
        assert json.loads(done.stdout)["dtype"] == dtype
        got = _tensors(out)
        assert set(got) == set(merged)
        for name, w in merged.items():
            want = (
                bf16_bits_to_float32(float32_to_bf16_bits(w))
                if dtype == "bf16"
                else w.astype(np.float16).astype(np.float32)
            )
            assert np.array_equal(got[name], want), (dtype, name)


def test_the_merge_equals_peft_merge_and_unload_of_the_peft_layout(tuned):
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    base = _transformers(tuned["model"])
    merged = peft.PeftModel.from_pretrained(base, str(tuned["adapter"] / "peft")).merge_and_unload()
    theirs = {k: v.detach().to(torch.float32).numpy() for k, v in merged.state_dict().items()}
    ours = _tensors(tuned["hf"])
    assert set(ours) <= set(theirs)  # theirs may list a tied lm_head
    for name, w in ours.items():
        assert np.allclose(w, theirs[name], rtol=0, atol=1e-6), name


# --- refusals ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_state(tmp_path_factory, tiny_models) -> Path:
    root = tmp_path_factory.mktemp("export-refusals")
    return _tune(root, tiny_models["llama"], root / "home")


def test_an_adapter_on_another_base_is_refused_in_one_line(llama_state, tmp_path):
    other = write_tiny(tmp_path / "other", family="llama", seed=8)
    out = tmp_path / "out"
    proc = _spill("export", str(llama_state), str(out), "--model", str(other))
    assert proc.returncode == 1 and not out.exists()
    line = _one_line(proc)
    assert "was trained on weights" in line and fingerprint(other)[:19] in line, line
    assert "--model" in line


@pytest.mark.parametrize("where", ["base", "adapter", "inside-adapter", "state"])
def test_an_out_that_is_an_input_is_a_usage_error(llama_state, tiny_models, where):
    adapter = llama_state / "adapter"
    out = {
        "base": tiny_models["llama"],
        "adapter": adapter,
        "inside-adapter": adapter / "merged",
        "state": llama_state,
    }[where]
    before = {p: p.read_bytes() for p in sorted(llama_state.rglob("*")) if p.is_file()}
    proc = _spill("export", str(llama_state), str(out))
    assert proc.returncode == 2
    line = _one_line(proc)
    assert f"OUT {out} is the" in line and "export elsewhere" in line, line
    assert before == {p: p.read_bytes() for p in sorted(llama_state.rglob("*")) if p.is_file()}
    assert not (adapter / "merged").exists()


@pytest.mark.parametrize("name", ["tiny-llama-9-2x64", "smollm2-135m-q4_1", "link"])
def test_an_out_inside_spill_home_is_a_usage_error(llama_state, spill_home, tmp_path, name):
    """A new name under SPILL_HOME/models would become that model for every later run (issue
    35, item 6); a link leading there is the same place."""
    models = spill_home / "models"
    models.mkdir(exist_ok=True)
    out = models / name
    if name == "link":
        (tmp_path / "alias").symlink_to(models)
        out = tmp_path / "alias" / "fresh-name"
    before = sorted(models.rglob("*"))
    proc = _spill("export", str(llama_state), str(out), "--format", "gguf")
    assert proc.returncode == 2
    line = _one_line(proc)
    assert line.startswith("spill: error: ") and "inside SPILL_HOME" in line, line
    assert str(out) in line and "export elsewhere" in line
    assert sorted(models.rglob("*")) == before == []  # nothing written where models are found


def test_an_out_that_exists_an_unfinished_tune_and_a_bad_option_are_refused(llama_state, tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("mine")
    proc = _spill("export", str(llama_state), str(full))
    assert proc.returncode == 1 and "already exists" in _one_line(proc)
    assert (full / "x").read_text() == "mine"

    unfinished = tmp_path / "unfinished"
    (unfinished / "payloads").mkdir(parents=True)
    proc = _spill("export", str(unfinished), str(tmp_path / "o"))
    assert proc.returncode == 1 and "has not finished" in _one_line(proc)

    proc = _spill("export", str(llama_state), str(tmp_path / "o"), "--quantize", "q8_0")
    assert proc.returncode == 2 and "does not apply to --format hf" in _one_line(proc)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("given", ["s3://bucket/tune", "memory://bucket/tune/adapter"])
def test_an_adapter_at_a_uri_is_refused_in_one_line(tmp_path, given):
    out = tmp_path / "o"
    proc = _spill("export", given, str(out))
    assert proc.returncode == 1 and not out.exists()
    assert _one_line(proc) == (
        f"spill: error: {given}: spill export reads a local adapter folder; copy it here first"
    )


def test_an_empty_out_folder_is_filled_and_no_temporary_folder_is_left(llama_state, tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    _ok(_spill("export", str(llama_state / "adapter"), str(out), "--dtype", "bf16"))
    assert (out / "export.json").is_file() and (out / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["empty"]


# --- a quantized base -------------------------------------------------------------------------


def test_a_quantized_base_is_dequantized_for_the_merge_and_says_so(tmp_path, tiny_models):
    from spill.models.sources.quantize import quantize_folder

    base = tmp_path / "tiny-q4g32"
    quantize_folder(tiny_models["llama"], base, 4, 32, progress=lambda line: None)
    state = _tune(tmp_path, base, tmp_path / "home")
    out = tmp_path / "hf"
    done = _ok(_spill("export", str(state), str(out), "--dtype", "f32"))
    assert "is quantized (4-bit affine g32" in done.stderr and "dequantized" in done.stderr
    record = json.loads((out / "export.json").read_text())
    assert record["base"]["dequantized"] is True
    assert record["base"]["quantization"]["bits"] == 4
    config = json.loads((out / "config.json").read_text())
    assert "quantization" not in config
    rows = _jsonl(tmp_path / "rows.jsonl", ROWS)
    graded = tmp_path / "eval.jsonl"
    adapter = str(state / "adapter")
    _ok(_spill("eval", str(base), str(rows), "--out", str(graded), "--adapter", adapter, *GEN))
    outputs, logprobs = _greedy_and_logprobs(_transformers(out), out)
    spill_rows = _read(graded)
    assert outputs == [r["output"] for r in spill_rows]
    spill_lp = [r["gold_logprob"] for r in spill_rows]
    assert np.allclose(logprobs, spill_lp, rtol=0, atol=1e-5), (logprobs, spill_lp)


# --- gguf -------------------------------------------------------------------------------------


def _gguf(tuned, out: Path, *extra: str) -> dict:
    _ok(_spill("export", str(tuned["state"]), str(out), "--format", "gguf", *extra))
    return json.loads((out / "export.json").read_text())


def _imported(gguf_file: Path, home: Path) -> dict[str, np.ndarray]:
    done = _ok(_spill("models", "import", str(gguf_file), "--dequantize", home=home))
    return _tensors(Path(done.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_spill_imports_its_own_gguf_back_to_the_merged_weights_exactly(tuned, tmp_path, dtype):
    """1-D tensors (norms) stay F32 in a GGUF, as llama.cpp writes them; matrices are the
    dtype, so an F16 (BF16) export is the merge rounded to f16 (bf16), no more."""
    record = _gguf(tuned, tmp_path / "out", "--dtype", dtype)
    assert record["gguf"]["file"] == f"model-{dtype}.gguf"
    back = _imported(tmp_path / "out" / record["gguf"]["file"], tmp_path / "home")
    merged = _tensors(tuned["hf"])
    assert set(back) == set(merged)
    for name, w in merged.items():
        if dtype == "f32" or w.ndim == 1:
            want = w
        elif dtype == "f16":
            want = w.astype(np.float16).astype(np.float32)
        else:
            want = bf16_bits_to_float32(float32_to_bf16_bits(w))
        assert np.array_equal(back[name], want), name


def test_transformers_loads_the_f32_gguf_and_answers_as_the_hf_export(tuned, tmp_path):
    out = tmp_path / "out"
    record = _gguf(tuned, out, "--dtype", "f32")
    assert record["format"] == "gguf" and record["gguf"]["types"] == {
        "F32": len(_tensors(tuned["hf"]))
    }
    ours = _greedy_and_logprobs(_transformers(tuned["hf"]), tuned["hf"])
    theirs = _greedy_and_logprobs(_transformers(out, gguf_file=record["gguf"]["file"]), tuned["hf"])
    assert theirs[0] == ours[0]
    assert np.allclose(theirs[1], ours[1], rtol=0, atol=1e-5), (theirs[1], ours[1])
    modelfile = (out / "Modelfile").read_text()
    assert f"FROM ./{record['gguf']['file']}" in modelfile
    assert 'PARAMETER stop "<|im_end|>"' in modelfile
    assert set(record["files"]) == {"Modelfile", record["gguf"]["file"]}


def test_the_gguf_holds_the_merges_and_every_reader_tokenizes_as_the_base(tuned, tmp_path):
    """Issue 35, item 28: the merges llama.cpp needs are in the file, and transformers' GGUF
    loader and spill's import of it give the base tokenizer's ids, the merge firing."""
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    from spill.models.tokenizer import Tokenizer

    out = tmp_path / "out"
    record = _gguf(tuned, out, "--dtype", "f32")
    path = out / record["gguf"]["file"]
    field = GGUFReader(path).fields["tokenizer.ggml.merges"]
    assert [bytes(field.parts[i]).decode() for i in field.data] == ["Ġ t"]
    done = _ok(_spill("models", "import", str(path), "--dequantize", home=tmp_path / "home"))
    theirs = AutoTokenizer.from_pretrained(str(out), gguf_file=path.name)
    mine, base = Tokenizer(Path(done.stdout.strip().splitlines()[-1])), Tokenizer(tuned["model"])
    texts = ["to the top", " t tt  t", "Ünïcödé ÿ 🙂 ж", "a\n\tb<|im_end|>", "Question 5: 13."]
    for text in texts:
        want = base.encode(text, add_special_tokens=False)
        assert mine.encode(text, add_special_tokens=False) == want, text
        assert theirs(text, add_special_tokens=False)["input_ids"] == want, text
    assert base.encode(" to", add_special_tokens=False) == [255, 111]  # "Ġt" + "o"


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_1"])
def test_a_quantized_gguf_holds_every_matrix_in_its_blocks_and_reads_back_close(
    tuned, tmp_path, kind
):
    """ggml's block quantizers (gguf.quants): every matrix whose rows split into blocks of 32
    is ``kind``, norms (and a Qwen2's biases) F32; read back, each value is within one quantization step of the
    merge (Q8_0: the block's largest magnitude / 127, Q4_0: / 8, Q4_1: its range / 15)."""
    from gguf import GGUFReader

    record = _gguf(tuned, tmp_path / "out", "--quantize", kind, "--dtype", "f16")
    path = tmp_path / "out" / f"model-{kind}.gguf"
    assert record["gguf"]["file"] == path.name and record["quantize"] == kind
    tensors = GGUFReader(path).tensors  # 1-D: norms, a Qwen2's biases
    flat = {t.tensor_type.name for t in tensors if len(t.shape) == 1}
    assert flat == {"F32"} and {t.tensor_type.name for t in tensors if len(t.shape) == 2} == {
        kind.upper()
    }
    back = _imported(path, tmp_path / "home")
    for name, w in _tensors(tuned["hf"]).items():
        if w.ndim == 1:
            assert np.array_equal(back[name], w), name
            continue
        blocks = w.reshape(w.shape[0], -1, 32)
        amax = np.abs(blocks).max(-1)  # (out, blocks)
        step = {
            "q8_0": amax / 127,
            "q4_0": amax / 8,
            "q4_1": (blocks.max(-1) - blocks.min(-1)) / 15,
        }[kind]
        err = np.abs(back[name] - w).reshape(blocks.shape).max(-1)
        assert (err <= step * 1.01 + 1e-6).all(), name


def _mean_logprob(folder: Path, examples: list) -> float:
    """The mean log-prob of the examples' trained tokens on ``folder``, float32, in this
    process."""
    from spill.engines import resolve
    from spill.engines.base import LoadOptions, ModelSpec
    from spill.models.config import load_config

    spec = ModelSpec(folder, load_config(folder))
    runner = resolve("torch").open(spec, LoadOptions(dtype="float32"))
    try:
        lps = runner.score([e.ids[:1] for e in examples], [e.ids[1:] for e in examples])
    finally:
        runner.close()
    got = [lp[e.targets[1:]] for lp, e in zip(lps, examples, strict=True)]
    return float(np.concatenate(got).astype(np.float64).mean())


def test_a_quantized_gguf_says_what_the_rounding_costs_the_tune_on_rows_it_saw(tuned, tmp_path):
    """Issue 35, item 29: a q4_0 and a q8_0 export of the same tune each score the first 8 rows
    the tune drew (its training file, found by the name and sha256 its checkpoint records) on
    the base, the tuned base and the file's own values, print the shifts in one line and record
    them in export.json. The file's number is scored again here on spill's import of the GGUF
    itself; q4_0 rounds more than q8_0."""
    from types import SimpleNamespace

    from spill.jobs.export.shift import seen_rows
    from spill.models.config import load_config

    got = {}
    for kind in ("q4_0", "q8_0"):
        out = tmp_path / kind
        proc = _ok(_spill("export", str(tuned["state"]), str(out), "--format", "gguf",
                          "--quantize", kind, "--json"))  # fmt: skip
        m = got[kind] = json.loads(proc.stdout)["gguf"]["quantization_shift"]
        assert (m["measure"], m["train_file"], m["rows"]) == ("logprob", "train.jsonl", 8), m
        keys = ("base", "tuned", "quantized", "tune_shift", "quantization_shift", "ratio")
        assert all(isinstance(m[k], float) and np.isfinite(m[k]) for k in keys), m
        assert m["tune_shift"] == pytest.approx(abs(m["tuned"] - m["base"]), abs=2e-6)
        assert m["quantization_shift"] == pytest.approx(abs(m["quantized"] - m["tuned"]), abs=2e-6)
        assert m["ratio"] == pytest.approx(m["quantization_shift"] / m["tune_shift"], abs=1e-4)
        said = [
            x for x in proc.stderr.splitlines() if x.startswith(f"{kind} on 8 rows the tune saw")
        ]
        assert len(said) == 1 and f"{m['tuned']:.4f} tuned" in said[0], proc.stderr
        assert sorted(p.name for p in out.iterdir()) == sorted(
            ["Modelfile", "export.json", f"model-{kind}.gguf"]
        )
    assert (got["q4_0"]["base"], got["q4_0"]["tuned"]) == (
        got["q8_0"]["base"],
        got["q8_0"]["tuned"],
    )
    assert got["q4_0"]["quantization_shift"] >= got["q8_0"]["quantization_shift"] > 0
    config = load_config(tuned["model"])
    name, rows = seen_rows(
        SimpleNamespace(adapter_dir=tuned["adapter"], base_folder=tuned["model"], config=config)
    )
    done = _ok(_spill("models", "import", str(tmp_path / "q4_0" / "model-q4_0.gguf"),
                      "--dequantize", home=tmp_path / "home"))  # fmt: skip
    folder = Path(done.stdout.strip().splitlines()[-1])
    assert _mean_logprob(folder, rows) == pytest.approx(got["q4_0"]["quantized"], abs=1e-5)
    assert _mean_logprob(tuned["model"], rows) == pytest.approx(got["q4_0"]["base"], abs=1e-5)


def test_without_the_rows_the_tune_saw_the_rounding_is_measured_in_weight_space(tuned, tmp_path):
    """An adapter folder on its own names no training file: the export measures the rounding of
    every adapted matrix against the tune's own change (Frobenius norms), says so and why;
    recomputed here from spill's import of the file, the f32 merge and the adapter."""
    import shutil

    from spill.jobs.adapter_files import load_adapter

    adapter = shutil.copytree(tuned["adapter"], tmp_path / "adapter")
    out = tmp_path / "out"
    proc = _ok(_spill("export", str(adapter), str(out), "--format", "gguf", "--quantize", "q4_0",
                      "--json"))  # fmt: skip
    shift = json.loads(proc.stdout)["gguf"]["quantization_shift"]
    assert shift["measure"] == "weights" and "not in a tune's state" in shift["why"]
    params = load_adapter(adapter)
    back, merged = _imported(out / "model-q4_0.gguf", tmp_path / "home"), _tensors(tuned["hf"])
    tune2 = err2 = 0.0
    for key in sorted(k for k in params.params if k.endswith(".lora_a")):
        stem = key.removesuffix(".lora_a")
        a, b = params.params[key], params.params[f"{stem}.lora_b"]
        tune2 += float(np.sum(np.square(params.lora.scale * (a @ b), dtype=np.float64)))
        name = f"model.{stem}.weight"
        err2 += float(np.sum(np.square(back[name] - merged[name], dtype=np.float64)))
    assert shift["matrices"] == len([k for k in params.params if k.endswith(".lora_a")])
    assert shift["ratio"] == pytest.approx(np.sqrt(err2 / tune2), rel=1e-3, abs=1e-4)
    assert shift["tune_norm"] == pytest.approx(np.sqrt(tune2), rel=1e-4)
    said = [x for x in proc.stderr.splitlines() if x.startswith("q4_0 moves the ")]
    assert len(said) == 1 and "weight space, since the adapter is not in a tune's state" in said[0]


@pytest.mark.parametrize("quantize", [[], ["--quantize", "q4_0"]])
def test_a_gguf_of_a_tokenizer_without_merges_is_refused_in_one_line(
    llama_state, tmp_path, quantize
):
    """Issue 35, item 28: llama.cpp refuses a byte-level vocabulary without merges ("cannot
    find tokenizer merges") and no placeholder merge serves transformers and spill as well, so
    the plain tiny models' GGUF export is refused before anything is written."""
    before = {p: p.read_bytes() for p in sorted(llama_state.rglob("*")) if p.is_file()}
    out = tmp_path / "out"
    proc = _spill("export", str(llama_state), str(out), "--format", "gguf", *quantize)
    assert proc.returncode == 1 and not out.exists(), proc.stderr
    line = _one_line(proc)
    assert line.startswith("spill: error: ") and "tokenizer.json has no BPE merges" in line
    assert "cannot find tokenizer merges" in line and line.endswith("export --format hf")
    assert list(tmp_path.iterdir()) == []  # no temporary folder left either
    assert before == {p: p.read_bytes() for p in sorted(llama_state.rglob("*")) if p.is_file()}


# --- mlx --------------------------------------------------------------------------------------


def _mlx_logprobs(folder: Path) -> list[float]:
    """The gold answers' summed log-probs under ``mlx_lm.load(folder)``."""
    mlx_lm = pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install mlx-lm)")
    import mlx.core as mx

    from spill.models.tokenizer import Tokenizer

    model, _ = mlx_lm.load(str(folder))
    tok = Tokenizer(folder)
    out = []
    for row in ROWS:
        prompt, answer = tok.encode(row["prompt"]), tok.encode(row["answer"], False)
        logits = model(mx.array([prompt + answer]))[0].astype(mx.float32)
        lp = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True)).astype(np.float64)
        out.append(float(sum(lp[len(prompt) - 1 + i, t] for i, t in enumerate(answer))))
    return out


def test_mlx_lm_loads_the_mlx_export_within_1e4_of_spill_eval(tuned, tmp_path):
    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install mlx-lm)")
    out = tmp_path / "mlx"
    _ok(_spill("export", str(tuned["adapter"]), str(out), "--format", "mlx", "--dtype", "f32"))
    merged, got = _tensors(tuned["hf"]), _tensors(out)
    assert set(got) == set(merged) and all(np.array_equal(got[k], merged[k]) for k in merged)
    spill_lp = [r["gold_logprob"] for r in tuned["eval"]]
    theirs = _mlx_logprobs(out)
    assert np.allclose(theirs, spill_lp, rtol=0, atol=1e-4), (theirs, spill_lp)


def test_a_quantized_mlx_export_is_mlx_lms_layout_that_spill_and_mlx_lm_read_alike(tuned, tmp_path):
    """``--quantize 4``: the linears whose rows split into groups of 64 packed (the tiny
    models' down_proj, 160 wide, stays float, as mlx-lm's own convert leaves it), scored by
    spill on the exported folder itself and by mlx-lm within 1e-4."""
    pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install mlx-lm)")
    out = tmp_path / "mlx-q4"
    args = ["export", str(tuned["state"]), str(out), "--format", "mlx", "--quantize", "4"]
    record = json.loads(_ok(_spill(*args, "--dtype", "f32", "--json")).stdout)
    assert record["quantize"] == "4" and record["mlx"]["quantized"].endswith("4-bit g64")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 64
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.self_attn.q_proj.scales" in index
    assert "model.layers.0.mlp.down_proj.scales" not in index
    rows, graded = _jsonl(tmp_path / "rows.jsonl", ROWS), tmp_path / "eval.jsonl"
    _ok(_spill("eval", str(out), str(rows), "--out", str(graded), *GEN))
    spill_lp = [r["gold_logprob"] for r in _read(graded)]
    theirs = _mlx_logprobs(out)
    assert np.allclose(theirs, spill_lp, rtol=0, atol=1e-4), (theirs, spill_lp)


# --- SmolLM2 (slow) ---------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_exports_as_gguf_that_transformers_and_spill_read_as_the_hf_export(smollm2):
    """Its F32 GGUF reads back through spill's import as the hf export exactly, and
    transformers answers the same from either."""
    merged = _tensors(smollm2["hf"])
    back = _imported(smollm2["gguf"], smollm2["root"] / "home-import")
    assert set(back) == set(merged)
    assert all(np.array_equal(back[k], merged[k]) for k in merged)
    hf, gguf_file = smollm2["hf"], smollm2["gguf"]
    ours = _greedy_and_logprobs(_transformers(hf), hf)
    theirs = _greedy_and_logprobs(_transformers(gguf_file.parent, gguf_file=gguf_file.name), hf)
    assert theirs[0] == ours[0]
    assert np.allclose(theirs[1], ours[1], rtol=0, atol=1e-4), (theirs[1], ours[1])


# --- other adapters, other bases --------------------------------------------------------------


def test_a_peft_adapter_exports_with_model_as_the_same_bytes(llama_state, tiny_models, tmp_path):
    """PEFT records no fingerprint, so the base must be named; the merge is the same one."""
    peft = llama_state / "adapter" / "peft"
    proc = _spill("export", str(peft), str(tmp_path / "x"))
    assert proc.returncode == 1 and "give its base model with --model" in _one_line(proc)
    ours, theirs = tmp_path / "spill", tmp_path / "peft"
    _ok(_spill("export", str(llama_state), str(ours), "--dtype", "bf16"))
    done = _ok(
        _spill(
            "export",
            str(peft),
            str(theirs),
            "--dtype",
            "bf16",
            "--model",
            str(tiny_models["llama"]),
        )
    )
    assert "records no base fingerprint; trusting --model" in done.stderr
    shards = sorted(p.name for p in ours.glob("*.safetensors"))
    assert shards and shards == sorted(p.name for p in theirs.glob("*.safetensors"))
    assert all((ours / s).read_bytes() == (theirs / s).read_bytes() for s in shards)


def _rope_scaled(tmp_path: Path, base_model: Path) -> tuple[Path, Path]:
    """A copy of ``base_model`` with llama3 rope scaling (Llama 3.1+) and a small random
    adapter on it: (adapter folder, base folder)."""
    import shutil

    from spill.jobs.adapter_files import write_local
    from spill.models.cache import MARKER
    from spill.models.config import load_config
    from spill.models.lora import LoraConfig, init_params

    base = tmp_path / "llama3-rope"
    shutil.copytree(base_model, base)
    (base / MARKER).unlink()  # a user's own folder: its config is edited below
    config = json.loads((base / "config.json").read_text())
    config["rope_scaling"] = {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    }  # fmt: skip
    (base / "config.json").write_text(json.dumps(config))
    cfg, lora = load_config(base), LoraConfig(rank=2, targets=("q_proj", "v_proj"))
    params = init_params(cfg, lora, 0)
    rng = np.random.default_rng(1)
    for name in params:
        if name.endswith("lora_b"):
            params[name] = rng.normal(0, 0.05, params[name].shape).astype(np.float32)
    adapter = write_local(
        tmp_path / "adapter", params, lora, str(base), fingerprint(base),
        cfg.num_hidden_layers, [1.0],
    )  # fmt: skip
    return adapter, base


def test_a_gguf_of_what_the_writer_cannot_hold_is_refused_and_hf_still_works(tmp_path, tiny_models):
    """Rope scaling on a Qwen2 has no GGUF form spill writes (a Llama's is rope_freqs)."""
    adapter, _ = _rope_scaled(tmp_path, tiny_models["qwen2"])
    out = tmp_path / "gguf"
    proc = _spill("export", str(adapter), str(out), "--format", "gguf")
    assert proc.returncode == 1 and not out.exists()
    assert "rope scaling on a qwen2 model" in _one_line(proc) and "--format hf" in _one_line(proc)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    _ok(_spill("export", str(adapter), str(tmp_path / "hf")))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["rope_scaling"]["factor"] == 8


def test_an_export_killed_midway_leaves_nothing_at_out_and_the_next_one_cleans_up(tmp_path):
    """A real SIGKILL once the export's temporary folder holds a file; the rerun finishes and
    removes what the dead one left."""
    import os
    import signal
    import sys
    import time

    from spill.jobs.adapter_files import write_local
    from spill.models.config import load_config
    from spill.models.lora import LoraConfig, init_params

    base = write_tiny(tmp_path / "wide", family="llama", seed=3, layers=8, hidden=512)
    cfg, lora = load_config(base), LoraConfig(rank=2)
    adapter = write_local(
        tmp_path / "adapter", init_params(cfg, lora, 0), lora, str(base), fingerprint(base),
        cfg.num_hidden_layers, [1.0],
    )  # fmt: skip
    out = tmp_path / "out"
    args = ["export", str(adapter), str(out), "--dtype", "f32", "--shard-size", "1M"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "spill", *args], stderr=subprocess.DEVNULL, env=os.environ | ENV
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if any(p.is_file() for t in tmp_path.glob(".out.*.exporting") for p in t.iterdir()):
            break
        time.sleep(0.001)
    assert proc.poll() is None, "the export finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists() and list(tmp_path.glob(".out.*.exporting"))
    _ok(_spill(*args))
    assert (out / "export.json").is_file() and not list(tmp_path.glob(".out.*.exporting"))


# --- llama.cpp --------------------------------------------------------------------------------


def _llama_cpp_answers(path: Path, folder: Path) -> tuple[list[str], list[float]]:
    """llama.cpp's own greedy tokens (6, stopping where spill stops) and the gold answers'
    summed log-probs, from the token ids spill's tokenizer of ``folder`` gives."""
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed (it builds from its sdist)"
    )
    from spill.models.tokenizer import Tokenizer

    tok = Tokenizer(folder)
    llm = llama_cpp.Llama(
        model_path=str(path),
        n_ctx=128,
        logits_all=True,
        verbose=False,
        n_threads=1,
        type_k=0,
        type_v=0,  # an F32 KV cache (GGML_TYPE_F32; the default F16 rounds)
    )
    outputs, logprobs = [], []
    for row in ROWS:
        prompt, answer = tok.encode(row["prompt"]), tok.encode(row["answer"], False)
        llm.reset()
        llm.eval(prompt + answer)
        scores = np.asarray(llm.scores[: llm.n_tokens], dtype=np.float64)
        top = scores.max(-1, keepdims=True)
        lp = scores - top - np.log(np.exp(scores - top).sum(-1, keepdims=True))  # log-softmax
        logprobs.append(float(sum(lp[len(prompt) - 1 + i, t] for i, t in enumerate(answer))))
        llm.reset()
        llm.eval(prompt)
        new = []
        for _ in range(6):
            nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            if nxt in tok.eos_ids:
                break
            new.append(nxt)
            llm.eval([nxt])
        outputs.append(tok.decode(new))
    return outputs, logprobs


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> dict:
    """The embedded SmolLM2-135M (float32 import) with a random rank-8 adapter on every
    linear, exported as hf and as an F32 GGUF (its tokenizer has merges, which llama.cpp
    needs: the tiny models' byte-only vocabulary has none, and gguf cannot write an empty
    list)."""
    from spill.jobs.adapter_files import write_local
    from spill.models.config import load_config
    from spill.models.lora import ALL_LINEAR, LoraConfig, init_params

    root = tmp_path_factory.mktemp("smollm2")
    home = root / "home"
    done = _ok(_spill("models", "import", "smollm2:135m", "--dequantize", home=home))
    folder = Path(done.stdout.strip().splitlines()[-1])
    cfg = load_config(folder)
    lora = LoraConfig(rank=8, targets=ALL_LINEAR)
    params = init_params(cfg, lora, seed=0)
    rng = np.random.default_rng(0)
    for name in params:
        if name.endswith("lora_b"):
            params[name] = rng.normal(0, 0.01, params[name].shape).astype(np.float32)
    adapter = write_local(
        root / "adapter", params, lora, str(folder), fingerprint(folder), cfg.num_hidden_layers,
        [1.0],
    )  # fmt: skip
    hf, gg = root / "hf", root / "gguf"
    _ok(_spill("export", str(adapter), str(hf), "--dtype", "f32", home=home))
    _ok(_spill("export", str(adapter), str(gg), "--format", "gguf", "--dtype", "f32", home=home))
    return {"root": root, "home": home, "base": folder, "hf": hf, "gguf": gg / "model-f32.gguf"}


@pytest.mark.slow
def test_llama_cpp_runs_the_smollm2_gguf_as_transformers_runs_the_hf_export(smollm2):
    """llama.cpp itself (where llama-cpp-python is installed): the same greedy tokens, and
    log-probs within 1e-4 (with its default F16 KV cache they differ by up to 8e-3)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    theirs = _llama_cpp_answers(smollm2["gguf"], smollm2["hf"])
    ours = _greedy_and_logprobs(_transformers(smollm2["hf"]), smollm2["hf"])
    assert theirs[0] == ours[0]
    assert np.allclose(theirs[1], ours[1], rtol=0, atol=1e-4), (theirs[1], ours[1])


@pytest.mark.slow
def test_llama_cpp_runs_a_llama3_rope_gguf_as_transformers_runs_the_hf_export(smollm2, tmp_path):
    """Llama 3.1+'s rope scaling travels as llama.cpp's rope_freqs tensor: SmolLM2 given
    llama3 scaling (original context 1024) answers in llama.cpp as in transformers, and not as
    without the scaling."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from spill.jobs.export.gguf import rope_freqs
    from spill.models.config import load_config

    adapter, base = _rope_scaled(tmp_path, smollm2["base"])
    factors = rope_freqs(load_config(base))
    assert factors.min() == 1 and factors.max() == 8 and len(set(factors.tolist())) > 2
    hf, gg = tmp_path / "hf", tmp_path / "gguf"
    _ok(_spill("export", str(adapter), str(hf), "--dtype", "f32"))
    _ok(_spill("export", str(adapter), str(gg), "--format", "gguf", "--dtype", "f32"))
    theirs = _llama_cpp_answers(gg / "model-f32.gguf", hf)
    ours = _greedy_and_logprobs(_transformers(hf), hf)
    assert theirs[0] == ours[0]
    assert np.allclose(theirs[1], ours[1], rtol=0, atol=1e-4), (theirs[1], ours[1])
    unscaled = tmp_path / "unscaled"
    config = json.loads((hf / "config.json").read_text())
    del config["rope_scaling"]
    import shutil

    shutil.copytree(hf, unscaled)
    (unscaled / "config.json").write_text(json.dumps(config))
    plain = _greedy_and_logprobs(_transformers(unscaled), unscaled)
    assert np.abs(np.array(plain[1]) - np.array(ours[1])).max() > 0.02  # the scaling matters
