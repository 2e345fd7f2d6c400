"""Sentencepiece vocabularies both ways: a ``tokenizer.json`` converted from sentencepiece (BPE with
``byte_fallback``, ``<0x00>``..``<0xFF>``, spaces as "▁"; Gemma, Llama 2, Mistral v0.x, Phi-3) as
llama.cpp's ``llama`` vocabulary (``add_vocabulary``: tokens, scores from the merge ranks, types,
the merges too), and such a GGUF vocabulary back as that BPE (``tokenizer``), its merges derived
from the vocabulary where the file has none (``merges_from_vocabulary``, the hub's files).
"""

from __future__ import annotations

from spill.errors import ModelError, UnsupportedModel

SPACE = "\u2581"  # sentencepiece's "▁"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # llama.cpp token types
BYTES = [f"<0x{b:02X}>" for b in range(256)]


def _replaces_spaces(step: dict) -> bool:
    pattern = step.get("pattern") or {}
    return (
        step.get("type") == "Replace" and pattern.get("String") == " " and step["content"] == SPACE
    )


def space_prefix(tok: dict, where) -> bool:
    """Whether the tokenizer puts "▁" before the text (llama.cpp's ``add_space_prefix``): a
    ``Prepend`` normalizer (Llama 2) or a non-splitting ``Metaspace`` that prepends; refused in
    one line where spaces do not become "▁" as sentencepiece's do, or byte tokens are missing."""
    model = tok.get("model") or {}
    missing = [b for b in BYTES if b not in model.get("vocab", {})]
    if missing:
        raise UnsupportedModel(
            f"{where}: a byte-fallback BPE without the byte token {missing[0]} (of {len(missing)} "
            "missing), which llama.cpp needs; export --format hf"
        )
    norm, pre = tok.get("normalizer") or {}, tok.get("pre_tokenizer") or {}
    steps = (
        norm.get("normalizers", []) if norm.get("type") == "Sequence" else [norm] if norm else []
    )
    kinds = [s.get("type") for s in steps]
    no_split = not pre or (
        pre.get("type") == "Split" and (pre.get("pattern") or {}).get("String") == " "
    )
    if no_split and kinds == ["Replace"] and _replaces_spaces(steps[0]):
        return False  # Gemma's (a Split on " " finds none once they are "▁")
    if no_split and kinds == ["Prepend", "Replace"] and _replaces_spaces(steps[1]):
        if steps[0].get("prepend") == SPACE:
            return True  # Llama 2's
    meta = pre.get("type") == "Metaspace" and pre.get("replacement") == SPACE
    if not steps and meta and not pre.get("split", True):
        return pre.get("prepend_scheme", "always") != "never"
    shown = "+".join(map(str, kinds or ["none"])) + f", pre-tokenizer {pre.get('type')}"
    raise UnsupportedModel(
        f"{where}: a byte-fallback BPE whose normalizer ({shown}) does not write spaces as "
        "sentencepiece's \u2581 (Gemma's Replace, Llama 2's Prepend + Replace, or a Metaspace that "
        "does not split), so llama.cpp would tokenize it otherwise; export --format hf"
    )


# llama.cpp's SPM tokenizer cuts the text into characters and keeps merging the adjacent pair whose
# joined text is a token with the highest score (the leftmost on a tie); the split that joined it is
# not looked at. So a token scores minus the rank of its first merge in ``tokenizer.json``, and
# llama.cpp merges in the BPE's order wherever every split of a token into two tokens is a merge
# (what converting from sentencepiece gives). A token no merge makes scores below every merge: the
# BPE never forms it, llama.cpp only once nothing else joins. gguf-py's ``LlamaHfVocab`` writes
# -1000 for every token, and llama.cpp then merges by position (about half of the test's 300 word
# strings came out otherwise). The merges are written too: llama.cpp ignores them, transformers'
# GGUF loader and spill's importer read them.
def add_vocabulary(
    writer, tok: dict, tokens: list[str], types: list[int], where
) -> tuple[list[str], list[int]]:
    """Write what llama.cpp's ``llama`` vocabulary holds beside its tokens and their types, and
    return those two for ``tokens`` (model vocabulary, added tokens, fillers; ``types`` says which
    are control, user-defined and unused): byte and unknown tokens typed, user-defined ones with
    real spaces (llama.cpp matches them in the text before it writes "▁", as its converter
    "pre-normalizes" them); scores from the merge ranks, the merges, ``add_space_prefix``."""
    model = tok["model"]
    unk = model.get("unk_token")
    byte, types = set(BYTES), list(types)
    for i, t in enumerate(tokens):
        if types[i] == NORMAL and t in byte:
            types[i] = BYTE
        elif types[i] == NORMAL and t == unk:
            types[i] = UNKNOWN
    pairs = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    # kept where the importers spell every token back: a user-defined run of "▁" (as spaces
    # here) is respelled, another with "▁" in it is not (its merges never run: it is cut out first)
    lost = {t for t, k in zip(tokens, types, strict=True) if k == USER_DEFINED and _respelled(t)}
    pairs = [(a, b) for a, b in pairs if not {a, b, a + b} & lost]
    first: dict[str, float] = {}
    for rank, (a, b) in enumerate(pairs):
        first.setdefault(a + b, -float(rank))
    floor = -float(len(pairs))
    scores = [
        first.get(t, floor) if k == NORMAL else floor for t, k in zip(tokens, types, strict=True)
    ]
    written = [
        t.replace(SPACE, " ") if k == USER_DEFINED else t
        for t, k in zip(tokens, types, strict=True)
    ]
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_scores(scores)
    if pairs and not any(" " in a or " " in b for a, b in pairs):  # "a b" cannot hold a space
        writer.add_token_merges([f"{a} {b}" for a, b in pairs])
    writer.add_add_space_prefix(space_prefix(tok, where))
    if unk in model["vocab"]:
        writer.add_unk_token_id(model["vocab"][unk])
    return written, types


