"""``spill serve`` as a real process on 127.0.0.1, talked to with the official ``openai`` client
and raw ``http.client`` requests.

One server per module (a tiny float32 Qwen2 model, two adapters, an API key); its greedy answers
are checked against ``spill run`` on the same model and adapter, concurrent answers against the
same request served alone. The last test stops it with SIGTERM while a reply streams.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import run_spill

openai = pytest.importorskip("openai")

KEY = "test-key-123"
ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "SPILL_PREEMPT_GRACE": "2"}
NEW = 12  # new tokens of the answers compared with spill run
TOY = Path(__file__).resolve().parents[2] / "projects" / "toy"
PROMPTS = ["hello there", "the cat sat on", "a b c d e f", "1 2 3", "why?"]


def write_adapter(folder: Path, model: Path, seed: int) -> Path:
    from safetensors.numpy import save_file

    from spill.models.config import load_config
    from spill.models.lora import LoraConfig, init_params

    lora = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj"))
    params = init_params(load_config(model), lora, seed=seed)
    rng = np.random.default_rng(seed)
    for name in params:
        if name.endswith("lora_b"):  # nonzero B, so the adapter changes the model
            params[name] = rng.normal(0, 0.5, params[name].shape).astype(np.float32)
    folder.mkdir(parents=True)
    save_file(params, str(folder / "params.safetensors"))
    (folder / "adapter.json").write_text(json.dumps(lora.to_dict()))
    return folder


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    from spill.models.sources.tiny import write_tiny

    root = tmp_path_factory.mktemp("serve")
    model = write_tiny(root / "model", family="qwen2", seed=11)
    adapters = {n: write_adapter(root / n, model, s) for n, s in (("a", 1), ("b", 2))}
    env = {**os.environ, **ENV, "SPILL_HOME": str(root)}
    return {"root": root, "model": model, "adapters": adapters, "env": env}


def start(args: list[str], env: dict) -> tuple[subprocess.Popen, int, list[str]]:
    """``spill serve ARGS --port 0``: the process, its port, and its stderr lines (growing)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "spill", "serve", *args, "--port", "0"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    port = None
    while port is None:
        line = proc.stderr.readline()
        assert line, f"the server ended before serving: {''.join(lines)}"
        lines.append(line)
        if m := re.match(r"serving on http://127\.0\.0\.1:(\d+)$", line.strip()):
            port = int(m.group(1))
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    return proc, port, lines


