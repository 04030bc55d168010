"""Building blocks of the decoder: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP.

Every parameter is an `nnx.Param` with `axes` metadata (logical axis names, see `jax_trainer/sharding.py`).
Kernels are stored [in, out] with heads split out (`q`: [embed, heads, head_dim]), so that the logical names
say exactly which dimension a mesh axis splits. Numerics follow the Hugging Face implementations: norms and
softmax in float32, RoPE tables in float32 then cast to the compute dtype, matmuls accumulate in float32.
With a `LoraSpec`, the adapted projections also hold LoRA adapters (`jax_trainer.models.lora`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jax_trainer import kernels
from jax_trainer.attention import attention, check_name
from jax_trainer.models import lora as lora_lib
from jax_trainer.models.config import ModelConfig, RopeConfig
from jax_trainer.sharding import constrain

DENSE_NAME = "dense"  # the checkpoint name of every projection's output (`dense`)


def init_value(key: jax.Array | None, shape, dtype, init: str, std: float = 0.02) -> jax.Array:
    """Values of a parameter: 'ones', 'zeros' or 'normal' (mean 0, `std`, drawn in float32 from `key`)."""
    if init == "ones":
        return jnp.ones(shape, dtype)
    if init == "zeros":
        return jnp.zeros(shape, dtype)
    if init == "normal":
        return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    raise ValueError(f"parameter init {init!r} is not one of ones, zeros, normal")


def _param(rngs: nnx.Rngs | None, shape, axes, dtype, init: str, std: float = 0.02) -> nnx.Param:
    """A parameter with logical axes and its initialiser (`init`: 'normal', 'ones', 'zeros'; `std`) as metadata,
    from which `jax_trainer.models.hf.init_random` recreates it leaf by leaf."""
    value = init_value(rngs.params() if init == "normal" else None, shape, dtype, init, std)
    return nnx.Param(value, axes=tuple(axes), init=(init, std))


def dense(x: jax.Array, kernel: jax.Array, contract: int, dtype) -> jax.Array:
    """Contract the last `contract` dims of x with the first `contract` dims of kernel, accumulating in f32
    (`jax_trainer.kernels.dense`: its backward pass is written by hand).

    The result is named `DENSE_NAME` for the remat policies: XLA-level "save the dots" policies cannot see the
    dot inside the custom-VJP kernel, a checkpoint name can."""
    return checkpoint_name(kernels.dense(x, kernel, contract, dtype), DENSE_NAME)


def _add_adapters(module: nnx.Module, cfg: ModelConfig, lora: lora_lib.LoraSpec | None, targets, param_dtype, rngs):
    """A and B (`nnx.LoRAParam`, with axes and initialiser metadata) on `module` for each of `targets` that
    `lora` adapts; `module.lora_targets` and `module.lora_scaling` say which and by how much."""
    module.lora_targets = tuple(t for t in targets if lora is not None and t in lora.targets)
    module.lora_scaling = lora.scaling if lora is not None else 0.0
    for t in module.lora_targets:
        ins, in_axes, outs, out_axes = lora_lib.target_shape(cfg, t)
        std = 1.0 / math.sqrt(3 * math.prod(ins))
        a_name, b_name = lora_lib.param_names(t)
        a = init_value(rngs.params(), (*ins, lora.rank), param_dtype, "normal", std)
        setattr(module, a_name, nnx.LoRAParam(a, axes=(*in_axes, "lora_rank"), init=("normal", std)))
        b = init_value(None, (lora.rank, *outs), param_dtype, "zeros")
        setattr(module, b_name, nnx.LoRAParam(b, axes=("lora_rank", *out_axes), init=("zeros", 0.02)))


def project(module: nnx.Module, target: str, x: jax.Array, kernel: jax.Array, contract: int, dtype) -> jax.Array:
    """x through a projection's kernel (`kernels.dense`), with its adapter's (alpha / rank) (x A) B when it has one
    (`kernels.lora_dense`)."""
    if target not in module.lora_targets:
        return dense(x, kernel, contract, dtype)
    a_name, b_name = lora_lib.param_names(target)
    a, b = getattr(module, a_name)[...], getattr(module, b_name)[...]
    return kernels.lora_dense(x, kernel, a, b, contract, dtype, float(module.lora_scaling))


class RMSNorm(nnx.Module):
    """y = w * (x / sqrt(mean(x^2) + eps)), normalised in float32 (as HF), then cast back to x's dtype."""

    def __init__(self, dim: int, eps: float, param_dtype, axis_name: str = "norm"):
        self.eps = eps
        self.weight = _param(None, (dim,), (axis_name,), param_dtype, "ones")

    def __call__(self, x: jax.Array) -> jax.Array:
        return kernels.rms_norm(x, self.weight[...], self.eps)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> jax.Array:
    """Inverse frequencies [head_dim/2] in float32, with `linear` or `llama3` scaling applied."""
    inv = 1.0 / (rope.theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if rope.type == "linear":
        return inv / rope.factor
    if rope.type == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate between the two bands.
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = jnp.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return jnp.where(medium, smoothed, scaled)
    return inv


def rope_tables(positions: jax.Array, inv_freq: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape [batch, length, head_dim], computed in float32 and cast to `dtype`."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [batch, length, heads, head_dim]; the rotate-half convention of HF checkpoints."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


class Attention(nnx.Module):
    """Causal grouped-query attention with optional q/k/v bias and per-head q/k RMSNorm (Qwen3).

    `segment_ids` [batch, seq] int32: a token attends to earlier tokens of its own segment only. The kernel is
    `cfg.attention` (`jax_trainer.attention`: auto, xla, cudnn, splash), which builds the mask it needs.
    """

    def __init__(self, cfg: ModelConfig, param_dtype, compute_dtype, rngs: nnx.Rngs, lora=None):
        h, n, kv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        check_name(cfg.attention)
        self.cfg = cfg
        self.dtype = compute_dtype
        std = cfg.initializer_range
        self.q_proj = _param(rngs, (h, n, d), ("embed", "heads", "head_dim"), param_dtype, "normal", std)
        self.k_proj = _param(rngs, (h, kv, d), ("embed", "kv_heads", "head_dim"), param_dtype, "normal", std)
        self.v_proj = _param(rngs, (h, kv, d), ("embed", "kv_heads", "head_dim"), param_dtype, "normal", std)
        self.o_proj = _param(rngs, (n, d, h), ("heads", "head_dim", "embed"), param_dtype, "normal", std)
        if cfg.qkv_bias:
            self.q_bias = _param(None, (n, d), ("heads", "head_dim"), param_dtype, "zeros")
            self.k_bias = _param(None, (kv, d), ("kv_heads", "head_dim"), param_dtype, "zeros")
            self.v_bias = _param(None, (kv, d), ("kv_heads", "head_dim"), param_dtype, "zeros")
        if cfg.o_bias:
            self.o_bias = _param(None, (h,), ("embed",), param_dtype, "zeros")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, param_dtype, "head_dim")
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, param_dtype, "head_dim")
        _add_adapters(self, cfg, lora, ("q", "k", "v", "o"), param_dtype, rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, self.dtype
        q = project(self, "q", x, self.q_proj[...], 1, dt)
        k = project(self, "k", x, self.k_proj[...], 1, dt)
        v = project(self, "v", x, self.v_proj[...], 1, dt)
        if cfg.qkv_bias:
            q = q + self.q_bias[...].astype(dt)
            k = k + self.k_bias[...].astype(dt)
            v = v + self.v_bias[...].astype(dt)
        q = constrain(q, ("batch", "length", "act_heads", None))
        k = constrain(k, ("batch", "length", "act_kv_heads", None))
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        out = attention(q, k, v, segment_ids, cfg.attention)
        out = project(self, "o", out, self.o_proj[...], 2, dt)
        if cfg.o_bias:
            out = out + self.o_bias[...].astype(dt)
        return out


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, param_dtype, compute_dtype, rngs: nnx.Rngs, lora=None):
        h, m = cfg.hidden_size, cfg.intermediate_size
        self.dtype = compute_dtype
        self.bias = cfg.mlp_bias
        std = cfg.initializer_range
        self.gate_proj = _param(rngs, (h, m), ("embed", "mlp"), param_dtype, "normal", std)
        self.up_proj = _param(rngs, (h, m), ("embed", "mlp"), param_dtype, "normal", std)
        self.down_proj = _param(rngs, (m, h), ("mlp", "embed"), param_dtype, "normal", std)
        if cfg.mlp_bias:
            self.gate_bias = _param(None, (m,), ("mlp",), param_dtype, "zeros")
            self.up_bias = _param(None, (m,), ("mlp",), param_dtype, "zeros")
            self.down_bias = _param(None, (h,), ("embed",), param_dtype, "zeros")
        _add_adapters(self, cfg, lora, ("gate", "up", "down"), param_dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = self.dtype
        gate = project(self, "gate", x, self.gate_proj[...], 1, dt)
        up = project(self, "up", x, self.up_proj[...], 1, dt)
        if self.bias:
            gate = gate + self.gate_bias[...].astype(dt)
            up = up + self.up_bias[...].astype(dt)
        inner = constrain(kernels.swiglu(gate, up), ("batch", "length", "act_mlp"))
        out = project(self, "down", inner, self.down_proj[...], 1, dt)
        if self.bias:
            out = out + self.down_bias[...].astype(dt)
        return out
