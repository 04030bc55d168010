"""LoRA adapters on the decoder's projections: y = x W + (alpha / rank) * ((x A) B), with W frozen.

`LoraSpec(rank, alpha, targets)` names the adapted projections as users know them: q, k, v, o (attention),
gate, up, down (MLP). Each adapted projection of every layer holds `A` [in..., rank] and `B` [rank, out...] in
the model's layout (heads split out, like the kernels: `q`'s B is [rank, heads, head_dim]) as `nnx.LoRAParam`s,
stacked over the layer axis like every other layer parameter. A fresh adapter has A ~ normal(0, 1/sqrt(3 fan_in))
(the variance of PEFT's default Kaiming-uniform A) and B = 0, so it leaves the model's outputs unchanged.

The adapter in Hugging Face PEFT's layout (`peft_specs`): `base_model.model.model.layers.{i}.self_attn.q_proj.
lora_A.weight` [rank, in] and `...lora_B.weight` [out, rank], with PEFT's flat head order.

The merge of an adapter into its base is `bridge.adapters.merge_weight` (docs/design.md section 4), the one
function the learner's merged export, workers and validators all use.
"""

from __future__ import annotations

import dataclasses
import math

from bridge.adapters import PEFT_PREFIX
from bridge.weights import TensorSpec
from jax_trainer.config import LORA_TARGETS
from jax_trainer.models.config import ModelConfig

# user-facing name -> (the decoder's module, its kernel, the HF module under `model.layers.{i}`)
TARGETS: dict[str, tuple[str, str, str]] = {
    "q": ("attn", "q_proj", "self_attn.q_proj"),
    "k": ("attn", "k_proj", "self_attn.k_proj"),
    "v": ("attn", "v_proj", "self_attn.v_proj"),
    "o": ("attn", "o_proj", "self_attn.o_proj"),
    "gate": ("mlp", "gate_proj", "mlp.gate_proj"),
    "up": ("mlp", "up_proj", "mlp.up_proj"),
    "down": ("mlp", "down_proj", "mlp.down_proj"),
}
assert tuple(TARGETS) == LORA_TARGETS


class LoraError(ValueError):
    """A LoRA setting the model cannot hold (unknown target, rank too large ...); the message names it."""


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    targets: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise LoraError(f"model.lora.rank must be >= 1, got {self.rank}")
        if not self.alpha > 0:
            raise LoraError(f"model.lora.alpha must be > 0, got {self.alpha}")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets:
            raise LoraError(
                f"model.lora.targets {list(self.targets)}: {unknown or 'empty'}; this model's projections are "
                f"{', '.join(TARGETS)}"
            )
        if len(set(self.targets)) != len(self.targets):
            raise LoraError(f"model.lora.targets {list(self.targets)} names a projection twice")
        # the canonical order, so that equal settings give equal adapters and configs
        object.__setattr__(self, "targets", tuple(t for t in TARGETS if t in self.targets))


Shape = tuple[int, ...]
Axes = tuple[str, ...]


def target_shape(cfg: ModelConfig, target: str) -> tuple[Shape, Axes, Shape, Axes]:
    """(in shape, in logical axes, out shape, out logical axes) of a projection in the model's layout."""
    h, n, kv, d, m = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    return {
        "q": ((h,), ("embed",), (n, d), ("heads", "head_dim")),
        "k": ((h,), ("embed",), (kv, d), ("kv_heads", "head_dim")),
        "v": ((h,), ("embed",), (kv, d), ("kv_heads", "head_dim")),
        "o": ((n, d), ("heads", "head_dim"), (h,), ("embed",)),
        "gate": ((h,), ("embed",), (m,), ("mlp",)),
        "up": ((h,), ("embed",), (m,), ("mlp",)),
        "down": ((m,), ("mlp",), (h,), ("embed",)),
    }[target]


def check_lora(spec: LoraSpec, cfg: ModelConfig) -> None:
    """Refuse a rank no adapted projection of `cfg` can hold (larger than its input or output width)."""
    for t in spec.targets:
        ins, _, outs, _ = target_shape(cfg, t)
        width = min(math.prod(ins), math.prod(outs))
        if spec.rank > width:
            raise LoraError(
                f"model.lora.rank {spec.rank} is larger than the {t} projection's {math.prod(ins)} x "
                f"{math.prod(outs)} ({cfg.model_type}, hidden {cfg.hidden_size}); use a rank <= {width}"
            )


def param_names(target: str) -> tuple[str, str]:
    """The attribute names of a target's A and B on its module (`q_lora_a`, `q_lora_b`)."""
    return f"{target}_lora_a", f"{target}_lora_b"


def param_paths(target: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    module = TARGETS[target][0]
    a, b = param_names(target)
    return ("layers", module, a), ("layers", module, b)


def peft_specs(cfg: ModelConfig, spec: LoraSpec) -> list[TensorSpec]:
    """Every adapter tensor under its PEFT name, layer by layer (the adapter file's order)."""
    out = []
    r = spec.rank
    for i in range(cfg.num_layers):
        for t in spec.targets:
            ins, _, outs, _ = target_shape(cfg, t)
            hf = f"{PEFT_PREFIX}model.layers.{i}.{TARGETS[t][2]}"
            path_a, path_b = param_paths(t)
            fan_in, fan_out = math.prod(ins), math.prod(outs)
            # A: HF [rank, in] -> split [rank, *in] -> ours [*in, rank]
            perm_a = tuple(range(1, len(ins) + 1)) + (0,)
            out.append(TensorSpec.linear(path_a, f"{hf}.lora_A.weight", (r, fan_in), (r, *ins), perm_a, layer=i))
            # B: HF [out, rank] -> split [*out, rank] -> ours [rank, *out]
            perm_b = (len(outs),) + tuple(range(len(outs)))
            out.append(TensorSpec.linear(path_b, f"{hf}.lora_B.weight", (fan_out, r), (*outs, r), perm_b, layer=i))
    return out


def peft_config(spec: LoraSpec, base_model: str = "") -> dict:
    """`adapter_config.json` for PEFT and vLLM: plain LoRA (no dropout, bias, rsLoRA or DoRA)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "target_modules": sorted(TARGETS[t][2].split(".")[-1] for t in spec.targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }


def spec_from_peft_config(config: dict, where: str = "adapter_config.json") -> LoraSpec:
    """The `LoraSpec` of a PEFT `adapter_config.json`; anything this decoder's LoRA does not compute is refused."""
    from bridge.adapters import lora_scaling

    try:
        lora_scaling(config, where)
    except ValueError as e:
        raise LoraError(str(e)) from e
    modules = config.get("target_modules")
    by_module = {v[2].split(".")[-1]: k for k, v in TARGETS.items()}
    if not isinstance(modules, list) or any(m not in by_module for m in modules):
        raise LoraError(f"{where}: target_modules {modules!r} must be a list of {', '.join(by_module)}")
    return LoraSpec(int(config["r"]), float(config["lora_alpha"]), tuple(by_module[m] for m in modules))
