"""Tune and generation at the real shapes of Qwen3-0.6B and Gemma-3-270M against transformers
(+ PEFT) (issue 37), for docs/reports/020-families-real-shape.md. One run, sides alternating,
each side in a fresh process (its own peak RSS); nothing here asserts a time.

    python bench/families_real.py [--rounds 3] [--steps 3] [--threads 1] [--json OUT]

The models are random, made by transformers from the published configs written below
(``XxxForCausalLM(config)``, float32, ``save_pretrained``; no hub), with spill's tiny byte-level
tokenizer beside them (259 tokens: the text's ids all fall below 259, the vocabulary and so the
head keep their real width; the compute does not depend on which ids).

* tune: LoRA r 16, alpha 32 on all seven linears, dropout 0, batch 4 x 128 tokens (each text row
  longer than 128 tokens: 512 tokens a step), AdamW lr 1e-4, float32. Sides: ``peft``
  (transformers ``AutoModelForCausalLM`` + ``peft.get_peft_model``, ``torch.optim.AdamW``,
  labels = ids), ``spill resident`` and ``spill ring2`` (the real CLI, ``spill tune ... --dtype
  float32`` with ``--resident`` or ``--ring 2``). Tokens/s from the end of step 1 to the end of
  step N (bench/tune.py's ``timed_tune``): loading and the first step are excluded.
* generate: greedy, a 64-token prompt, 32 new tokens (no stop token: every row makes all 32), at
  batch 1 then batch 8 in the same process after a 2-token warm call. Sides: ``hf`` (transformers
  ``generate``, ``min_new_tokens`` 32), ``spill resident`` and ``spill ring2`` (``Runner.generate``
  opened with ``LoadOptions(resident=True)`` or ``LoadOptions(ring=2)``, float32). Tokens/s are
  new tokens / the call's time (its prefill included).

Peak RSS is the worker's ``ru_maxrss`` (loading included). Each worker also samples its VmRSS
every 10 ms and the tune workers mark when the head runs (PEFT: a hook on the final norm; spill:
``TorchKernel.head_vjp`` wrapped), so the report can say where the peak sits.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engines_common import machine as common_machine  # noqa: E402
from bench.tune import REPO, _rss_mb, env_for, run_worker, timed_tune, train_file  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ROWS, LENGTH, RANK, ALPHA, LR = 4, 128, 16, 32, 1e-4
PROMPT, NEW, BATCHES = 64, 32, (1, 8)
SPECIAL = dict(bos_token_id=256, eos_token_id=258, pad_token_id=256)  # the tiny tokenizer's ids

# the published configs (Qwen/Qwen3-0.6B, google/gemma-3-270m), the keys that shape the compute
SHAPE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
SHAPE += ("num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")
COMMON = dict(rms_norm_eps=1e-6, tie_word_embeddings=True)
GEMMA_ROPE = {
    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
}
MODELS = {  # name: (transformers class prefix, config class, config keys)
    "qwen3-0.6b": (
        "Qwen3",
        "Qwen3Config",
        dict(zip(SHAPE, (151936, 1024, 3072, 28, 16, 8, 128, 40960), strict=True))
        | dict(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        | dict(attention_bias=False, hidden_act="silu", **COMMON),
    ),
    "gemma-3-270m": (
        "Gemma3",
        "Gemma3TextConfig",
        dict(zip(SHAPE, (262144, 640, 2048, 18, 4, 1, 256, 32768), strict=True))
        | dict(query_pre_attn_scalar=256, sliding_window=512, rope_parameters=GEMMA_ROPE)
        | dict(layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3)
        | dict(hidden_activation="gelu_pytorch_tanh", **COMMON),
    ),
}


# --- memory -----------------------------------------------------------------------------------


def _vmrss_mb() -> float:
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024  # kB


class Sampler:
    """VmRSS every 10 ms in a thread: ``peak(a, b)`` is the largest sample between two times."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.perf_counter(), _vmrss_mb()))
            time.sleep(0.01)

    def peak(self, a: float = 0.0, b: float = float("inf")) -> float:
        return max((m for t, m in self.samples if a <= t <= b), default=0.0)

    def at(self, t: float) -> float:
        """The first sample at or after ``t``."""
        return next((m for s, m in self.samples if s >= t), 0.0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


# --- tune workers -----------------------------------------------------------------------------


def spill_tune_worker(spec: dict) -> dict:
    from spill.engines.core import train
    from spill.engines.torch.kernel import TorchKernel

    sampler = Sampler()
    steps = spec["steps"]
    starts: list[float] = []  # when each micro-batch began: the first one ends the loading
    accumulate = train.StreamTrainer.accumulate

    def marked(self, *a, **k):
        starts.append(time.perf_counter())
        return accumulate(self, *a, **k)

    train.StreamTrainer.accumulate = marked
    heads: list[tuple[float, float]] = []  # each head_vjp's start and end
    head_vjp = TorchKernel.head_vjp

    def head(self, *a, **k):
        start = time.perf_counter()
        got = head_vjp(self, *a, **k)
        heads.append((start, time.perf_counter()))
        return got

    TorchKernel.head_vjp = head
    args = ["tune", spec["model"], spec["train"], "--name", "bench", "--state", spec["state"]]
    args += ["--steps", str(steps), "--ckpt-every", str(steps), "--rank", str(RANK)]
    args += ["--alpha", str(ALPHA), "--targets", "all", "--dropout", "0", "--lr", str(LR)]
    args += ["--warmup", "0", "--batch", str(ROWS), "--micro-batch", str(ROWS)]
    args += ["--seq-len", str(LENGTH), "--seed", "0", "--dtype", "float32", *spec["flags"]]
    ends = timed_tune(args)
    sampler.stop()
    assert len(ends) == steps
    heads_after = [(a, b) for a, b in heads if a > ends[0]]
    return {
        "tokens_per_s": ROWS * LENGTH * (steps - 1) / (ends[-1] - ends[0]),
        "step_s": [round(b - a, 2) for a, b in zip(ends, ends[1:], strict=False)],
        "peak_rss_mb": _rss_mb(),
        "rss_loaded_mb": sampler.peak(0.0, starts[0]) if starts else None,
        "step_peak_mb": [sampler.peak(a, b) for a, b in zip(ends, ends[1:], strict=False)],
        # within the timed steps: the largest RSS before any head, and during the heads
        "body_peak_mb": sampler.peak(ends[0], heads_after[0][0]) if heads_after else None,
        "head_peak_mb": max((sampler.peak(a, b) for a, b in heads_after), default=None),
        "rss_at_head_mb": [sampler.at(a) for a, _ in heads_after],
    }


def peft_tune_worker(spec: dict) -> dict:
    import numpy as np
    import torch
    from peft import LoraConfig, get_peft_model
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    sampler = Sampler()
    tok = Tokenizer.from_file(str(Path(spec["model"]) / "tokenizer.json"))
    rows = [json.loads(line)["text"] for line in Path(spec["train"]).read_text().splitlines()]
    ids = np.array([tok.encode(r).ids[:LENGTH] for r in rows], dtype=np.int64)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS)
    model = get_peft_model(model, config)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    heads: list[float] = []  # when each step's final norm ended: the head starts
    model.base_model.model.model.norm.register_forward_hook(
        lambda *_: heads.append(time.perf_counter())
    )
    loaded = time.perf_counter()
    ends: list[float] = []
    for step in range(spec["steps"]):
        batch = torch.from_numpy(ids[(step * ROWS) % len(ids) :][:ROWS])
        out = model(input_ids=batch, attention_mask=torch.ones_like(batch), labels=batch)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        ends.append(time.perf_counter())
    sampler.stop()
    steps = spec["steps"]
    intervals = list(zip(ends, ends[1:], strict=False))
    return {
        "tokens_per_s": ROWS * LENGTH * (steps - 1) / (ends[-1] - ends[0]),
        "step_s": [round(b - a, 2) for a, b in intervals],
        "peak_rss_mb": _rss_mb(),
        "rss_loaded_mb": sampler.peak(0.0, loaded),
        "step_peak_mb": [sampler.peak(a, b) for a, b in intervals],
        # RSS over each timed step's body (before the head) and from the head on
        "body_peak_mb": [
            sampler.peak(a, h) for (a, _), h in zip(intervals, heads[1:], strict=False)
        ],
        "head_peak_mb": [
            sampler.peak(h, b) for (_, b), h in zip(intervals, heads[1:], strict=False)
        ],
        "rss_at_head_mb": [sampler.at(h) for h in heads[1:]],
    }


