"""llama.cpp itself reading spill's GGUF exports of each family it writes (issue 37): for each
of tests/func/test_export_families.py's ``GGUF_VARIANTS`` (small random transformers-made models
with a one-merge byte-level BPE), a 2-step spill tune, ``spill export --format gguf --dtype f32``
and the HF export of the same adapter; then llama.cpp (``llama-cpp-python`` in its own venv,
``--llama-python``) and spill (the HF export, float32) each continue the same prompt ids
greedily. Printed per family: whether the greedy tokens agree, and the largest difference
between the two sides' logits at the prompt's last position.

    python bench/families_llama_cpp.py --llama-python /path/to/venv/bin/python [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from spill.engines.base import GenerateParams, LoadOptions, ModelSpec  # noqa: E402
from spill.engines.torch import ENGINE  # noqa: E402
from spill.models.config import load_config  # noqa: E402
from spill.models.sources.tiny import write_tiny  # noqa: E402
from spill.models.tokenizer import Tokenizer  # noqa: E402
from tests.func.test_export_families import GGUF_VARIANTS, _with_a_merge  # noqa: E402
from tests.unit.engines import hf_families  # noqa: E402

PROMPT = "Question 5: what is 5 plus 8? And then some more words"
NEW = 8
LLAMA = """
import json, sys
import numpy as np
import llama_cpp
path, ids, new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
m = llama_cpp.Llama(path, n_threads=1, n_ctx=256, logits_all=True, verbose=False)
m.eval(ids)
last = np.array(m.scores[len(ids) - 1], dtype=np.float64).tolist()
m.reset()
out = []
for t in m.generate(ids, temp=0.0, top_k=1, reset=True):
    out.append(int(t))
    if len(out) == new:
        break
print(json.dumps({"tokens": out, "logits": last}))
"""


def spill(*args: str, home: Path) -> None:
    env = {**os.environ, "SPILL_HOME": str(home), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "spill", *args], env=env, capture_output=True)
    if done.returncode:
        sys.exit(f"spill {' '.join(args)}: {done.stderr.decode()[-2000:]}")


def one(variant: str, spec: tuple, tmp: Path, llama_python: str) -> dict:
    tiny = write_tiny(tmp / "tiny", family="llama")
    hf_families.VARIANTS.setdefault(variant, spec)
    model = _with_a_merge(hf_families.make(variant, tmp / variant, tiny))
    train = tmp / "train.jsonl"
    rows = [
        {"prompt": f"Question {i}: what is {i} plus 3?", "completion": f" {i + 3}."}
        for i in range(8)
    ]
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    home, state = tmp / "home", tmp / "state"
    tune = ["--steps", "2", "--batch", "4", "--lr", "0.05", "--rank", "4", "--seq-len", "64"]
    spill("tune", str(model), str(train), "--name", "t", "--state", str(state), *tune,
          "--targets", "all", "--dtype", "float32", home=home)  # fmt: skip
    hf, gguf = tmp / "hf", tmp / "gguf"
    spill("export", str(state), str(hf), "--dtype", "f32", home=home)
    spill("export", str(state), str(gguf), "--format", "gguf", "--dtype", "f32", home=home)
    ids = Tokenizer(hf).encode(PROMPT)
    runner = ENGINE.open(
        ModelSpec(hf, load_config(hf)), LoadOptions(dtype="float32", resident=True)
    )
    try:
        (gen,) = runner.generate([np.asarray(ids)], GenerateParams(max_new_tokens=NEW), [0])
        k = runner.model.kernel
        h = runner.model.forward(
            k.array(np.asarray(ids)[None]), k.context(np.ones((1, len(ids)), bool), 0, len(ids))
        )
        mine = k.numpy(k.logits(h[:, -1]))[0].astype(np.float64)
    finally:
        runner.close()
    done = subprocess.run(
        [llama_python, "-c", LLAMA, str(gguf / "model-f32.gguf"), json.dumps(ids), str(NEW)],
        capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode:
        return {"variant": variant, "error": done.stderr.strip().splitlines()[-1:]}
    theirs = json.loads(done.stdout)
    gap = float(np.max(np.abs(np.asarray(theirs["logits"]) - mine)))
    return {
        "variant": variant,
        "spill": gen.tokens.tolist(),
        "llama.cpp": theirs["tokens"],
        "greedy_equal": gen.tokens.tolist() == theirs["tokens"][: len(gen.tokens)],
        "logit_gap": gap,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-python", required=True)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out = []
    for variant, spec in GGUF_VARIANTS.items():
        with tempfile.TemporaryDirectory() as d:
            r = one(variant, spec, Path(d), args.llama_python)
        out.append(r)
        if "error" in r:
            print(f"{variant:14} llama.cpp refused or failed: {r['error']}", flush=True)
        else:
            print(
                f"{variant:14} greedy equal {r['greedy_equal']!s:5}  logit gap {r['logit_gap']:.2e}",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
