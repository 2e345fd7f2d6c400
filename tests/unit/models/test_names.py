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
    split_quant,
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
    "qwen3:0.6b": "Qwen/Qwen3-0.6B",
    "qwen3:1.7b": "Qwen/Qwen3-1.7B",
    "gemma3:270m": "google/gemma-3-270m-it",
    "gemma3:1b": "google/gemma-3-1b-it",
    "smollm3:3b": "HuggingFaceTB/SmolLM3-3B",
    "phi4-mini": "microsoft/Phi-4-mini-instruct",
}
# the commits the new families' aliases pin, each found in public code (names.py says where)
PINNED = {
    "qwen3:0.6b": "c1899de289a04d12100db370d81485cdf75e47ca",
    "qwen3:1.7b": "70d244cc86ccca08cf5af4e1e306ecf908b1ad5e",
    "gemma3:270m": "ac82b4e820549b854eebf28ce6dedaf9fdfa17b3",
    "gemma3:1b": "dcc83ea841ab6100d6b47a070329e1ba4cf78752",
    "smollm3:3b": "a07cc9a04f16550a088caea529712d1d335b0ac1",
    "phi4-mini": "cfbefacb99257ffa30c83adab238a50856ac3083",
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


def test_new_family_aliases_pin_their_commits_and_resolve_by_any_spelling():
    assert {n: ALIASES[n].revision for n in PINNED} == PINNED
    assert resolve_alias(" Phi4-Mini ") is ALIASES["phi4-mini"]
    assert alias_for_model_id("google/Gemma-3-270M-it") is ALIASES["gemma3:270m"]
    for name in ("phi4-mini", "PHI4-MINI", split_quant("phi4-mini@q4_1")[0]):
        assert looks_like_alias(name)  # a known alias needs no size after a colon
    assert not looks_like_alias("phi4-maxi") and not looks_like_alias("phi4-mini/x")


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