# --- generation workers -----------------------------------------------------------------------


def _prompts(vocab: int, batch: int):
    import numpy as np

    rng = np.random.default_rng(batch)
    return rng.integers(3, min(vocab, 256), (batch, PROMPT)).astype(np.int64)  # byte ids


def hf_generate_worker(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
    out = {}

    def gen(ids, new):
        with torch.no_grad():
            got = model.generate(
                torch.from_numpy(ids),
                attention_mask=torch.ones(ids.shape, dtype=torch.long),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=SPECIAL["pad_token_id"],
            )
        assert got.shape[1] == PROMPT + new, got.shape
        return got

    gen(_prompts(256, 1), 2)  # warm
    for b in BATCHES:
        ids = _prompts(256, b)
        start = time.perf_counter()
        gen(ids, NEW)
        out[f"b{b}_tokens_per_s"] = b * NEW / (time.perf_counter() - start)
    out["peak_rss_mb"] = _rss_mb()
    return out


def spill_generate_worker(spec: dict) -> dict:
    from spill.engines import resolve
    from spill.engines.base import GenerateParams, LoadOptions, ModelSpec
    from spill.models.config import load_config

    folder = Path(spec["model"])
    cfg = load_config(folder)
    opts = LoadOptions(dtype="float32", **spec["load"])
    runner = resolve("torch").open(ModelSpec(folder, cfg), opts)
    out = {}
    runner.generate(list(_prompts(256, 1)), GenerateParams(max_new_tokens=2), [0])  # warm
    for b in BATCHES:
        ids = list(_prompts(256, b))
        start = time.perf_counter()
        gens = runner.generate(ids, GenerateParams(max_new_tokens=NEW), list(range(b)))
        out[f"b{b}_tokens_per_s"] = b * NEW / (time.perf_counter() - start)
        assert all(len(g.tokens) == NEW for g in gens)
    runner.close()
    out["peak_rss_mb"] = _rss_mb()
    return out


WORKERS = {
    "spill_tune": spill_tune_worker,
    "peft_tune": peft_tune_worker,
    "hf_generate": hf_generate_worker,
    "spill_generate": spill_generate_worker,
}


# --- the driver -------------------------------------------------------------------------------


def make(name: str, folder: Path) -> Path:
    """The random model of ``name``'s real shape, float32, with spill's tiny tokenizer."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    import transformers

    from spill.models.sources.tiny import CHATML, SPECIALS, tokenizer_json

    prefix, config_class, keys = MODELS[name]
    config = getattr(transformers, config_class)(**keys, **SPECIAL)
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).float().eval()
    tmp = folder.with_name(folder.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    (tmp / "tokenizer.json").write_text(tokenizer_json())
    tok_cfg = {"chat_template": CHATML, "bos_token": SPECIALS[0], "eos_token": SPECIALS[2]}
    tok_cfg |= {"pad_token": SPECIALS[0], "tokenizer_class": "PreTrainedTokenizerFast"}
    (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    tmp.rename(folder)
    return folder


def machine() -> dict:
    import importlib.metadata as md

    out = common_machine()
    out["versions"] |= {d: md.version(d) for d in ("transformers", "peft")}
    return out


def ratios(results: dict, base: str, key: str) -> dict[str, list[float]]:
    """Each side over ``base`` within the same round (the same minutes of machine load)."""
    out = {}
    for name, runs in results.items():
        if name != base:
            pairs = zip(runs, results[base], strict=False)
            out[name] = [x[key] / b[key] for x, b in pairs]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="0: each library's default")
    ap.add_argument("--parts", default="tune,generate")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--home", type=Path, default=Path(tempfile.gettempdir()) / "spill-bench-real")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    home = a.home / "home"
    home.mkdir(parents=True, exist_ok=True)
    env = env_for(home, a.threads, REPO)
    train = train_file(a.home / "train.jsonl")
    doc: dict = {"machine": machine(), "load_average_start": os.getloadavg()}
    doc["settings"] = {"rounds": a.rounds, "steps": a.steps, "threads": a.threads}
    doc["settings"] |= {"rows": ROWS, "length": LENGTH, "rank": RANK, "alpha": ALPHA, "lr": LR}
    doc["settings"] |= {"prompt": PROMPT, "new": NEW, "batches": BATCHES, "targets": TARGETS}
    doc["configs"] = {k: v[2] for k, v in MODELS.items()}
    doc["results"] = {}
    parts = a.parts.split(",")
    for name in a.models.split(","):
        folder = make(name, a.home / "models" / name)
        base = {"model": str(folder), "train": str(train), "steps": a.steps}
        sides = {}
        if "tune" in parts:
            sides["tune"] = {
                "peft": ("peft_tune", base),
                "spill resident": ("spill_tune", base | {"flags": ["--resident"]}),
                "spill ring2": ("spill_tune", base | {"flags": ["--ring", "2"]}),
            }
        if "generate" in parts:
            sides["generate"] = {
                "hf": ("hf_generate", base),
                "spill resident": ("spill_generate", base | {"load": {"resident": True}}),
                "spill ring2": ("spill_generate", base | {"load": {"ring": 2}}),
            }
        for part, table in sides.items():
            results: dict[str, list[dict]] = {k: [] for k in table}
            doc["results"].setdefault(name, {})[part] = results
            for r in range(a.rounds):
                for side in list(table) if r % 2 == 0 else list(reversed(table)):
                    kind, spec = table[side]
                    state = a.home / "state" / f"{name}-{side.replace(' ', '-')}-{r}"
                    shutil.rmtree(state, ignore_errors=True)
                    got = run_worker(kind, spec | {"state": str(state)}, env, __file__)
                    got["load_average"] = os.getloadavg()[0]
                    results[side].append(got)
                    shown = {k: v for k, v in got.items() if not isinstance(v, list)}
                    print(f"{name} {part} round {r + 1} {side}: {shown}", flush=True)
                    if a.json:  # after every run: a cut-short run keeps what it measured
                        a.json.write_text(json.dumps(doc, indent=1) + "\n")
    doc["load_average_end"] = os.getloadavg()
    doc["ratios"] = summary = {}
    for name, parts_ in doc["results"].items():
        for part, results in parts_.items():
            base = "peft" if part == "tune" else "hf"
            keys = ["tokens_per_s"] if part == "tune" else [f"b{b}_tokens_per_s" for b in BATCHES]
            for key in [*keys, "peak_rss_mb"]:
                for side, rs in ratios(results, base, key).items():
                    summary[f"{name} {part} {side} {key}"] = rs
                    print(
                        f"{name} {part} {side} / {base} {key}: median "
                        f"{statistics.median(rs):.2f}x ({', '.join(f'{x:.2f}' for x in rs)})"
                    )
    if a.json:
        a.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1].lstrip("_") in WORKERS:
        print(json.dumps(WORKERS[sys.argv[1].lstrip("_")](json.loads(sys.argv[2]))))
        sys.exit(0)
    sys.exit(main())
