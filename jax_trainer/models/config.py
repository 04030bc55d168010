"""Decoder hyper-parameters, read from a Hugging Face `config.json`.

One dataclass describes the three supported families:

- `qwen2`: q/k/v projections carry a bias; head_dim = hidden / heads.
- `qwen3`: no bias, RMSNorm on q and k per head, explicit `head_dim`.
- `llama`: optional `attention_bias` / `mlp_bias`, RoPE scaling `linear` or `llama3`.

transformers >= 5 writes RoPE settings as `rope_parameters`; older checkpoints (and most on the hub) have
`rope_theta` + `rope_scaling`. Both are read. Anything the JAX model cannot reproduce exactly (sliding-window
attention, other RoPE types) is refused with an error that lists what is supported, rather than silently
computing something else.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint asks for an architecture feature this decoder does not implement."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings. `factor` and the llama3 fields are unused for `default`."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything the decoder needs; `from_hf` builds it from a Hugging Face config dict."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 32768
    attention: str = "auto"  # the attention kernel (`jax_trainer.attention.IMPLEMENTATIONS`); not from HF
    initializer_range: float = 0.02  # std of every random weight of a fresh model (HF's `_init_weights`)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_kv_heads})"
            )

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Translate a Hugging Face config dict (qwen2, qwen3 or llama)."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if hf.get("use_sliding_window"):
            raise UnsupportedModelError(
                f"{model_type}: use_sliding_window=true is not supported (only full causal attention is)"
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"{model_type}: hidden_act {act!r} is not supported; supported: silu")
        hidden = int(hf["hidden_size"])
        heads = int(hf["num_attention_heads"])
        head_dim = hf.get("head_dim") or hidden // heads
        if model_type == "qwen2":
            qkv_bias, o_bias, mlp_bias, qk_norm = True, False, False, False
        elif model_type == "qwen3":
            bias = bool(hf.get("attention_bias", False))
            qkv_bias, o_bias, mlp_bias, qk_norm = bias, bias, False, True
        else:
            bias = bool(hf.get("attention_bias", False))
            qkv_bias, o_bias, mlp_bias, qk_norm = bias, bias, bool(hf.get("mlp_bias", False)), False
        return cls(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=_rope_from_hf(hf, model_type),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            qk_norm=qk_norm,
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            initializer_range=float(hf.get("initializer_range", 0.02)),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        try:
            hf = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no config.json; is {model_dir} a Hugging Face model directory?") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from e
        return cls.from_hf(hf)


def _rope_from_hf(hf: dict[str, Any], model_type: str) -> RopeConfig:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{model_type}: rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if "factor" not in merged:
        raise UnsupportedModelError(f"{model_type}: rope type {rope_type!r} needs a 'factor'")
    if rope_type == "linear":
        return RopeConfig(theta=theta, type="linear", factor=float(merged["factor"]))
    return RopeConfig(
        theta=theta,
        type="llama3",
        factor=float(merged["factor"]),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
    )