def _respelled(token: str) -> bool:
    """Whether a user-defined token written with spaces for "▁" does not read back as it was."""
    return SPACE in token and set(token) != {SPACE}


# As transformers' GGUF loader derives them: Gemma's scores do not follow its merge order, its file
# order does.
def merges_from_vocabulary(
    meta: dict, tokens: list[str], types: list[int]
) -> list[tuple[str, str]]:
    """The merges a ``llama`` GGUF without them implies: every split of a normal token into two
    normal tokens, best token first (file position for Gemma, score otherwise), as transformers'
    GGUF loader derives them."""
    normal = {t: i for i, t in enumerate(tokens) if types[i] == NORMAL}
    scores = meta.get("tokenizer.ggml.scores")
    gemma = str(meta.get("general.architecture", "")).startswith("gemma")
    if gemma or not isinstance(scores, list) or len(scores) != len(tokens):
        order = sorted(normal.values())
    else:
        order = sorted(normal.values(), key=lambda i: (-scores[i], i))
    merges = []
    for i in order:
        t = tokens[i]
        splits = [(t[:k], t[k:]) for k in range(1, len(t)) if t[:k] in normal and t[k:] in normal]
        merges += sorted(splits, key=lambda s: (normal[s[0]], normal[s[1]]))
    return merges


def tokenizer(meta: dict, tokens: list[str], merges: list[tuple[str, str]], types: list[int]):
    """sentencepiece's BPE with byte fallback for a ``llama`` GGUF vocabulary: its merges or
    ``merges_from_vocabulary``; spaces as "▁" with "▁" before the text where
    ``add_space_prefix`` says (llama.cpp's default: yes). A user-defined run of spaces (llama.cpp's
    converter writes "▁" so) is "▁" again, added where spaces are "▁"; ``(tokenizer, tokens,
    types)``, those tokens typed normal (added already)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    missing = sorted(set(BYTES) - set(tokens))
    if missing:
        raise UnsupportedModel(
            f"a sentencepiece vocabulary without byte fallback (no {missing[0]}, {len(missing)} "
            "byte tokens missing) is not supported; use the HF model"
        )
    runs = {i for i, t in enumerate(tokens) if types[i] == USER_DEFINED and t and not t.strip(" ")}
    tokens = [SPACE * len(t) if i in runs else t for i, t in enumerate(tokens)]
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise UnsupportedModel(
            "the GGUF vocabulary holds a run of spaces both as spaces and as \u2581; spill "
            "cannot rebuild its tokenizer"
        )
    if "tokenizer.ggml.merges" not in meta:
        merges = merges_from_vocabulary(meta, tokens, types)
    types = [NORMAL if i in runs else k for i, k in enumerate(types)]
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None
    try:
        bpe = models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    except Exception as e:  # tokenizers raises a bare Exception (a merge of unknown tokens)
        raise ModelError(
            f"the GGUF vocabulary cannot be rebuilt ({e}); re-convert the model"
        ) from None
    tok = Tokenizer(bpe)
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True) is not False
    spaces = normalizers.Replace(" ", SPACE)
    tok.normalizer = (
        normalizers.Sequence([normalizers.Prepend(SPACE), spaces]) if prefix else spaces
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    tok.add_tokens([AddedToken(tokens[i], normalized=True) for i in sorted(runs)])
    return tok, tokens, types
