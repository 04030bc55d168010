"""Hand-written gradients for the hot spots of the training step.

Each function computes exactly what its plain `jax.numpy` formula computes; the custom VJP only changes how
the backward pass is formed, because XLA's automatic transpose of these formulas is slow on CPU (measured in
`benchmarks/train_step.py`: on 2 CPU cores the straightforward jitted step ran at 0.5-0.8x eager PyTorch's
tokens/s, the gradient of a log-softmax gather alone, a scatter plus a strided transpose, costing about a fifth of
PyTorch's whole step; with these three functions the step reaches 0.9-1.0x):

- `dense`: a contraction accumulating in float32. The backward pass is two contractions in the compute dtype
  with float32 accumulation, written so that both come out in the layout the caller needs (no transposes of
  the gradient, no bf16 accumulation of weight gradients over the whole batch).
- `lora_dense`: `dense` with a LoRA adapter beside the kernel: in float32 one contraction with the tokens
  each way (the adapter merged into the kernel for it), and the adapter's gradients formed through the rank.
- `causal_attention`: softmax(q k^T / sqrt(d)) v under a causal mask, computed head-major, in query blocks
  that only visit the keys at or before the block (fully masked blocks are skipped, not multiplied and
  discarded). The backward pass recomputes the probabilities from the saved row log-sum-exp instead of
  keeping [batch, heads, seq, seq] probabilities alive between the passes.
- `sampled_logprobs`: log softmax(h W / T)[target] and the entropy, chunk by chunk, without a full
  log-softmax and a gather: the gradient of logit j is (1[j = target] - p_j) per token, formed directly
  instead of through XLA's scatter of `take_along_axis`. Neither pass holds [batch, seq, vocab] logits.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

NEG_INF = float(jnp.finfo(jnp.float32).min)


# ---- dense ---------------------------------------------------------------------------------------------------
def _contract(a: jax.Array, b: jax.Array, a_dims, b_dims) -> jax.Array:
    return jax.lax.dot_general(a, b, ((tuple(a_dims), tuple(b_dims)), ((), ())), preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def dense(x: jax.Array, kernel: jax.Array, contract: int, dtype) -> jax.Array:
    """Contract the last `contract` dims of x with the first `contract` dims of kernel, accumulating in f32;
    the result is in `dtype`."""
    lead = x.ndim - contract
    return _contract(x.astype(dtype), kernel.astype(dtype), range(lead, x.ndim), range(contract)).astype(dtype)


def _dense_fwd(x, kernel, contract, dtype):
    return dense(x, kernel, contract, dtype), (x, kernel)


def _dense_bwd(contract, dtype, res, g):
    x, kernel = res
    xc, kc, g = x.astype(dtype), kernel.astype(dtype), g.astype(dtype)
    lead = x.ndim - contract
    # dx[..., in] = sum_out g[..., out] kernel[in, out];  dk[in, out] = sum_lead x[lead, in] g[lead, out]
    dx = _contract(g, kc, range(lead, g.ndim), range(contract, kc.ndim))
    dk = _contract(xc, g, range(lead), range(lead))
    return dx.astype(x.dtype), dk.astype(kernel.dtype)


dense.defvjp(_dense_fwd, _dense_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def lora_dense(x: jax.Array, kernel: jax.Array, a: jax.Array, b: jax.Array, contract: int, dtype, scale: float):
    """`dense(x, kernel) + scale * dense(dense(x, a), b)`: a projection with its LoRA adapter a [in..., rank],
    b [rank, out...], accumulating in float32.

    In float32 the adapter is merged for the contraction with the tokens: x (kernel + scale a b), the merged
    matrix formed in float32 (and formed again in the backward pass, not kept), so the forward and the input
    gradient are one contraction each, as without the adapter. In a lower-precision compute dtype the two terms
    stay apart and are summed in float32 before one cast: a merged matrix rounded to bfloat16 would lose every
    adapter entry below half a unit in the last place of the kernel's. The weight gradients are formed through
    the rank: da = x^T (scale g b^T), db = (scale x a)^T g; the kernel's own gradient only where it is used (XLA
    drops it otherwise).
    """
    return _lora_fwd(x, kernel, a, b, contract, dtype, scale)[0]


def _lora_merge(kernel, a, b, scale, dtype):
    delta = _contract(a.astype(jnp.float32), b.astype(jnp.float32), (a.ndim - 1,), (0,))
    return (kernel.astype(jnp.float32) + scale * delta).astype(dtype)


def _lora_fwd(x, kernel, a, b, contract, dtype, scale):
    xc, lead = x.astype(dtype), x.ndim - contract
    low = (_contract(xc, a.astype(dtype), range(lead, x.ndim), range(contract)) * scale).astype(dtype)
    if jnp.dtype(dtype) == jnp.float32:
        y = _contract(xc, _lora_merge(kernel, a, b, scale, dtype), range(lead, x.ndim), range(contract))
    else:
        y = _contract(xc, kernel.astype(dtype), range(lead, x.ndim), range(contract))
        y = y + _contract(low, b.astype(dtype), (lead,), (0,))
    return y.astype(dtype), (x, kernel, a, b, low)


def _lora_bwd(contract, dtype, scale, res, g):
    x, kernel, a, b, low = res
    xc, g, lead = x.astype(dtype), g.astype(dtype), x.ndim - contract
    ac, bc = a.astype(dtype), b.astype(dtype)
    d_low = (_contract(g, bc, range(lead, g.ndim), range(1, bc.ndim)) * scale).astype(dtype)
    if jnp.dtype(dtype) == jnp.float32:
        dx = _contract(g, _lora_merge(kernel, a, b, scale, dtype), range(lead, g.ndim), range(contract, kernel.ndim))
    else:
        dx = _contract(g, kernel.astype(dtype), range(lead, g.ndim), range(contract, kernel.ndim))
        dx = dx + _contract(d_low, ac, (lead,), (ac.ndim - 1,))
    dk = _contract(xc, g, range(lead), range(lead))
    da = _contract(xc, d_low, range(lead), range(lead))
    db = _contract(low, g, range(lead), range(lead))
    return dx.astype(x.dtype), dk.astype(kernel.dtype), da.astype(a.dtype), db.astype(b.dtype)


lora_dense.defvjp(_lora_fwd, _lora_bwd)


# ---- elementwise -------------------------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """weight * (x / sqrt(mean(x^2) + eps)): normalised in float32, scaled in x's dtype (as HF)."""
    return _rms_norm_fwd(x, weight, eps)[0]


