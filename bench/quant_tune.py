"""The tune sides of ``bench/quant.py`` (issue 22): QLoRA on SmolLM2 against transformers + PEFT
+ bitsandbytes 4-bit on the CPU (``qlora``), and spill's MLX tune against ``mlx_lm.lora`` on the
same folder (``mlx``). Every side runs in a fresh process (its own peak RSS), sides alternating
per round; the work is ``bench/tune.py``'s (issue 13's shapes: LoRA r16 alpha 32 on all seven
linears, dropout 0, 4 x 128 tokens a step, AdamW lr 1e-4, one thread per side).

* spill sides: ``bench/tune.py``'s ``spill_worker`` (the real CLI, ``StreamTrainer.apply``
  timed) with ``--dtype float32`` and ``--resident`` or ``--ring 2``; ``qlora`` tunes
  ``smollm2:135m@q4_1`` (the GGUF's own Q4_1, kept), ``mlx`` tunes ``--spill-model``.
* ``peft bnb4``: ``AutoModelForCausalLM`` on the float import with ``BitsAndBytesConfig``
  (``load_in_4bit``, NF4, float32 compute, no double quantization) on the CPU, wrapped by
  ``get_peft_model``. A probe (load and quantize only) runs first; if it fails, its error is
  recorded and ``peft f32`` (PEFT on the float base, ``bench/tune.py``'s ``peft_worker``) is the
  reference instead.
* ``mlx_lm``: ``mlx_lm.lora.run`` in process on the same folder spill tunes, ``--num-layers -1``,
  the same LoRA keys, rank 16, scale 2 (alpha / rank), dropout 0, AdamW, batch 4, max length
  128 (longer rows truncated, as spill's ``--seq-len``); ``train.jsonl`` and ``valid.jsonl`` are
  the same rows. Its steps are timed by a ``TrainingCallback`` reporting every step; mlx-lm
  validates before step 1 and before the last step, so the steady state runs from the end of
  step 1 to the end of step N-1.

The PEFT and mlx-lm sides run in ``--peft-python`` (a venv with peft, bitsandbytes and mlx-lm).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import tune
from bench.tune import ALPHA, LENGTH, LR, RANK, ROWS, TARGETS, env_for, train_file

QUANT = Path(__file__).resolve().parent / "quant.py"
KEYS = [f"self_attn.{t}" for t in TARGETS[:4]] + [f"mlp.{t}" for t in TARGETS[4:]]


def _rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bnb_worker(spec: dict) -> dict:
    import numpy as np
    import torch
    from peft import LoraConfig, get_peft_model
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    tok = Tokenizer.from_file(str(Path(spec["model"]) / "tokenizer.json"))
    rows = [json.loads(line)["text"] for line in Path(spec["train"]).read_text().splitlines()]
    ids = np.array([tok.encode(r).ids[:LENGTH] for r in rows], dtype=np.int64)
    q = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.float32,
        bnb_4bit_use_double_quant=False,
    )
    model = AutoModelForCausalLM.from_pretrained(
        spec["model"], quantization_config=q, dtype=torch.float32, device_map="cpu"
    )
    kinds = sorted({type(m).__name__ for n, m in model.named_modules() if n.endswith("q_proj")})
    if spec.get("probe"):  # loads and quantizes: enough to know whether bitsandbytes runs here
        return {"base_linear": kinds, "peak_rss_mb": _rss_mb()}
    model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0,
                                             target_modules=TARGETS))  # fmt: skip
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    ends = []
    for step in range(spec["steps"]):
        batch = torch.from_numpy(ids[(step * ROWS) % len(ids) :][:ROWS])
        out = model(input_ids=batch, attention_mask=torch.ones_like(batch), labels=batch)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        ends.append(time.perf_counter())
    return _timed(ends, len(ends) - 1) | {"base_linear": kinds}


def mlxlm_worker(spec: dict) -> dict:
    # the same BLAS as spill's MLX side (an OpenBLAS loaded into the global scope before mlx),
    # else mlx-lm would multiply on the wheel's reference BLAS and lose for that alone; the
    # module is loaded by its path (importing spill.engines.mlx would import mlx first)
    import importlib.util
    import types

    where = Path(tune.REPO) / "spill" / "engines" / "mlx" / "blas.py"
    blas = importlib.util.module_from_spec(importlib.util.spec_from_file_location("blas", where))
    blas.__spec__.loader.exec_module(blas)
    blas.preload()
    from mlx_lm import lora
    from mlx_lm.tuner.callbacks import TrainingCallback

    ends: list[float] = []

    class Timer(TrainingCallback):
        def on_train_loss_report(self, info: dict) -> None:
            ends.append(time.perf_counter())

    args = dict(lora.CONFIG_DEFAULTS)
    args.update(
        model=spec["model"], train=True, data=spec["data"], seed=0, num_layers=-1,
        batch_size=ROWS, iters=spec["steps"], val_batches=1, learning_rate=LR,
        steps_per_report=1, steps_per_eval=10**6, save_every=10**6, max_seq_length=LENGTH,
        adapter_path=spec["state"], optimizer="adamw",
        lora_parameters={"rank": RANK, "dropout": 0.0, "scale": ALPHA / RANK, "keys": KEYS},
    )  # fmt: skip
    # mlx-lm 0.32.2's run() replaces the callback it is given by get_reporting_callbacks'
    lora.get_reporting_callbacks = lambda *a, **k: Timer()
    lora.run(types.SimpleNamespace(**args))
    assert len(ends) == spec["steps"], ends
    timed = _timed(ends[:-1], len(ends) - 2)  # the last step comes after a validation
    return timed | {"blas": blas.describe()}


def _timed(ends: list[float], steps: int) -> dict:
    return {
        "tokens_per_s": ROWS * LENGTH * steps / (ends[-1] - ends[0]),
        "step_s": [round(b - a, 3) for a, b in zip(ends, ends[1:], strict=False)],
        "peak_rss_mb": _rss_mb(),
    }


WORKERS = {
    "_spill": tune.spill_worker,
    "_peft": tune.peft_worker,
    "_bnb": bnb_worker,
    "_mlxlm": mlxlm_worker,
}


# --- the driver -----------------------------------------------------------------------------------


def run_worker(python: str, kind: str, spec: dict, env: dict) -> dict:
    """The worker's JSON, or ``{"error": ...}`` with the tail of its stderr."""
    proc = subprocess.run([python, str(QUANT), kind, json.dumps(spec)], env=env,
                          capture_output=True, text=True)  # fmt: skip
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        return {"error": lines[-1] if lines else f"exit {proc.returncode}",
                "stderr_tail": proc.stderr[-3000:]}  # fmt: skip
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["prerun"] = [ln for ln in proc.stderr.splitlines() if ln.startswith("spill tune")]
    return out


