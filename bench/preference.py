"""What a DPO step costs against TRL's ``DPOTrainer`` + PEFT (issue 40), for
docs/reports/019-preference.md. One run, sides alternating, each in a fresh process (its own peak
RSS); nothing here asserts a time.

    python bench/preference.py [--rounds 2] [--steps 6] [--threads 1] [--json OUT]

The work: SmolLM2-135M's float import (bench/tune.py's ``model_folder``), LoRA rank 16, alpha 32
on all seven linears, dropout 0, DPO beta 0.1, 4 pairs a step (8 sequences of 128 tokens: a
64-token prompt and answers cut at 128), AdamW lr 1e-4, no warmup, float32.

Sides: ``trl``: ``DPOTrainer`` with a ``peft`` model (its reference is the adapter switched off:
one copy of the model, a second forward per step); ``spill resident`` and ``spill ring2``: the
real CLI, ``--method dpo``, whose reference is one forward of the base the first time a step
takes a pair (in these steps: every one, as in TRL; kept for later epochs).
Tokens/s is steady state, from the end of step 1 to the end of step N (spill: a timer around
``StreamTrainer.apply``; TRL: its ``on_step_end`` callback); tokens are the 8 sequences' real
tokens. Peak RSS is the worker's ``ru_maxrss``, loading included.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.tune import (  # noqa: E402
    REPO,
    _rss_mb,
    env_for,
    load_average,
    model_folder,
    timed_tune,  # noqa: E402
)
from bench.tune import run_worker as worker  # noqa: E402

PAIRS, LENGTH, PROMPT, RANK, ALPHA, LR, BETA = 4, 128, 64, 16, 32, 1e-4, 0.1
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def pairs_file(path: Path, folder: Path) -> tuple[Path, int]:
    """Pairs whose prompt is 64 tokens and whose answers run past 128: every sequence is cut
    at 128. Returns the file and the real tokens of a step's 8 sequences."""
    import random

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    words = "the model reads a ticket and answers with one label billing account login bug".split()
    rng = random.Random(0)
    rows = []
    for _ in range(64):
        ids = tok.encode(" ".join(rng.choices(words, k=200))).ids[:PROMPT]
        prompt = tok.decode(ids)
        chosen = " " + " ".join(rng.choices(words, k=120))
        rejected = " no " + " ".join(rng.choices(words, k=120))
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, 2 * PAIRS * LENGTH


def spill_worker(spec: dict) -> dict:
    import spill

    steps = spec["steps"]
    args = ["tune", spec["model"], spec["train"], "--name", "bench", "--state", spec["state"]]
    args += ["--method", "dpo", "--beta", str(BETA), "--steps", str(steps)]
    args += ["--ckpt-every", str(steps), "--rank", str(RANK), "--alpha", str(ALPHA)]
    args += ["--targets", "all", "--dropout", "0", "--lr", str(LR), "--warmup", "0"]
    args += ["--batch", str(PAIRS), "--micro-batch", str(PAIRS), "--seq-len", str(LENGTH)]
    args += ["--seed", "0", "--dtype", "float32", *spec["flags"]]
    ends = timed_tune(args)
    assert len(ends) == steps
    return {
        "spill": spill.__file__,
        "tokens_per_s": spec["tokens"] * (steps - 1) / (ends[-1] - ends[0]),
        "step_s": [round(b - a, 3) for a, b in zip(ends, ends[1:], strict=False)],
        "peak_rss_mb": _rss_mb(),
    }


def trl_worker(spec: dict) -> dict:
    import datasets
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model
    from trl import DPOConfig, DPOTrainer

    ends: list[float] = []

    class Ends(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    folder = spec["model"]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    lora = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS)
    model = get_peft_model(model, lora)
    rows = [json.loads(line) for line in Path(spec["train"]).read_text().splitlines()]
    args = DPOConfig(
        output_dir=spec["state"],
        per_device_train_batch_size=PAIRS,
        max_steps=spec["steps"],
        learning_rate=LR,
        lr_scheduler_type="cosine",
        beta=BETA,
        max_length=LENGTH,
        bf16=False,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=spec["steps"],
        gradient_checkpointing=False,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = DPOTrainer(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=transformers.AutoTokenizer.from_pretrained(folder),
        callbacks=[Ends()],
    )
    trainer.train()
    steps = spec["steps"]
    return {
        "tokens_per_s": spec["tokens"] * (steps - 1) / (ends[-1] - ends[0]),
        "step_s": [round(b - a, 3) for a, b in zip(ends, ends[1:], strict=False)],
        "peak_rss_mb": _rss_mb(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1, help="0: each library's default")
    ap.add_argument("--home", type=Path, default=Path(tempfile.gettempdir()) / "spill-bench-tune")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    home = a.home / "home"
    home.mkdir(parents=True, exist_ok=True)
    folder = model_folder(home)
    train, tokens = pairs_file(a.home / "pairs.jsonl", folder)
    base = {"model": str(folder), "train": str(train), "steps": a.steps, "tokens": tokens}
    env = env_for(home, a.threads, REPO)
    sides = {
        "trl": ("trl", base),
        "spill resident": ("spill", base | {"flags": ["--resident"]}),
        "spill ring2": ("spill", base | {"flags": ["--ring", "2"]}),
    }
    results: dict[str, list[dict]] = {k: [] for k in sides}
    for r in range(a.rounds):
        for name in list(sides) if r % 2 == 0 else list(reversed(sides)):
            kind, spec = sides[name]
            state = a.home / "state" / f"pref-{name.replace(' ', '-')}-{r}"
            shutil.rmtree(state, ignore_errors=True)
            got = worker(kind, spec | {"state": str(state)}, env, __file__)
            got["load_average"] = load_average()
            results[name].append(got)
            print(
                f"round {r + 1} {name}: {got['tokens_per_s']:.1f} tok/s, peak RSS "
                f"{got['peak_rss_mb']:.0f} MB (load {got['load_average']:.1f})",
                flush=True,
            )
    lines, ratios = [], {}
    for name, runs in results.items():
        if name == "trl":
            continue
        trl = results["trl"]
        speed = [x["tokens_per_s"] / t["tokens_per_s"] for x, t in zip(runs, trl, strict=True)]
        rss = [x["peak_rss_mb"] / t["peak_rss_mb"] for x, t in zip(runs, trl, strict=True)]
        ratios[name] = {"tokens_per_s": speed, "peak_rss": rss}
        lines.append(
            f"{name} vs trl: tokens/s median {statistics.median(speed):.2f}x "
            f"({', '.join(f'{s:.2f}' for s in speed)}), peak RSS median "
            f"{statistics.median(rss):.2f}x"
        )
    for line in lines:
        print(line)
    if a.json:
        settings = {"pairs": PAIRS, "length": LENGTH, "prompt": PROMPT, "rank": RANK}
        settings |= {"alpha": ALPHA, "lr": LR, "beta": BETA, "steps": a.steps}
        doc = {"settings": settings | {"rounds": a.rounds, "threads": a.threads}}
        doc |= {"results": results, "ratios": ratios, "lines": lines}
        a.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] in ("_spill", "_trl"):
        worker = spill_worker if sys.argv[1] == "_spill" else trl_worker
        print(json.dumps(worker(json.loads(sys.argv[2]))))
        sys.exit(0)
    sys.exit(main())
