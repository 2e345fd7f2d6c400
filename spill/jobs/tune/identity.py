"""What a tune checkpoint must share with the run that continues it, and the one-line refusal
naming the first difference: the base (its fingerprint, files and quantization), the seed, the
deciding hyperparameters, the LoRA configuration and the validation (``spill.jobs.tune.validation``).
"""

from __future__ import annotations

from pathlib import Path

from spill.errors import SpillError
from spill.jobs.tune.options import TuneOptions
from spill.jobs.tune.validation import identity as validation_identity
from spill.jobs.tune.validation import refuse as refuse_validation
from spill.models.integrity import explain, same_weights
from spill.settings import PREFERENCE


class CheckpointMismatch(SpillError):
    """A committed checkpoint that belongs to another run."""


# what identity pins of the tune group: every setting that decides the result (a test checks)
IDENTITY = ("lr", "warmup", "steps", "batch", "micro_batch", "seq_len", "weight_decay")
IDENTITY_LORA = ("rank", "alpha", "dropout", "targets")
IDENTITY_PREFERENCE = PREFERENCE  # pinned only by a preference tune: an SFT checkpoint has neither


def identity(
    model: str, fingerprint: str, data: str, opts: TuneOptions, quantization: dict | None = None
) -> dict:
    """The values a checkpoint must share to be continued (``stop_after``/``ckpt_every`` not);
    A preference tune pins its method and beta too. ``quantization``: a quantized base's (``spill.models.sources.quantize.identity``; a float base has
    none, as every checkpoint made before quantized bases existed). The validation settings
    (``spill.settings.VALIDATION``) are pinned as ``validation`` when the run has a validation
    file, absent otherwise (as in every checkpoint made before validation)."""
    t = opts.tune
    base = {"id": model, "fingerprint": fingerprint}
    checks = validation_identity(opts.valid, t.eval_every, t.keep_best)
    return ({"validation": checks} if checks else {}) | {
        "model": base | ({"quantization": quantization} if quantization else {}),
        "seed": opts.seed,
        "adapter": opts.lora.to_dict(),
        "hyperparameters": {
            "data": data,
            "schedule": "cosine",
            **{k: getattr(t, k) for k in IDENTITY},
            **({k: getattr(t, k) for k in IDENTITY_PREFERENCE} if t.method != "sft" else {}),
        },
    }


_LABELS = {"data": "training file", "steps": "total steps (--steps)", "lr": "learning rate"}


def _refuse_model(found: dict, want: dict, where: str, folder: Path) -> None:
    """Other weights than the run started with (``folder``: this run's). Another model: both
    fingerprints and names. The same model whose files changed: the first changed file where
    both recorded per-file sha256, else the fingerprints; never "use the same settings" (the
    settings did not change)."""
    fresh = "or start fresh with another --state (or --name)"
    changed = explain(found.get("files"), want.get("files"))
    if not changed and same_weights(
        found["fingerprint"], folder, want["fingerprint"], where, "its next checkpoint"
    ):
        return
    if found.get("quantization") != want.get("quantization"):
        theirs = found.get("quantization")
        same = f"--quantize {theirs['bits']} --group-size {theirs['group_size']}" if theirs else ""
        raise CheckpointMismatch(
            f"{where} was made on {_base(found)}, this run has {_base(want)}; continue it on "
            f"that base ({same or 'the float weights, without --quantize'}), {fresh}"
        )
    if found["id"] != want["id"] and found["fingerprint"] != want["fingerprint"]:
        raise CheckpointMismatch(
            f"{where} was made with weights (fingerprint) {found['fingerprint']!r}, this run has "
            f"{want['fingerprint']!r}; it used model {found['id']}, this run {want['id']}: use that "
            f"model to continue it, {fresh}"
        )
    if changed:
        raise CheckpointMismatch(f"{where}: {changed}; restore it, {fresh}")
    raise CheckpointMismatch(
        f"{where}: the files of model {want['id']} changed since this run started (fingerprint "
        f"{found['fingerprint'][7:19]}.. -> {want['fingerprint'][7:19]}..); restore them, {fresh}"
    )


def _base(model: dict) -> str:
    """A base as a refusal names it: ``tiny:llama:1:4x64@q4g64 (4-bit affine g64)``."""
    q = model.get("quantization")
    return f"{model['id']} ({q['format'] if q else 'float weights'})"


def refuse_mismatch(found: dict, want: dict, where: str, folder: Path) -> None:
    """One line naming the first difference between a checkpoint and this run, with both values;
    ``folder``: this run's model."""
    _refuse_model(found["model"], want["model"], where, folder)
    checks = [("seed", found["seed"], want["seed"])]
    method = (
        found["hyperparameters"].get("method", "sft"),
        want["hyperparameters"].get("method", "sft"),
    )
    if method[0] != method[1]:
        raise CheckpointMismatch(
            f"{where} is a {method[0].upper()} run, this one {method[1].upper()} (--method); "
            "continue it with the same method, or another --state (or --name) to start fresh"
        )
    for key, value in want["hyperparameters"].items():
        checks.append(
            (_LABELS.get(key, key.replace("_", " ")), found["hyperparameters"].get(key), value)
        )
    for key, value in want["adapter"].items():
        checks.append((f"LoRA {key}", found["adapter"].get(key), value))
    for label, theirs, ours in checks:
        if theirs != ours:
            raise CheckpointMismatch(
                f"{where} was made with {label} {theirs!r}, this run has {ours!r}; use the same "
                "settings to continue it, or another --state (or --name) to start fresh"
            )
    refuse_validation(found.get("validation"), want.get("validation"), where, CheckpointMismatch)