def _rms_norm_fwd(x, weight, eps):
    xf = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * (xf * r).astype(x.dtype), (x, weight, r)


def _rms_norm_bwd(eps, res, dy):
    x, weight, r = res
    n = x.astype(jnp.float32) * r
    dy = dy.astype(jnp.float32)
    dn = dy * weight.astype(jnp.float32)
    # n = x r with r = mean(x^2)^-1/2:  dx = r (dn - n mean(dn n))
    dx = r * (dn - n * jnp.mean(dn * n, axis=-1, keepdims=True))
    dw = jnp.sum(dy * n, axis=tuple(range(x.ndim - 1)))
    return dx.astype(x.dtype), dw.astype(weight.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


@jax.custom_vjp
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up, in float32 and cast back to gate's dtype."""
    g = gate.astype(jnp.float32)
    return (g * jax.nn.sigmoid(g) * up.astype(jnp.float32)).astype(gate.dtype)


def _swiglu_fwd(gate, up):
    return swiglu(gate, up), (gate, up)


def _swiglu_bwd(res, d):
    gate, up = res
    g, u, d = gate.astype(jnp.float32), up.astype(jnp.float32), d.astype(jnp.float32)
    sig = jax.nn.sigmoid(g)
    # silu'(g) = sigmoid(g) (1 + g (1 - sigmoid(g)))
    d_gate = d * u * sig * (1.0 + g * (1.0 - sig))
    return d_gate.astype(gate.dtype), (d * g * sig).astype(up.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


# ---- attention -----------------------------------------------------------------------------------------------
def _blocks(length: int, block: int) -> list[tuple[int, int]]:
    return [(start, min(start + block, length)) for start in range(0, length, block)]


def _attention_forward(q, k, v, mask, block):
    """q [b, kv, g, s, d], k/v [b, kv, s, d] (head-major), mask [b, s, s]; -> out like q, lse [b, kv, g, s]."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    outs, lses = [], []
    for start, end in _blocks(q.shape[3], block):
        scores = (
            jnp.einsum("bhgqd,bhkd->bhgqk", q[:, :, :, start:end], k[:, :, :end], preferred_element_type=jnp.float32)
            * scale
        )
        scores = jnp.where(mask[:, None, None, start:end, :end], scores, NEG_INF)
        row_max = jnp.max(scores, axis=-1, keepdims=True)
        e = jnp.exp(scores - row_max)
        total = jnp.sum(e, axis=-1, keepdims=True)
        # normalise after the PV product: a division over [.., d] instead of over [.., keys]
        out = jnp.einsum("bhgqk,bhkd->bhgqd", e.astype(v.dtype), v[:, :, :end], preferred_element_type=jnp.float32)
        outs.append(out / total)
        lses.append((row_max + jnp.log(total))[..., 0])
    return jnp.concatenate(outs, axis=3).astype(q.dtype), jnp.concatenate(lses, axis=3)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, block: int = 128) -> jax.Array:
    """softmax(q k^T / sqrt(d) where mask) v for grouped-query heads, head-major.

    q [batch, kv_heads, group, seq, head_dim]; k, v [batch, kv_heads, seq, head_dim]; mask [batch, seq, seq]
    bool (query, key), which must be causal: a query never sees a later key, so key blocks after a query
    block are skipped. Returns [batch, kv_heads, group, seq, head_dim] in q's dtype; scores and softmax in f32.
    """
    return _attention_forward(q, k, v, mask, block)[0]


def _attention_fwd(q, k, v, mask, block):
    out, lse = _attention_forward(q, k, v, mask, block)
    return out, (q, k, v, mask, out, lse)


def _attention_bwd(block, res, d_out):
    q, k, v, mask, out, lse = res
    scale = 1.0 / math.sqrt(q.shape[-1])
    # D_i = sum_d dO_i O_i: the softmax Jacobian's row term, from the output instead of the probabilities
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    d_out = d_out.astype(v.dtype)
    mask_t = mask.swapaxes(1, 2)
    # Everything is formed key-major ([.., key, group, query]), so that dK = dS^T Q and dV = P^T dO contract
    # the trailing dims of their left operand: no transposed copy of a [.., query, key] block is ever made.
    dq_blocks = []
    dk = jnp.zeros(k.shape, jnp.float32)
    dv = jnp.zeros(v.shape, jnp.float32)
    for start, end in _blocks(q.shape[3], block):
        qb, do, kb, vb = q[:, :, :, start:end], d_out[:, :, :, start:end], k[:, :, :end], v[:, :, :end]
        scores_t = jnp.einsum("bhkd,bhgqd->bhkgq", kb, qb, preferred_element_type=jnp.float32) * scale
        scores_t = jnp.where(mask_t[:, None, :end, None, start:end], scores_t, NEG_INF)
        probs_t = jnp.exp(scores_t - lse[:, :, None, :, start:end])
        dv = dv.at[:, :, :end].add(
            jnp.einsum("bhkgq,bhgqd->bhkd", probs_t.astype(v.dtype), do, preferred_element_type=jnp.float32)
        )
        dp_t = jnp.einsum("bhkd,bhgqd->bhkgq", vb, do, preferred_element_type=jnp.float32)
        ds_t = (probs_t * (dp_t - delta[:, :, None, :, start:end]) * scale).astype(q.dtype)
        dk = dk.at[:, :, :end].add(jnp.einsum("bhkgq,bhgqd->bhkd", ds_t, qb, preferred_element_type=jnp.float32))
        dq_t = jnp.einsum("bhkd,bhkgq->bhgdq", kb, ds_t, preferred_element_type=jnp.float32)
        dq_blocks.append(dq_t.swapaxes(3, 4))
    dq = jnp.concatenate(dq_blocks, axis=3)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


causal_attention.defvjp(_attention_fwd, _attention_bwd)


# ---- sampled-token logprobs ----------------------------------------------------------------------------------
def _chunk_logits(h, head, temperature):
    return _contract(h, head.astype(h.dtype), (h.ndim - 1,), (0,)) * (1.0 / temperature)


def _chunk_forward(h, head, targets, temperature):
    z = _chunk_logits(h, head, temperature)
    lse = jax.nn.logsumexp(z, axis=-1)
    hit = jax.lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1) == targets[..., None]
    target_z = jnp.sum(jnp.where(hit, z, 0.0), axis=-1)
    entropy = lse - jnp.sum(jnp.exp(z - lse[..., None]) * z, axis=-1)
    return target_z - lse, entropy, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def sampled_logprobs(hidden: jax.Array, head: jax.Array, targets: jax.Array, temperature: float):
    """Chunked: hidden [chunks, batch, chunk, h], head [h, vocab], targets [chunks, batch, chunk] int.

    Returns (logprob of the target, entropy), each [chunks, batch, chunk] float32, of softmax(hidden head / T).
    """
    lp, ent, _ = jax.lax.map(lambda x: _chunk_forward(x[0], head, x[1], temperature), (hidden, targets))
    return lp, ent


def _logprobs_fwd(hidden, head, targets, temperature):
    hidden, head, targets = hidden.value, head.value, targets.value
    lp, ent, lse = jax.lax.map(lambda x: _chunk_forward(x[0], head, x[1], temperature), (hidden, targets))
    return (lp, ent), (hidden, head, targets, ent, lse)


def _logprobs_bwd(temperature, res, cotangents):
    hidden, head, targets, ent, lse = res
    d_lp, d_ent = cotangents
    with_lp, with_ent = not isinstance(d_lp, SymbolicZero), not isinstance(d_ent, SymbolicZero)

    def chunk(d_head, xs):
        h, t, ent_c, lse_c, dlp_c, dent_c = xs
        z = _chunk_logits(h, head, temperature)
        p = jnp.exp(z - lse_c[..., None])
        # d logp_t / dz_j = 1[j = t] - p_j;  d entropy / dz_j = -p_j (z_j - lse + entropy)
        dz = jnp.zeros_like(z)
        if with_lp:
            hit = jax.lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1) == t[..., None]
            dz = jnp.where(hit, dlp_c[..., None], 0.0) - p * dlp_c[..., None]
        if with_ent:
            dz = dz - p * (z - (lse_c - ent_c)[..., None]) * dent_c[..., None]
        dz = (dz * (1.0 / temperature)).astype(h.dtype)
        dh = _contract(dz, head.astype(h.dtype), (dz.ndim - 1,), (1,)).astype(h.dtype)
        d_head = d_head + _contract(h, dz, range(h.ndim - 1), range(dz.ndim - 1))
        return d_head, dh

    zeros = jnp.zeros(lse.shape, jnp.float32)
    d_lp = d_lp if with_lp else zeros
    d_ent = d_ent if with_ent else zeros
    d_head, d_hidden = jax.lax.scan(chunk, jnp.zeros(head.shape, jnp.float32), (hidden, targets, ent, lse, d_lp, d_ent))
    return d_hidden, d_head.astype(head.dtype), None


sampled_logprobs.defvjp(_logprobs_fwd, _logprobs_bwd, symbolic_zeros=True)
