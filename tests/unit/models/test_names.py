import re

import pytest

from spill.errors import ModelNotFound
from spill.models.names import (
    ALIASES,
    alias_for_model_id,
    looks_like_alias,
    looks_like_hub_id,
    lookup,
    resolve_alias,
    safe_name,
)

EXPECTED = {
    "qwen2.5:0.5b": "Qwen/Qwen2.5-0.5B-Instruct",
    "qwen2.5:1.5b": "Qwen/Qwen2.5-1.5B-Instruct",
    "qwen2.5:3b": "Qwen/Qwen2.5-3B-Instruct",
    "qwen2.5:7b": "Qwen/Qwen2.5-7B-Instruct",
    "qwen2.5:14b": "Qwen/Qwen2.5-14B-Instruct",
    "qwen2.5:32b": "Qwen/Qwen2.5-32B-Instruct",
    "qwen2.5:72b": "Qwen/Qwen2.5-72B-Instruct",
    "smollm2:135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "smollm2:360m": "HuggingFaceTB/SmolLM2-360M-Instruct",
    "smollm2:1.7b": "HuggingFaceTB/SmolLM2-1.7B-Instruct",
    "llama3.2:1b": "meta-llama/Llama-3.2-1B-Instruct",
    "llama3.2:3b": "meta-llama/Llama-3.2-3B-Instruct",
}


def test_alias_table_maps_every_alias_to_its_hub_id():
    assert {name: a.model_id for name, a in ALIASES.items()} == EXPECTED
    for name, alias in ALIASES.items():
        assert alias.name == name
        assert looks_like_alias(name) and looks_like_hub_id(alias.model_id)


def test_every_alias_pins_a_full_commit_and_shas_are_distinct():
    shas = [a.revision for a in ALIASES.values()]
    assert all(re.fullmatch(r"[0-9a-f]{40}", s) for s in shas)
    assert len(set(shas)) == len(shas)


def test_only_smollm2_135m_has_an_offline_source():
    assert {n for n, a in ALIASES.items() if a.offline} == {"smollm2:135m"}


def test_lookup_ignores_case_and_finds_the_alias_of_a_hub_id():
    assert lookup(" Qwen2.5:7B ") is ALIASES["qwen2.5:7b"]
    assert alias_for_model_id("qwen/qwen2.5-0.5b-instruct") is ALIASES["qwen2.5:0.5b"]
    assert alias_for_model_id("someone/else") is None


def test_unknown_alias_is_one_line_listing_the_known_ones():
    with pytest.raises(ModelNotFound) as e:
        resolve_alias("qwen2.5:9000b")
    msg = str(e.value)
    assert "\n" not in msg and "qwen2.5:9000b" in msg
    assert all(name in msg for name in ALIASES)


def test_shapes_of_names():
    assert looks_like_alias("smollm2:135m")
    assert not looks_like_alias("s3://bucket/model") and not looks_like_alias("C:\\models\\x")
    assert looks_like_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and looks_like_hub_id("a/b@v1.0")
    assert not looks_like_hub_id("a/b/c") and not looks_like_hub_id("/abs/path")


def test_safe_name():
    assert safe_name("smollm2:135m") == "smollm2-135m"
    assert safe_name("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen--Qwen2.5-0.5B-Instruct"
    assert safe_name("../..") == "model"
    assert "/" not in safe_name("a b/c:d")
