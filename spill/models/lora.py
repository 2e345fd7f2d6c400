"""LoRA adapters, engine-free: configuration, initial values, and export in common layouts.

spill names a parameter ``layers.<k>.<module>.lora_a`` (``[in, r]``) and ``lora_b``
(``[r, out]``), ``<module>`` being the HF path inside a decoder layer (``self_attn.q_proj``).
The initial adapter is drawn here in numpy from the seed, so every engine starts from the same
bytes: ``lora_a`` uniform in +-1/sqrt(in) (what PEFT's kaiming-uniform init gives) and
``lora_b`` zero, so the tuned model starts equal to the base. On a model with experts, gate,
up and down (``experts``) adapt every expert's linear (``layer_targets`` says which modules).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from spill.errors import SpillError
from spill.models import expert_adapters
from spill.models.config import FUSED, LINEARS, ModelConfig
from spill.models.family_keys import EXPERT_LINEARS


def _merged(*orders: tuple[str, ...]) -> tuple[str, ...]:
    """One order holding each of ``orders`` as a subsequence (a name before the next it knows)."""
    out: list[str] = []
    for order in orders:
        for k, m in enumerate(order):
            if m not in out:
                later = [n for n in order[k + 1 :] if n in out]
                out.insert(out.index(later[0]) if later else len(out), m)
    return tuple(out)


# every family's linears (q, k, v, qkv, o, gate, up, gate_up, down), by short name in MODULES
KNOWN = _merged(LINEARS, FUSED)
MODULES = {m.rsplit(".", 1)[1]: m for m in KNOWN}  # q_proj -> self_attn.q_proj, ...
ALL_LINEAR = tuple(m.rsplit(".", 1)[1] for m in LINEARS)  # "all" on the families of LINEARS
EXPERT_TARGETS = EXPERT_LINEARS  # an MoE model's per-expert targets


@dataclass(frozen=True)
class LoraConfig:
    """An adapter's shape. The defaults are the ``tune`` conf group's (``tests/unit/test_settings``
    keeps them equal); ``alpha=None`` is 2 x rank, the one place that rule lives."""

    rank: int = 8
    alpha: float | None = None  # None: 2 x rank
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q_proj", "v_proj")

    def __post_init__(self) -> None:
        if self.alpha is None:
            object.__setattr__(self, "alpha", 2.0 * self.rank)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def parse_targets(
        cls,
        text: str,
        linears: tuple[str, ...] = LINEARS,
        family: str | None = None,
        experts: bool = False,
    ) -> tuple[str, ...]:
        """Short names of ``linears`` (a model's, ``ModelConfig.linears``) that ``text`` names;
        ``all`` names every one; ``family`` is named in the refusal. ``experts`` (a model with
        routed experts, Qwen3-MoE) adds gate_proj, up_proj, down_proj (``experts`` the three):
        one adapter on every expert's linear in a sparse layer (mlx-lm's ``LoRASwitchLinear``,
        PEFT's ``target_parameters``), on the dense MLP's in a dense one; the router
        ``mlp.gate`` never. ``all`` stays ``linears`` (the attention there): PEFT's all-linear
        on transformers 5 reaches no expert (3-D parameters, not linears), and mlx-lm's default
        of every linear would take the router too."""
        mine = tuple(m.rsplit(".", 1)[1] for m in linears)
        names = tuple(t.strip() for t in text.split(",") if t.strip())
        if names in (("all",), ("all-linear",)):
            return mine
        choices = mine + tuple(t for t in EXPERT_TARGETS if experts and t not in mine)
        if experts:
            names = tuple(n for m in names for n in (EXPERT_TARGETS if m == "experts" else (m,)))
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            model = f" of a {family} model" if family else ""
            more = ", 'experts'" if experts else ""
            raise SpillError(
                f"unknown LoRA target(s){model} {unknown or text!r}; choose from "
                f"{', '.join(choices)}{more} or 'all'"
            )
        return tuple(n for n in choices if n in names)  # canonical order

    def to_dict(self) -> dict:
        d = asdict(self)
        d["targets"] = list(self.targets)
        return d


def module_shape(cfg: ModelConfig, target: str) -> tuple[int, int]:
    """(in, out) features of a target linear (``q_proj``) of the model's ``linears``."""
    shapes = cfg.linear_shapes()
    if MODULES.get(target) not in shapes:
        raise SpillError(
            f"LoRA target {target!r} is not a linear of a {cfg.family} model; its linears are "
            f"{', '.join(m.rsplit('.', 1)[1] for m in shapes)}"
        )
    return shapes[MODULES[target]]


def layer_targets(cfg: ModelConfig, lora: LoraConfig, layer: int) -> dict[str, tuple[int, int]]:
    """(in, out) of each module of layer ``layer`` an adapter is on, by target in
    ``lora.targets`` order: its linear (``self_attn.q_proj``), or every expert's
    (``mlp.experts.<e>.up_proj``, by expert) where the layer routes, its dense MLP's elsewhere."""
    if not cfg.experts:  # a dense family: one module a target (refused when not a linear)
        return {MODULES[t]: module_shape(cfg, t) for t in lora.targets}
    io = cfg.layer_linears(layer)
    out = {}
    for t in lora.targets:
        found = {m: s for m, s in io.items() if m.rsplit(".", 1)[1] == t}
        if not found:
            module_shape(cfg, t)  # raises, naming the linears
        out |= found
    return out


def param_names(cfg: ModelConfig, lora: LoraConfig) -> list[str]:
    return [
        f"layers.{k}.{m}.lora_{ab}"
        for k in range(cfg.num_hidden_layers)
        for m in layer_targets(cfg, lora, k)
        for ab in "ab"
    ]


def init_params(cfg: ModelConfig, lora: LoraConfig, seed: int) -> dict[str, np.ndarray]:
    """The initial adapter, float32, a pure function of (model shape, LoRA config, seed)."""
    key = int.from_bytes(hashlib.sha256(f"spill-lora:{seed}".encode()).digest()[:8], "little")
    rng = np.random.default_rng(key)
    out = {}
    for k in range(cfg.num_hidden_layers):
        for m, (fan_in, fan_out) in layer_targets(cfg, lora, k).items():
            bound = 1.0 / np.sqrt(fan_in)
            name = f"layers.{k}.{m}"
            out[f"{name}.lora_a"] = rng.uniform(-bound, bound, size=(fan_in, lora.rank)).astype(
                np.float32
            )
            out[f"{name}.lora_b"] = np.zeros((lora.rank, fan_out), dtype=np.float32)
    return out


def export_peft(
    params: dict[str, np.ndarray],
    lora: LoraConfig,
    base_model: str,
    out: Path,
    revision: str | None = None,
) -> Path:
    """PEFT layout: ``adapter_model.safetensors`` (``lora_A.weight`` is ``[r, in]``) + config;
    ``base_model``/``revision``: what ``AutoPeftModelForCausalLM`` loads the adapter onto. An
    MoE model's expert adapters go in PEFT's ``target_parameters`` form (``expert_adapters``);
    what that form cannot hold is refused in one line."""
    from safetensors.numpy import save_file

    if why := expert_adapters.peft_refusal(params):
        raise SpillError(f"no PEFT layout for this adapter: {why}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = expert_adapters.stack_peft(params)
    for name, value in params.items():
        if expert_adapters.EXPERT.match(name):
            continue
        stem, ab = name.rsplit(".", 1)
        key = "lora_A" if ab == "lora_a" else "lora_B"
        tensors[f"base_model.model.model.{stem}.{key}.weight"] = np.ascontiguousarray(value.T)
    save_file(
        dict(sorted(tensors.items())),
        str(out / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    fields = expert_adapters.peft_fields(params, lora.rank, lora.alpha)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        # PEFT's ParamWrapper (the experts) refuses any dropout; it is training's alone
        "lora_dropout": 0.0 if fields else lora.dropout,
        "target_modules": [t for t in lora.targets if not (t in EXPERT_TARGETS and fields)],
        **fields,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
        "init_lora_weights": True,
    }
    if revision:
        config["revision"] = revision
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def export_mlx(params: dict[str, np.ndarray], lora: LoraConfig, num_layers: int, out: Path) -> Path:
    """MLX-LM layout: ``adapters.safetensors`` (``lora_a`` ``[in, r]``) + ``adapter_config.json``;
    an MoE model's expert adapters stacked as ``LoRASwitchLinear``'s (``mlp.switch_mlp.*``)."""
    from safetensors.numpy import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plain = {n: v for n, v in params.items() if not expert_adapters.EXPERT.match(n)}
    tensors = {f"model.{name}": np.ascontiguousarray(v) for name, v in sorted(plain.items())}
    tensors |= expert_adapters.stack_mlx(params)
    save_file(dict(sorted(tensors.items())), str(out / "adapters.safetensors"))
    keys = [MODULES[t] for t in lora.targets]
    if len(plain) < len(params):  # experts: the dense layers' MLP where there is one
        held = {n.split(".", 2)[2].rsplit(".", 1)[0] for n in plain}
        keys = [m for m in keys if m in held]
        keys += [f"mlp.switch_mlp.{t}" for t in lora.targets if t in EXPERT_TARGETS]
    config = {
        "fine_tune_type": "lora",
        "num_layers": num_layers,
        "lora_parameters": {
            "rank": lora.rank,
            "scale": lora.scale,
            "dropout": lora.dropout,
            "keys": keys,
        },
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