def alternate(a, sides: dict, home: Path, reference: str) -> dict:
    """Each side once per round, the order reversed every other round; ratios to ``reference``
    within each round."""
    results: dict[str, list[dict]] = {k: [] for k in sides}
    for r in range(a.rounds):
        for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
            python, kind, spec, env = sides[name]
            state = home.parent / "state" / f"{name.replace(' ', '-')}-{r}"
            subprocess.run(["rm", "-rf", str(state)], check=True)
            got = run_worker(python, kind, spec | {"state": str(state)}, env)
            results[name].append(got)
            if "error" in got:
                print(f"round {r + 1} {name}: FAILED: {got['error']}", flush=True)
            else:
                print(f"round {r + 1} {name}: {got['tokens_per_s']:.1f} tok/s, peak RSS "
                      f"{got['peak_rss_mb']:.0f} MB", flush=True)  # fmt: skip
    ratios = {}
    for name, runs in results.items():
        pairs = [(x, p) for x, p in zip(runs, results[reference], strict=True)
                 if "error" not in x and "error" not in p]  # fmt: skip
        if name == reference or not pairs:
            continue
        speed = [x["tokens_per_s"] / p["tokens_per_s"] for x, p in pairs]
        rss = [x["peak_rss_mb"] / p["peak_rss_mb"] for x, p in pairs]
        ratios[name] = {"tokens_per_s": speed, "peak_rss": rss}
        print(f"{name} vs {reference}: tokens/s {statistics.median(speed):.2f}x, peak RSS "
              f"{statistics.median(rss):.2f}x", flush=True)  # fmt: skip
    return {"reference": reference, "results": results, "ratios": ratios}


def _settings(a) -> dict:
    return {"rows": ROWS, "length": LENGTH, "rank": RANK, "alpha": ALPHA, "targets": TARGETS,
            "steps": a.steps or 6, "rounds": a.rounds, "threads": 1}  # fmt: skip


def bench_qlora(a, home: Path) -> dict:
    from bench.quant import SMOL_Q, folder_of

    steps = a.steps or 6
    train = train_file(home.parent / "train.jsonl")
    env = env_for(home, 1, tune.REPO)
    spill_py = a.python or sys.executable
    base = {"train": str(train), "steps": steps}
    float_folder = str(home / "models" / "smollm2-135m")
    sides = {}
    probe = run_worker(a.peft_python, "_bnb", base | {"model": float_folder, "probe": True}, env)
    if "error" in probe:
        print(f"qlora: bitsandbytes 4-bit cannot run here: {probe['error']}", flush=True)
        reference = "peft f32"
        sides[reference] = (a.peft_python, "_peft", base | {"model": float_folder}, env)
    else:
        reference = "peft bnb4"
        sides[reference] = (a.peft_python, "_bnb", base | {"model": float_folder}, env)
    model = str(folder_of(SMOL_Q))
    for name, flags in (("resident", ["--resident"]), ("ring2", ["--ring", "2"])):
        spec = base | {"model": model, "flags": [*flags, "--dtype", "float32"]}
        sides[f"spill q4_1 {name}"] = (spill_py, "_spill", spec, env)
    out = alternate(a, sides, home, reference)
    return out | {"bnb_probe": probe, "settings": _settings(a)}


def bench_mlx(a, home: Path) -> dict:
    from bench.quant import folder_of

    steps = max(a.steps or 6, 3)
    data = home.parent / "mlx-data"
    data.mkdir(exist_ok=True)
    train = train_file(data / "train.jsonl")
    (data / "valid.jsonl").write_text(train.read_text())
    env = env_for(home, 1, tune.REPO)
    folder = str(folder_of(a.spill_model))
    base = {"train": str(train), "steps": steps, "model": folder}
    sides = {"mlx_lm": (a.peft_python, "_mlxlm", base | {"data": str(data)}, env)}
    for name, flags in (("resident", ["--resident"]), ("ring2", ["--ring", "2"])):
        spec = base | {"flags": [*flags, "--engine", "mlx", "--dtype", "float32"]}
        sides[f"spill mlx {name}"] = (a.python or sys.executable, "_spill", spec, env)
    if a.sides:  # --sides "spill mlx resident": those and the reference
        sides = {k: v for k, v in sides.items() if k == "mlx_lm" or k in a.sides.split(",")}
    out = alternate(a, sides, home, "mlx_lm")
    return out | {"model": a.spill_model, "folder": folder, "settings": _settings(a) | {
        "steps": steps}}  # fmt: skip
