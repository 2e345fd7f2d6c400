"""The new families' aliases through the real CLI (issue 37): each resolves to its pinned hub
snapshot in the cache, ``spill models list`` then shows it by hub id and commit, and the
colon-less ``phi4-mini`` runs like any alias; offline, an alias that is not cached is one line."""

from __future__ import annotations

import json

from spill.models.names import ALIASES
from spill.models.sources.tiny import write_tiny
from tests.conftest import run_spill
from tests.unit.models.sources.test_hub import lay_out_snapshot
from tests.unit.models.test_family_aliases import FAMILY
from tests.unit.models.test_names import PINNED


def test_aliases_resolve_and_list_by_hub_id_and_commit(tmp_path, spill_home):
    for name in PINNED:
        alias = ALIASES[name]
        tiny = write_tiny(tmp_path / name, family=FAMILY[name], seed=1, layers=2, hidden=32)
        lay_out_snapshot(alias.model_id, PINNED[name], tiny)
    for name in sorted(PINNED):
        done = run_spill("models", "verify", name.upper())  # any case names the alias
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr
    listed = {m["name"]: m for m in json.loads(run_spill("models", "list", "--json").stdout)}
    want = {f"{ALIASES[n].model_id}@{PINNED[n][:12]}" for n in PINNED}
    assert set(listed) == want
    for name in PINNED:
        entry = listed[f"{ALIASES[name].model_id}@{PINNED[name][:12]}"]
        assert entry["source"] == "hub" and entry["error"] is None and entry["hashes"] > 0
        assert entry["folder"].endswith(f"/snapshots/{PINNED[name]}")
    table = run_spill("models", "list")
    assert table.returncode == 0 and "Qwen/Qwen3-0.6B@c1899de289a0" in table.stdout

    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "a", "prompt": "hello"}) + "\n")
    out = tmp_path / "out.jsonl"
    ran = run_spill("run", "phi4-mini", str(rows), "--out", str(out), "--max-new-tokens", "2")
    assert ran.returncode == 0, ran.stderr
    assert json.loads(out.read_text())["id"] == "a"


def test_an_alias_not_cached_is_one_line_offline(tmp_path, spill_home):
    models = spill_home / "models"
    before = sorted(p.relative_to(spill_home) for p in spill_home.rglob("*"))
    proc = run_spill("models", "verify", "gemma3:270m")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("spill: error: ") and "google/gemma-3-270m-it" in lines[0]
    assert "Traceback" not in proc.stderr
    assert not models.exists() or not any((models / "hub").glob("models--*"))
    assert sorted(p.relative_to(spill_home) for p in spill_home.rglob("*")) == before
