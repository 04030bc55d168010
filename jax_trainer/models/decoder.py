"""The decoder-only transformer shared by the Qwen2, Qwen3 and Llama families.

`Decoder(cfg)(tokens, positions=None, segment_ids=None, return_hidden=False)`:

- `tokens` [batch, length] int32.
- `positions` [batch, length]: RoPE positions; default 0..length-1. Packed rows restart them per segment.
- `segment_ids` [batch, length]: a token attends only to earlier tokens of the same segment, so several
  sequences packed into one row never see each other. Default: one segment per row.
- returns logits [batch, length, vocab] in float32, and with `return_hidden=True` also the final-norm hidden
  states [batch, length, hidden] (the TOPLOC activations and the LM head's input).

`param_dtype` is what the parameters are stored in (float32 master weights for training, bfloat16 to serve),
`compute_dtype` what the matmuls run in.

Layers are stacked: every parameter of `layers` has a leading layer axis (logical name `layers`, never
sharded), e.g. `layers.attn.q_proj` is [num_layers, hidden, heads, head_dim]. With `scan_layers=True` one
`jax.lax.scan` runs them, so the compiled program holds one layer whatever the depth (`scan_unroll` layers per
iteration); `scan_layers=False` runs the same stacked parameters in a Python loop (one copy of the layer per
depth in the program: what the depth test shows growing). `scan_layers="auto"` (the default,
`resolve_scan_layers`) scans on accelerators and unrolls on CPU: XLA:CPU runs the scanned step about 12% slower
(the loop's residual stacks are read through dynamic slices and transposed afresh for every weight gradient,
and the attention mask's select no longer fuses into its matmul), and at the depths a CPU trains the unrolled
program compiles as fast. Both forms hold the same parameters, so checkpoints move between them unchanged.

`lora` (a `jax_trainer.models.lora.LoraSpec`) adds LoRA adapters (`nnx.LoRAParam`) to the projections it names;
the trainer then trains those alone.

`remat` names what each layer keeps for the backward pass (`REMAT_POLICIES`), applied to the scanned body or
to each unrolled layer:

- `none`: everything the backward pass needs stays in memory;
- `full`: only the layer's input; the backward pass recomputes the rest (`jax.checkpoint`);
- `save_dots`: the projections' outputs (`layers.DENSE_NAME`) stay, the rest (norms, RoPE, attention, SwiGLU)
  is recomputed;
- `offload`: the projections' outputs move to pinned host memory and come back for the backward pass, where
  the backend has pinned host memory beside the device's; on CPU (whose device memory already is host memory)
  it runs as `full`, and says so in the log. Booleans from older callers read as full (True) / none (False).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from flax import nnx

from jax_trainer import topology
from jax_trainer.models.config import ModelConfig
from jax_trainer.models.layers import (
    DENSE_NAME,
    MLP,
    Attention,
    RMSNorm,
    _param,
    init_value,
    rope_inv_freq,
    rope_tables,
)
from jax_trainer.models.lora import LoraSpec, check_lora
from jax_trainer.sharding import constrain

REMAT_POLICIES = ("none", "full", "save_dots", "offload")
LAYER_AXIS = "layers"  # logical name of the stacked layer axis (jax_trainer.sharding maps it to no mesh axis)
log = logging.getLogger("jax_trainer.models.decoder")


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, param_dtype, compute_dtype, rngs: nnx.Rngs, lora=None):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype)
        self.attn = Attention(cfg, param_dtype, compute_dtype, rngs, lora)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype)
        self.mlp = MLP(cfg, param_dtype, compute_dtype, rngs, lora)

    def __call__(self, x, cos, sin, segment_ids):
        x = x + self.attn(self.input_norm(x), cos, sin, segment_ids)
        x = x + self.mlp(self.post_attn_norm(x))
        return constrain(x, ("batch", "length", "act_embed"))


def resolve_scan_layers(scan_layers: bool | str, backend: str | None = None) -> bool:
    """Whether the layers run under one `lax.scan`: booleans as given; "auto" scans everywhere but on the CPU
    backend, where the unrolled step runs faster (module docstring). `backend` defaults to the platform the
    program is compiled for (`topology.platform()`: the mesh in context, else the default backend)."""
    if isinstance(scan_layers, bool):
        return scan_layers
    if scan_layers != "auto":
        raise ValueError(f"scan_layers {scan_layers!r} must be true, false or 'auto'")
    return (backend or topology.platform()) != "cpu"


def remat_name(remat: str | bool) -> str:
    """The policy's name; True/False (the old boolean) read as full/none."""
    if isinstance(remat, bool):
        return "full" if remat else "none"
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat {remat!r} is not a remat policy; choose one of {', '.join(REMAT_POLICIES)}")
    return remat


def has_pinned_host(device=None) -> bool:
    """Whether the device programs are compiled for (default: of the mesh in context, else the default one) has
    pinned host memory distinct from its own (GPU, TPU; not CPU)."""
    return topology.has_pinned_host(device)


