"""The new families' aliases (issue 37) resolve offline to their hub id at the pinned commit,
from snapshots laid out in the hub client's cache; never the network."""

import pytest

from spill.errors import ModelNotFound
from spill.models.config import load_config
from spill.models.names import ALIASES
from spill.models.resolve import ResolvedModel, resolve_model
from spill.models.sources.tiny import write_tiny
from tests.unit.models.sources.test_hub import SHA, lay_out_snapshot
from tests.unit.models.test_names import PINNED

FAMILY = {  # the model_type each alias's hub repo declares
    "qwen3:0.6b": "qwen3",
    "qwen3:1.7b": "qwen3",
    "gemma3:270m": "gemma3_text",
    "gemma3:1b": "gemma3_text",
    "smollm3:3b": "smollm3",
    "phi4-mini": "phi3",
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_alias_resolves_to_its_pinned_snapshot(name, tmp_path):
    alias = ALIASES[name]
    tiny = write_tiny(tmp_path / "tiny", family=FAMILY[name], seed=3, layers=2, hidden=32)
    snap = lay_out_snapshot(alias.model_id, PINNED[name], tiny)
    model = resolve_model(name, progress=pytest.fail)
    assert model == ResolvedModel(name, alias.model_id, PINNED[name], snap, "hub")
    assert load_config(model.folder).family == FAMILY[name]
    # the hub id alone reaches the same pinned commit
    assert resolve_model(alias.model_id, progress=pytest.fail).folder == snap


@pytest.mark.parametrize("name", ["gemma3:270m", "phi4-mini"])
def test_alias_never_uses_another_commit_of_its_repo(name, tmp_path):
    """``main`` of the cache pointing at another commit is not the alias: offline, it is refused
    in one line naming the hub id, and nothing is written beside the other snapshot."""
    alias = ALIASES[name]
    tiny = write_tiny(tmp_path / "tiny", family=FAMILY[name], seed=3, layers=2, hidden=32)
    other = lay_out_snapshot(alias.model_id, SHA, tiny)
    before = sorted(p.name for p in other.parent.iterdir())
    with pytest.raises(ModelNotFound) as e:
        resolve_model(name, progress=pytest.fail)
    msg = str(e.value)
    assert "\n" not in msg and alias.model_id in msg
    assert sorted(p.name for p in other.parent.iterdir()) == before
