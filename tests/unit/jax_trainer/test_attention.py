"""jax_trainer/attention.py: every kernel against a plain softmax(QK^T)V reference, on packed rows.

The reference is numpy in float64 for values, and a naive jnp softmax attention (full [seq, seq] scores, the
causal-and-same-segment mask from the segment ids, KV heads repeated) for gradients. Rows carry several
segments and trailing padding (segment 0), so a kernel that lets samples see each other fails. The cuDNN
kernel itself needs a GPU (`benchmarks/accelerator.py` checks it there); here its call, with the same mask
and `is_causal`, runs through `jax.nn.dot_product_attention`'s "xla" implementation. Splash runs its Pallas
kernel in interpret mode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_trainer import attention as attn
from jax_trainer.sharding import make_mesh

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}  # max |error| relative to the reference's largest |value|


def _segments(seq: int) -> np.ndarray:
    """Row 0: three samples and padding; row 1: one sample over the whole row."""
    row0 = np.zeros(seq, np.int32)
    a, b, c = seq * 5 // 16, seq * 11 // 16, seq * 15 // 16
    row0[:a], row0[a:b], row0[b:c] = 1, 2, 3
    return np.stack([row0, np.ones(seq, np.int32)])


def _inputs(seq: int, dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(2, seq, HEADS, HEAD_DIM))
    k = rng.normal(size=(2, seq, KV_HEADS, HEAD_DIM))
    v = rng.normal(size=(2, seq, KV_HEADS, HEAD_DIM))
    # round through the dtype so that the reference sees exactly what the kernel sees
    q, k, v = (np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64) for x in (q, k, v))
    return q, k, v, _segments(seq)


def _reference(q, k, v, segments) -> np.ndarray:
    """numpy float64: per query, softmax over the keys at or before it in its segment."""
    b, s, n, d = q.shape
    group = n // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    out = np.zeros_like(q)
    for row in range(b):
        for i in range(s):
            keys = [j for j in range(i + 1) if segments[row, j] == segments[row, i]]
            scores = np.einsum("nd,knd->nk", q[row, i], k[row, keys]) / np.sqrt(d)
            p = np.exp(scores - scores.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            out[row, i] = np.einsum("nk,knd->nd", p, v[row, keys])
    return out


def _naive(q, k, v, segment_ids):
    """Plain jnp attention (float32 scores) for gradients: full scores, masked, softmax, weighted values."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = q.shape[1]
    allowed = jnp.tril(jnp.ones((s, s), bool))[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])
    scores = jnp.einsum("bqnd,bknd->bnqk", q, k, preferred_element_type=jnp.float32) / np.sqrt(q.shape[-1])
    p = jax.nn.softmax(jnp.where(allowed[:, None], scores, -jnp.inf), axis=-1)
    return jnp.einsum("bnqk,bknd->bqnd", p, v.astype(jnp.float32)).astype(q.dtype)


def _run(name: str, q, k, v, segment_ids):
    if name == "xla":
        return attn.attention(q, k, v, segment_ids, "xla")
    if name == "cudnn-mask":
        return attn.dot_product(q, k, v, segment_ids, "xla")
    return attn.attention(q, k, v, segment_ids, "splash", interpret=True)


def _splash_available() -> str | None:
    try:
        from jax.experimental.pallas.ops.tpu import splash_attention  # noqa: F401
    except ImportError as exc:  # the module ships with jax; an install without Pallas's TPU ops cannot run it
        return f"splash attention is not importable in this jax: {exc}"
    return None


def _check(got, want, dtype, what: str):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < TOL[dtype], f"{what}: relative error {err:.2e} >= {TOL[dtype]:.0e}"


KERNELS = [
    pytest.param("xla", 32, id="xla"),
    pytest.param("cudnn-mask", 32, id="cudnn-mask"),
    pytest.param(
        "splash",
        128,
        id="splash-interpret",
        marks=pytest.mark.skipif(_splash_available() is not None, reason=str(_splash_available())),
    ),
]