def checkpoint_policy(remat: str, pinned_host: bool | None = None):
    """The `jax.checkpoint` policy of a named remat policy (None for `none`: no checkpoint at all); `pinned_host`
    (default `has_pinned_host()`, asked while tracing, under the target's mesh) decides what `offload` is."""
    if remat == "offload" and pinned_host is None:
        pinned_host = has_pinned_host()
    return _policy(remat, bool(pinned_host))


@functools.lru_cache(maxsize=None)
def _policy(remat: str, pinned_host: bool):
    policies = jax.checkpoint_policies
    if remat == "none":
        return None
    if remat == "save_dots":
        return policies.save_only_these_names(DENSE_NAME)
    if remat == "offload":
        if pinned_host:
            return policies.save_and_offload_only_these_names(
                names_which_can_be_saved=[],
                names_which_can_be_offloaded=[DENSE_NAME],
                offload_src="device",
                offload_dst="pinned_host",
            )
        log.warning(
            "remat 'offload': %s has no pinned host memory apart from its own, running as remat 'full'",
            topology.platform(),
        )
    return policies.nothing_saveable


def _stacked_layers(cfg: ModelConfig, param_dtype, compute_dtype, rngs: nnx.Rngs, lora=None) -> DecoderLayer:
    """`cfg.num_layers` layers as one `DecoderLayer` whose parameters have a leading layer axis.

    The layer's structure comes from an abstract layer (no values); each stacked parameter is then created
    whole from the initialiser its metadata names.
    """
    template = nnx.eval_shape(lambda: DecoderLayer(cfg, param_dtype, compute_dtype, nnx.Rngs(0), lora))
    graphdef, state = nnx.split(template)

    def stack(var):
        meta = var.get_metadata()
        init, std = meta["init"]
        shape = (cfg.num_layers, *var.get_value().shape)
        key = rngs.params() if init == "normal" else None
        value = init_value(key, shape, var.get_value().dtype, init, std)
        return var.replace(value, axes=(LAYER_AXIS, *meta["axes"]))

    return nnx.merge(graphdef, jax.tree.map(stack, state, is_leaf=lambda x: isinstance(x, nnx.Variable)))


class Decoder(nnx.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        param_dtype=jnp.float32,
        compute_dtype=jnp.float32,
        remat: str | bool = "none",
        scan_layers: bool | str = "auto",
        scan_unroll: int = 1,
        rngs: nnx.Rngs | None = None,
        lora: LoraSpec | None = None,
    ):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        if lora is not None:
            check_lora(lora, cfg)
        if scan_unroll < 1:
            raise ValueError(f"scan_unroll must be >= 1, got {scan_unroll}")
        self.cfg = cfg
        self.compute_dtype = compute_dtype
        self.remat = remat_name(remat)
        self.scan_layers = resolve_scan_layers(scan_layers)
        self.scan_unroll = scan_unroll
        self.lora = lora
        std = cfg.initializer_range
        self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), param_dtype, "normal", std)
        self.layers = _stacked_layers(cfg, param_dtype, compute_dtype, rngs, lora)
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype)
        if not cfg.tie_embeddings:
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
        x = self._run_layers(x, cos, sin, segment_ids)
        return self.final_norm(x)

    def _run_layers(self, x, cos, sin, segment_ids):
        """All layers on x, scanned or unrolled, each under the remat policy.

        The layer runs on its parameters as plain arrays, merged into a fresh module inside the (checkpointed)
        function: `nnx.remat` would re-bind the outer `Param` objects, which nnx refuses when they come from an
        enclosing trace (the pi_old recompute inside the step's `lax.map` over micro-batches).
        """
        graphdef, state = nnx.split(self.layers)

        def layer(layer_state, x, cos, sin, segment_ids):
            return nnx.merge(graphdef, layer_state)(x, cos, sin, segment_ids)

        policy = checkpoint_policy(self.remat)
        if policy is not None:
            layer = jax.checkpoint(layer, policy=policy)
        if self.scan_layers:

            def body(x, layer_state):
                return layer(layer_state, x, cos, sin, segment_ids), None

            return jax.lax.scan(body, x, state, unroll=self.scan_unroll)[0]
        for i in range(self.cfg.num_layers):
            x = layer(jax.tree.map(lambda v, i=i: v[i], state), x, cos, sin, segment_ids)
        return x

    def head(self) -> jax.Array:
        """The LM head as an [hidden, vocab] matrix (the embedding, transposed, when tied)."""
        return self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]


def _logits_f32(hidden: jax.Array, head: jax.Array) -> jax.Array:
    """LM head in the compute dtype with float32 accumulation and a float32 result (no bf16 rounding)."""
    return jax.lax.dot_general(
        hidden, head.astype(hidden.dtype), (((2,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )
