"""``spill models quantize`` through the real CLI, and a verb run on the copy by its name."""

from __future__ import annotations

import json
import re

from tests.conftest import run_spill


def test_quantize_then_run_by_name(tmp_path, spill_home):
    done = run_spill("models", "quantize", "tiny:llama:1", "--bits", "4", "--group-size", "32")
    assert done.returncode == 0, done.stderr
    folder = done.stdout.strip().splitlines()[-1]
    assert folder.endswith("quantized/tiny-llama-1-4x64-q4g32")
    listed = {m["name"]: m for m in json.loads(run_spill("models", "list", "--json").stdout)}
    assert listed["tiny:llama:1:4x64@q4g32"]["hashes"] == 5
    assert listed["tiny:llama:1:4x64@q4g32"]["bytes"] < listed["tiny:llama:1:4x64"]["bytes"]
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "a", "prompt": "hello"}) + "\n")
    out = tmp_path / "out.jsonl"
    ran = run_spill(
        "run", "tiny:llama:1@q4g32", str(rows), "--out", str(out), "--max-new-tokens", "4"
    )
    assert ran.returncode == 0, ran.stderr
    # the float form fits: dequantized once at load into the measured numerics
    assert re.search(
        r"· resident · weights 4-bit affine g32, dequantized to \w+ at load\n", ran.stderr
    )
    assert json.loads(out.read_text())["id"] == "a"
    missing = run_spill("run", "tiny:llama:1@q8g64", str(rows), "--out", str(out))
    assert missing.returncode != 0
    assert "spill models quantize tiny:llama:1 --bits 8 --group-size 64" in missing.stderr
    bad = run_spill("models", "quantize", "tiny:llama:1", "--bits", "3")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