@pytest.fixture(autouse=True)
def _small_xla_blocks(monkeypatch):
    # two query blocks at seq 32, so the skipped key blocks and the block edges are exercised
    monkeypatch.setattr(attn, "XLA_BLOCK", 16)


@pytest.mark.parametrize("name,seq", KERNELS)
def test_bfloat16_values_match_reference(name, seq):
    """Under a mesh that splits the batch over two devices, as the learner runs (splash: inside its shard_map)."""
    q, k, v, segments = _inputs(seq, jnp.bfloat16)
    run = jax.jit(lambda q, k, v, s: _run(name, q, k, v, s))
    with jax.set_mesh(make_mesh(fsdp=2, devices=jax.devices()[:2])):
        out = run(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), jnp.asarray(segments))
    assert out.shape == q.shape and out.dtype == jnp.bfloat16
    _check(out, _reference(q, k, v, segments), jnp.bfloat16, f"{name} bfloat16")


@pytest.mark.parametrize("name,seq", KERNELS)
def test_float32_values_and_gradients_match_reference(name, seq):
    """One compiled program per kernel: the float32 output (against numpy) and its vjp (against the naive
    attention's gradients; the training step differentiates through the kernel)."""
    q64, k64, v64, segments64 = _inputs(seq, jnp.float32)
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q64, k64, v64))
    segments = jnp.asarray(segments64)
    weights = jnp.asarray(np.random.default_rng(2).normal(size=q.shape), jnp.float32)

    @jax.jit
    def values_and_grads(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: _run(name, q, k, v, segments), q, k, v)
        return out, vjp(weights)

    out, got = values_and_grads(q, k, v)
    _check(out, _reference(q64, k64, v64, segments64), jnp.float32, f"{name} float32")
    want = jax.jit(lambda q, k, v: jax.vjp(lambda q, k, v: _naive(q, k, v, segments), q, k, v)[1](weights))(q, k, v)
    for part, g, w in zip("qkv", got, want):
        _check(g, np.asarray(w, np.float64), jnp.float32, f"{name} d{part}")


def test_auto_picks_the_backend_kernel():
    assert attn.resolve("auto", jnp.bfloat16, "tpu") == "splash"
    assert attn.resolve("auto", jnp.bfloat16, "gpu") == "cudnn"
    assert attn.resolve("auto", jnp.float32, "gpu") == "xla"  # cuDNN has no float32 flash kernel
    assert attn.resolve("auto", jnp.bfloat16, "cpu") == "xla"
    assert attn.resolve("splash", jnp.float32, "cpu") == "splash"  # a named kernel is taken as asked


def test_bad_names_shapes_and_dtypes_are_refused():
    q = jnp.zeros((1, 8, 4, 16), jnp.float32)
    k = jnp.zeros((1, 8, 2, 16), jnp.float32)
    seg = jnp.zeros((1, 8), jnp.int32)
    with pytest.raises(ValueError, match="'flash' is not an implementation; choose one of auto, xla, cudnn"):
        attn.attention(q, k, k, seg, "flash")
    with pytest.raises(ValueError, match="'cudnn' needs bfloat16 or float16 inputs, got float32"):
        attn.attention(q, k, k, seg, "cudnn")
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="'cudnn' needs a GPU, this backend is cpu"):
            attn.attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), k.astype(jnp.bfloat16), seg, "cudnn")
        with pytest.raises(ValueError, match="'splash' needs a TPU, this backend is cpu"):
            attn.attention(q, k, k, seg, "splash")
    with pytest.raises(ValueError, match=r"segment_ids \(1, 7\) must be \[batch, seq\]"):
        attn.attention(q, k, k, seg[:, :7], "xla")
    with pytest.raises(ValueError, match="heads a multiple of kv_heads"):
        attn.attention(q, jnp.zeros((1, 8, 3, 16)), jnp.zeros((1, 8, 3, 16)), seg, "xla")
    with pytest.raises(ValueError, match=r"'splash' needs seq \(8\) to be a multiple of 128"):
        attn.attention(q, k, k, seg, "splash", interpret=True)
