"""``tune:``, the LoRA training of the student; ``spill tune`` takes each setting as a flag."""

from __future__ import annotations

from dataclasses import dataclass

from spill.settings.field import setting

ACTIVATIONS = ("auto", "keep", "recompute")
TRACKERS = ("tensorboard", "mlflow")  # spill.jobs.track's kinds
_LOG = {  # tune.log: a list in spill.yaml
    "type": "array",
    "items": {"enum": list(TRACKERS)},
    "uniqueItems": True,
    "description": "trackers the run logs to: tensorboard (event files under the project), "
    "mlflow (MLFLOW_TRACKING_URI); docs/watching.md",
}
_TARGETS = "((q|k|v|qkv|o|gate|up|gate_up|down)_proj|experts)"
VALIDATION = ("valid", "eval_every", "keep_best")  # inputs of a stage only when valid is set
METHODS = ("sft", "dpo", "orpo")  # spill.jobs.tune.objectives
PREFERENCE = ("method", "beta")  # inputs of a stage only when method is not sft
LR_MAX = 1e37  # AdamW's first step is lr / (1 - beta1) = 10 x lr; float32 ends at 3.4e38


@dataclass(frozen=True)
class TuneSettings:
    """``tune:``, the LoRA training of the student; ``spill tune`` takes each as a flag."""

    steps: int = setting(
        {"type": "integer", "minimum": 1}, "total optimizer steps (default %(default)s)"
    )
    lr: float = setting(  # past LR_MAX AdamW's first step overflows float32 (a traceback)
        {"type": "number", "exclusiveMinimum": 0, "maximum": LR_MAX},
        "peak learning rate (default %(default)s)",
    )
    warmup: int = setting({"type": "integer", "minimum": 0}, "warmup steps before the cosine decay")
    weight_decay: float = setting({"type": "number", "minimum": 0})
    rank: int = setting({"type": "integer", "minimum": 1}, "LoRA rank (default %(default)s)")
    alpha: float | None = setting(  # None: 2 x rank (``LoraConfig``)
        {"type": ["number", "null"], "exclusiveMinimum": 0, "description": "null: 2 x rank"},
        "LoRA alpha (default: 2 x rank)",
    )
    dropout: float = setting(
        {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
        "LoRA dropout (default %(default)s)",
    )
    targets: str = setting(  # comma-separated modules, or "all"
        {
            "type": "string",
            "pattern": f"^(all|all-linear|({_TARGETS})(\\s*,\\s*{_TARGETS})*)$",
            "description": "comma-separated q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
            "down_proj (Phi-3: qkv_proj, o_proj, gate_up_proj, down_proj; an MoE model: experts, "
            "its experts' gate_proj, up_proj, down_proj), or all",
        },
        "modules to adapt, comma-separated, or 'all'; on an MoE model 'experts' (gate_proj, "
        "up_proj, down_proj of every expert) (default %(default)s)",
    )
    batch: int = setting(
        {"type": "integer", "minimum": 1}, "samples per optimizer step (default %(default)s)"
    )
    micro_batch: int = setting(  # batch // micro_batch micro-batches are accumulated
        {"type": "integer", "minimum": 1},
        "samples per forward pass; --batch must be a multiple (default %(default)s)",
    )
    seq_len: int = setting(
        {"type": "integer", "minimum": 2},
        "tokens per sample, longer rows are cut (default %(default)s)",
    )
    ckpt_every: int = setting(
        {"type": "integer", "minimum": 1},
        "steps between checkpoints (default %(default)s)",
        decides=False,
    )
    activations: str = setting(
        {
            "enum": list(ACTIVATIONS),
            "description": "keep a step's activations (no recompute) or recompute them in "
            "backward; auto: kept when the layers are resident and they fit the memory budget. "
            "The result is the same bits either way",
        },
        "keep a step's activations or recompute them in backward; auto keeps them when they "
        "fit the memory budget; the same result either way (default %(default)s)",
        decides=False,
    )
    valid: float | None = setting(  # the file itself: ``spill tune --valid FILE``
        {
            "type": ["number", "null"],
            "exclusiveMinimum": 0,
            "description": "validation rows carved off the training split (never the test "
            "rows): a count (1 or more) or a fraction (below 1); null: no validation",
        },
        flag=False,
    )
    eval_every: int = setting(
        {"type": "integer", "minimum": 1},
        "steps between validation losses, and the last step (default %(default)s)",
    )
    keep_best: bool = setting(
        {"type": "boolean"},
        "export the checkpoint with the lowest validation loss, not the last (needs validation)",
    )
    method: str = setting(
        {
            "enum": list(METHODS),
            "description": "sft: supervised on prompt/completion rows; dpo or orpo: preference "
            "tuning on prompt/chosen/rejected rows (docs/preference.md)",
        },
        "sft, or dpo/orpo on prompt/chosen/rejected rows (default %(default)s)",
    )
    beta: float = setting(
        {
            "type": "number",
            "exclusiveMinimum": 0,
            "description": "DPO's beta (how far from the base the adapter may go), or ORPO's "
            "weight of the odds-ratio term (TRL's beta for both)",
        },
        "DPO's beta, or ORPO's odds-ratio weight (default %(default)s)",
    )

    log: tuple[str, ...] = setting(_LOG, decides=False, flag=False)  # the verbs: --log a,b

    def __post_init__(self) -> None:
        object.__setattr__(self, "log", tuple(self.log))  # frozen and hashable from a YAML list

    def problem(self, name=lambda key: key) -> str:
        """What makes these settings unusable together (``""``: nothing), each setting called
        ``name(key)`` (``tune.batch``, ``--batch``): the one check of what a schema cannot say."""
        if self.micro_batch >= 1 and self.batch % self.micro_batch:
            return (
                f"{name('batch')} {self.batch} must be a multiple of {name('micro_batch')} "
                f"{self.micro_batch}"
            )
        if not 0 < self.lr <= LR_MAX:  # NaN too, which a schema's bounds let through
            return (
                f"{name('lr')} {self.lr:g}: a learning rate is a number above 0 and at most "
                f"{LR_MAX:g} (AdamW's steps overflow past it); tunes use about 1e-5 to 1e-2"
            )
        if self.valid is not None and self.valid >= 1 and self.valid != int(self.valid):
            return (
                f"{name('valid')} {self.valid}: a row count is a whole number (a fraction is "
                "below 1)"
            )
        return ""