@pytest.fixture(scope="module")
def server(setup):
    args = [str(setup["model"]), "--dtype", "float32", "--api-key", KEY]
    for name, folder in setup["adapters"].items():
        args += ["--adapter", f"{name}={folder}"]
    proc, port, lines = start(args, setup["env"])
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
    yield {"proc": proc, "port": port, "client": client, "log": lines, "name": str(setup["model"])}
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def raw(port: int, method: str, path: str, body: bytes | None = None, headers=None):
    """(status, parsed JSON body) of one plain HTTP request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request(
        method, path, body=body, headers={"Authorization": f"Bearer {KEY}", **(headers or {})}
    )
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    try:
        return resp.status, json.loads(data)
    except ValueError:
        return resp.status, data


def spill_run(setup, rows: list[dict], tmp_path: Path, adapter: str | None) -> list[str]:
    src, out = tmp_path / "rows.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"id": i, **r}) + "\n" for i, r in enumerate(rows)))
    args = ["run", str(setup["model"]), str(src), "--out", str(out), "--max-new-tokens", str(NEW)]
    args += ["--dtype", "float32", "--batch", "1"]
    if adapter:
        args += ["--adapter", str(setup["adapters"][adapter])]
    proc = run_spill(*args, base=setup["env"], timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = {
        json.loads(line)["id"]: json.loads(line)["output"] for line in out.read_text().splitlines()
    }
    return [got[i] for i in range(len(rows))]


@pytest.mark.parametrize("model", [None, "a", "b"])
def test_greedy_completions_and_chat_equal_spill_run(setup, server, model, tmp_path):
    client, name = server["client"], model or server["name"]
    want = spill_run(setup, [{"prompt": p} for p in PROMPTS], tmp_path, model)
    got = [client.completions.create(model=name, prompt=p, max_tokens=NEW, temperature=0)
           for p in PROMPTS]  # fmt: skip
    assert [g.choices[0].text for g in got] == want
    assert all(g.usage.completion_tokens <= NEW for g in got)
    streamed = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=NEW, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want[0]
    both = client.completions.create(model=name, prompt=PROMPTS[:2], max_tokens=NEW)
    assert [c.text for c in sorted(both.choices, key=lambda c: c.index)] == want[:2]

    messages = [{"role": "user", "content": "hello there"}]
    (reply,) = spill_run(setup, [{"messages": messages}], tmp_path, model)
    chat = client.chat.completions.create(model=name, messages=messages, max_tokens=NEW)
    assert chat.choices[0].message.content == reply and chat.choices[0].message.role == "assistant"
    usage = {"include_usage": True}
    *chunks, last = client.chat.completions.create(
        model=name, messages=messages, max_tokens=NEW, stream=True, stream_options=usage
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reply
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == chat.choices[0].finish_reason
    assert last.choices == [] and last.usage.completion_tokens == chat.usage.completion_tokens


def test_models_lists_the_base_and_the_adapters(server):
    ids = [m.id for m in server["client"].models.list()]
    assert ids == [server["name"], "a", "b"]


def test_logprobs_and_echo(server):
    client = server["client"]
    out = client.completions.create(model="a", prompt="hello there", max_tokens=4, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == out.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and len(top) <= 2 and max(top.values()) >= chosen - 1e-6
    # greedy: the chosen token is the likeliest
    assert all(
        abs(max(t.values()) - c) < 1e-6
        for c, t in zip(lp.token_logprobs, lp.top_logprobs, strict=True)
    )

    echo = client.completions.create(model="a", prompt="hello there", max_tokens=0, echo=True,
                                     logprobs=1)  # fmt: skip
    e = echo.choices[0]
    assert e.text == "hello there" and e.logprobs.token_logprobs[0] is None
    assert all(x < 0 for x in e.logprobs.token_logprobs[1:])
    both = client.completions.create(model="a", prompt="hello there", max_tokens=4, echo=True,
                                     logprobs=1)  # fmt: skip
    assert both.choices[0].text == "hello there" + out.choices[0].text
    n = len(e.logprobs.tokens)
    assert both.choices[0].logprobs.token_logprobs[:n] == e.logprobs.token_logprobs
    np.testing.assert_allclose(
        both.choices[0].logprobs.token_logprobs[n:], lp.token_logprobs, atol=1e-5
    )

    chat = client.chat.completions.create(model="b", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=5, logprobs=True, top_logprobs=3)  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)


def test_a_seed_makes_sampled_text_reproducible(server):
    client = server["client"]

    def sampled(seed):
        out = client.completions.create(model="b", prompt="the cat", max_tokens=NEW,
                                        temperature=1.0, top_p=0.9, seed=seed)  # fmt: skip
        return out.choices[0].text

    assert sampled(5) == sampled(5)
    assert len({sampled(s) for s in range(4)}) > 1


def test_a_stop_string_cuts_the_text_and_ends_the_row(server):
    client = server["client"]
    full = (
        client.completions.create(model="a", prompt="the cat sat on", max_tokens=NEW)
        .choices[0]
        .text
    )
    stop = full[3:5]
    assert stop, full
    cut = client.completions.create(model="a", prompt="the cat sat on", max_tokens=NEW, stop=stop)
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="a", prompt="the cat sat on", max_tokens=NEW,
                                         stop=[stop], stream=True)  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_sixteen_clients_on_mixed_adapters_each_answer_as_alone(server):
    client = server["client"]
    asks = [(["base", "a", "b"][i % 3], PROMPTS[i % len(PROMPTS)] + " " * (i // 5), 8 + i % 5)
            for i in range(16)]  # fmt: skip

    def one(ask, stream=False):
        model, prompt, new = ask
        model = server["name"] if model == "base" else model
        if stream:
            chunks = client.completions.create(
                model=model, prompt=prompt, max_tokens=new, stream=True
            )
            return "".join(c.choices[0].text for c in chunks)
        return client.completions.create(model=model, prompt=prompt, max_tokens=new).choices[0].text

    alone = [one(a) for a in asks]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda i: one(asks[i], stream=i % 2 == 0), range(16)))
    assert together == alone


def test_a_client_leaving_mid_stream_frees_its_row(server):
    port = server["port"]
    body = json.dumps({"prompt": "hello", "max_tokens": 1500, "stream": True}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", body=body, headers={"Authorization": f"Bearer {KEY}"})
    sock = conn.sock
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")
    sock.shutdown(socket.SHUT_RDWR)  # the client goes away mid-stream
    sock.close()
    deadline = time.monotonic() + 120
    while True:  # the row leaves the batch long before its 1500 tokens
        status, health = raw(port, "GET", "/health")
        if health["running"] == 0:
            break
        assert time.monotonic() < deadline, health
        time.sleep(0.2)
    assert any("client left" in line for line in server["log"])

    # a client that leaves before its whole answer (not streamed) is ready
    body = json.dumps({"prompt": "hi", "max_tokens": 2040}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", body=body, headers={"Authorization": f"Bearer {KEY}"})
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.sock.close()
    while sum("client left" in line for line in server["log"]) < 2:
        assert time.monotonic() < deadline, server["log"][-5:]
        time.sleep(0.2)
    assert "2040 out" not in server["log"][-1]
    out = server["client"].completions.create(model="a", prompt="hi", max_tokens=3)
    assert out.choices[0].finish_reason in ("stop", "length")


def _malformed() -> list[tuple[str, str, bytes, dict]]:
    """(method, path, body, extra headers) of requests that must each be a 4xx."""
    out = []
    bad_values = {
        "max_tokens": ["5", 1.5, True, -1, -100, 10**9, [3]],
        "temperature": ["x", -1, 3, [0], {}],
        "top_p": [0, 2, "a", -0.5],
        "seed": ["s", 1.5, [1]],
        "stop": [5, [1], [""], ["x"] * 40, {"a": 1}],
        "stream": ["yes", 1],
        "n": [2, "1", 0, 1.5],
        "model": [5, "nope", ["a"]],
        "stream_options": ["x", 3],
        "tools": [[{"type": "function"}]],
        "response_format": [{"type": "json_object"}, "json"],
        "frequency_penalty": [0.5, "x"],
        "best_of": [2],
        "logit_bias": [{"5": 10}],
        "suffix": ["x"],
    }
    completion = {"logprobs": [-1, 50, "2", 1.5], "echo": [1, "true"],
                  "prompt": [5, [], [[]], [-1], [10**9], {"a": 1}, None, [1, "a"], True]}  # fmt: skip
    chat = {"top_logprobs": [-1, 50, "3"], "logprobs": ["yes", 2],
            "messages": [[], "x", [{"role": "x", "content": "a"}], [{"role": "user", "content": 5}],
                         [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                         [5], None, [{"role": "user"}]]}  # fmt: skip
    for path, base, own in (
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, completion),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, chat),
    ):
        for key, values in {**bad_values, **own}.items():
            for v in values:  # each alone, and in a streamed request
                out.append(("POST", path, json.dumps({**base, key: v}).encode(), {}))
                if key != "stream":
                    streamed = {**base, "stream": True, key: v}
                    out.append(("POST", path, json.dumps(streamed).encode(), {}))
        for body in (b"", b"{", b"nope", b"[1, 2]", b'"text"', b"null", b"\xff\xfe", b"{'a': 1}",
                     b'{"prompt": NaN}', b"[" * 100000 + b"]" * 100000, b'{"max_tokens": Infinity}',
                     json.dumps({}).encode(), b"a" * (2 << 20)):  # fmt: skip
            out.append(("POST", path, body, {}))
        out.append(("POST", path, json.dumps(base).encode(), {"Authorization": "Bearer wrong"}))
        out.append(("POST", path, json.dumps(base).encode(), {"Authorization": ""}))
        out.append(("GET", path, b"", {}))
        out.append(("POST", path, json.dumps({**base, "max_tokens": 2040,
                                              "prompt": [[3] * 100]}).encode(), {}))  # fmt: skip
    out.append(("POST", "/v1/completions", json.dumps({"prompt": [[3] * 2040]}).encode(), {}))
    out.append(("POST", "/v1/nothing", b"{}", {}))
    out.append(("DELETE", "/v1/models", b"", {}))
    out.append(("GET", "/v1/models", b"", {"Authorization": "Basic abc"}))
    return out


def test_two_hundred_malformed_requests_are_each_a_4xx_and_the_server_goes_on(server):
    port = server["port"]
    requests = _malformed()
    assert len(requests) >= 200
    for method, path, body, headers in requests:
        status, doc = raw(port, method, path, body, headers)
        assert 400 <= status < 500, (method, path, body[:80], status, doc)
        assert isinstance(doc, dict) and set(doc["error"]) == {"message", "type", "param", "code"}
        assert "Traceback" not in doc["error"]["message"]
    assert raw(port, "GET", "/health")[1]["status"] == "ok"
    assert server["proc"].poll() is None
    out = server["client"].completions.create(model="b", prompt="hi", max_tokens=2)
    assert out.choices[0].finish_reason in ("stop", "length")
    assert not any("Traceback" in line for line in server["log"])


def test_a_request_without_the_key_is_refused(server):
    port = server["port"]
    status, doc = raw(port, "GET", "/v1/models", headers={"Authorization": ""})
    assert status == 401 and doc["error"]["code"] == "invalid_api_key"
    wrong = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="a", prompt="hi", max_tokens=2)


@pytest.mark.parametrize(
    "args,says",
    [
        (["MODEL", "--host", "0.0.0.0"], "needs an API key"),
        (["MODEL", "--adapter", "a"], "give NAME=DIR"),
        (["MODEL", "--max-rows", "0"], "--max-rows must be at least 1"),
        ([], "no spill.yaml here"),
    ],
)
def test_refused_in_one_line_before_the_model_loads(setup, args, says, tmp_path):
    env = {k: v for k, v in setup["env"].items() if k != "SPILL_API_KEY"}
    args = [str(setup["model"]) if a == "MODEL" else a for a in args]
    proc = run_spill("serve", *args, base=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert says in line


def test_a_project_serves_its_model_and_its_built_adapters(tmp_path):
    """A project folder: its model by its name, each adapter under .spill/adapters/ by its
    folder's name, answering as ``spill run --adapter`` does; Ctrl-C (SIGINT) stops it, exit 0."""
    from spill.models.resolve import resolve_model

    root = tmp_path / "toy"
    shutil.copytree(TOY, root, ignore=shutil.ignore_patterns(".spill", "__pycache__"))
    name = "tiny:llama:2:2x64"  # the toy project's model
    assert f"name: {name}" in (root / "spill.yaml").read_text()
    folder = Path(resolve_model(name, None).folder)
    adapter = write_adapter(root / ".spill" / "adapters" / "toy", folder, 3)
    env = {**os.environ, **ENV}
    proc, port, lines = start([str(root), "--dtype", "float32"], env)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list()] == [name, "toy"]
        got = client.completions.create(model="toy", prompt="hello there", max_tokens=NEW)
        src, out = tmp_path / "rows.jsonl", tmp_path / "out.jsonl"
        src.write_text(json.dumps({"id": 0, "prompt": "hello there"}) + "\n")
        run = run_spill("run", name, str(src), "--out", str(out), "--max-new-tokens", str(NEW),
                        "--dtype", "float32", "--adapter", str(adapter), base=env, timeout=300)  # fmt: skip
        assert run.returncode == 0, run.stderr
        assert got.choices[0].text == json.loads(out.read_text())["output"]
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, "".join(lines)


def test_sigterm_finishes_or_cuts_the_running_rows_and_exits_0(server):
    """The last test of the module: it stops the module's server."""
    port = server["port"]
    body = json.dumps({"prompt": "hello", "max_tokens": 1900, "stream": True}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", body=body, headers={"Authorization": f"Bearer {KEY}"})
    resp = conn.getresponse()
    assert resp.readline().startswith(b"data: ")
    server["proc"].send_signal(signal.SIGTERM)
    rest = resp.read().decode()  # the row is cut after the grace (2 s here); the stream ends
    events = [json.loads(e[6:]) for e in rest.split("\n\n") if e.startswith("data: {")]
    assert rest.rstrip().endswith("data: [DONE]")
    assert events[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert server["proc"].wait(timeout=60) == 0
    assert any("SIGTERM" in line for line in server["log"])
