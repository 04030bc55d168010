"""The decoder-only transformer shared by the Qwen2, Qwen3 and Llama families.

`Decoder(cfg)(tokens, positions=None, segment_ids=None, return_hidden=False)`:

- `tokens` [batch, length] int32.
- `positions` [batch, length]: RoPE positions; default 0..length-1. Packed rows restart them per segment.
- `segment_ids` [batch, length]: a token attends only to earlier tokens of the same segment, so several
  sequences packed into one row never see each other. Default: one segment per row.
- returns logits [batch, length, vocab] in float32, and with `return_hidden=True` also the final-norm hidden
  states [batch, length, hidden] (the TOPLOC activations and the LM head's input).

`param_dtype` is what the parameters are stored in (float32 master weights for training, bfloat16 to serve),
`compute_dtype` what the matmuls run in. `remat=True` recomputes each layer's activations in the backward
pass (`jax.checkpoint` per layer), trading compute for memory.

Layers are a Python list, not a scanned stack: parameter paths then match HF names one to one, and compile
time at the sizes this project targets is small; a scanned variant is an optimisation left for later.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_trainer.models.config import ModelConfig
from jax_trainer.models.layers import MLP, Attention, RMSNorm, _param, rope_inv_freq, rope_tables
from jax_trainer.sharding import constrain


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, param_dtype, compute_dtype, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype)
        self.attn = Attention(cfg, param_dtype, compute_dtype, rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype)
        self.mlp = MLP(cfg, param_dtype, compute_dtype, rngs)

    def __call__(self, x, cos, sin, segment_ids):
        x = x + self.attn(self.input_norm(x), cos, sin, segment_ids)
        x = x + self.mlp(self.post_attn_norm(x))
        return constrain(x, ("batch", "length", "act_embed"))


def _run_layer(layer: DecoderLayer, x, cos, sin, segment_ids):
    return layer(x, cos, sin, segment_ids)


def _run_layer_remat(layer: DecoderLayer, x, cos, sin, segment_ids):
    """`_run_layer` under `jax.checkpoint`, on the layer's parameters as plain arrays.

    `nnx.remat` would re-bind the layer's `Param` objects inside the checkpoint, and nnx refuses that when the
    parameters come from an enclosing trace (the pi_old recompute inside the step's `lax.map` over
    micro-batches: "Cannot mutate Param from a different trace level"). Splitting the layer here and merging
    a fresh copy inside the checkpointed function touches no outer object, whatever trace the call sits in.
    """
    graphdef, state = nnx.split(layer)

    def run(state, x, cos, sin, segment_ids):
        return nnx.merge(graphdef, state)(x, cos, sin, segment_ids)

    return jax.checkpoint(run)(state, x, cos, sin, segment_ids)


class Decoder(nnx.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        param_dtype=jnp.float32,
        compute_dtype=jnp.float32,
        remat: bool = False,
        rngs: nnx.Rngs | None = None,
    ):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.cfg = cfg
        self.compute_dtype = compute_dtype
        self.remat = remat
        self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), param_dtype, "normal", 1.0)
        self.layers = nnx.List([DecoderLayer(cfg, param_dtype, compute_dtype, rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype)
        if not cfg.tie_embeddings:
            std = cfg.hidden_size**-0.5
            self.lm_head = _param(
                rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), param_dtype, "normal", std
            )

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        return_hidden: bool = False,
    ):
        hidden = self.hidden_states(tokens, positions, segment_ids)
        logits = constrain(_logits_f32(hidden, self.head()), ("batch", "length", "act_vocab"))
        return (logits, hidden) if return_hidden else logits

    def hidden_states(
        self, tokens: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None
    ) -> jax.Array:
        """Final-norm hidden states [batch, length, hidden] in the compute dtype (the LM head's input).

        The GRPO loss starts here and applies `head()` chunk by chunk, so that [batch, length, vocab] float32
        logits never exist at once.
        """
        cfg, dt = self.cfg, self.compute_dtype
        b, s = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        if segment_ids is None:
            segment_ids = jnp.zeros((b, s), jnp.int32)
        cos, sin = rope_tables(positions, rope_inv_freq(cfg.rope, cfg.head_dim), dt)

        x = jnp.take(self.embed[...], tokens, axis=0).astype(dt)
        x = constrain(x, ("batch", "length", "act_embed"))
        run = _run_layer_remat if self.remat else _run_layer
        for layer in self.layers:
            x = run(layer, x, cos, sin, segment_ids)
        return self.final_norm(x)

    def head(self) -> jax.Array:
        """The LM head as an [hidden, vocab] matrix (the embedding, transposed, when tied)."""
        return self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]


def _logits_f32(hidden: jax.Array, head: jax.Array) -> jax.Array:
    """LM head in the compute dtype with float32 accumulation and a float32 result (no bf16 rounding)."""
    return jax.lax.dot_general(
        hidden, head.astype(hidden.dtype), (((2,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )
