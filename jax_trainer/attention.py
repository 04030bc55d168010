"""Causal grouped-query attention over packed rows, one implementation per backend.

`attention(q, k, v, segment_ids, implementation)`: q [batch, seq, heads, head_dim], k and v [batch, seq,
kv_heads, head_dim] (heads a multiple of kv_heads), segment_ids [batch, seq] int32. A query attends to the keys
at or before it that carry the same segment id, so the samples packed into one row never see each other
(padding, segment 0, only sees padding). Returns [batch, seq, heads, head_dim] in q's dtype;
softmax(q k^T / sqrt(head_dim)) v with scores and softmax in float32.

Implementations (`[model] attention`, `IMPLEMENTATIONS`):

- `xla`: `jax_trainer.kernels.causal_attention`, the blocked kernel with a hand-written backward pass (query
  blocks visit only the keys at or before them; the causal-and-same-segment mask is a [batch, seq, seq] bool).
  Runs everywhere; written for XLA:CPU.
- `cudnn`: cuDNN flash attention through `jax.nn.dot_product_attention(implementation="cudnn")`, GPU only,
  bfloat16/float16 only. The public API has no segment ids, so segments go in as its boolean `mask`
  [batch, 1, seq, seq] with `is_causal=True` (cuDNN still skips the blocks above the diagonal); jax turns the
  mask into an additive bias in the compute dtype. Cost of packing: that bias ([batch, seq, seq] in bf16, 128 MiB
  at 16 x 2048) is built from the segment ids and read by each attention call, and cuDNN's backward pass writes
  a bias gradient of the same shape that nothing uses; `benchmarks/accelerator.py`'s `attention` stage measures
  the call against cuDNN with `is_causal` alone.
- `splash`: Pallas splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`), TPU only: a causal
  mask plus `SegmentIds`, so segments cost nothing beyond the ids; grouped-query heads run as one MQA kernel per
  KV head (`make_splash_mqa_single_device`, vmapped over batch and KV heads), inside a `shard_map` under a
  mesh. seq must be a multiple of 128.
- `auto`: `splash` on TPU, `cudnn` on GPU when the compute dtype is bfloat16/float16 (cuDNN has no float32
  flash kernel), `xla` otherwise.

The backend is the one the program is compiled for (`jax_trainer.topology.platform`: the devices of the mesh in
context, `jax.set_mesh`), not the host's: a CPU host compiling for a TPU slice's compile-only devices gets
splash.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_trainer import kernels, topology
from jax_trainer.sharding import logical_to_spec

IMPLEMENTATIONS = ("auto", "xla", "cudnn", "splash")
XLA_BLOCK = 128  # queries per block of `kernels.causal_attention`; key blocks after the block are skipped
SPLASH_BLOCK = 512  # splash's query/key block (the largest that divides seq is used, down to 128)
CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def check_name(name: str) -> str:
    """`name` if it is an implementation, else a ValueError that lists them."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"attention {name!r} is not an implementation; choose one of {', '.join(IMPLEMENTATIONS)}")
    return name


def resolve(name: str, dtype, backend: str | None = None) -> str:
    """The implementation `name` runs as on `backend` (default: `topology.platform()`, the platform of the mesh in
    context, else the default backend) for `dtype` inputs."""
    check_name(name)
    if name != "auto":
        return name
    backend = backend or topology.platform()
    if backend == "tpu":
        return "splash"
    if backend in ("gpu", "cuda", "rocm") and jnp.dtype(dtype) in map(jnp.dtype, CUDNN_DTYPES):
        return "cudnn"
    return "xla"


def segment_mask(segment_ids: jax.Array) -> jax.Array:
    """[batch, seq, seq] bool (query, key): key at or before the query, in the same segment."""
    s = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((s, s), dtype=jnp.bool_))[None]
    return causal & (segment_ids[:, :, None] == segment_ids[:, None, :])


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    implementation: str = "auto",
    *,
    interpret: bool = False,
) -> jax.Array:
    """Causal, segment-masked grouped-query attention (see the module docstring); `interpret` runs splash's
    Pallas kernel in interpret mode (for CPU tests)."""
    b, s, n, d = q.shape
    if k.shape != v.shape or k.shape[:2] != (b, s) or k.shape[3] != d or n % k.shape[2]:
        raise ValueError(
            f"attention: q {q.shape} and k/v {k.shape}/{v.shape} must be [batch, seq, heads, head_dim] and "
            "[batch, seq, kv_heads, head_dim] with heads a multiple of kv_heads"
        )
    if segment_ids.shape != (b, s):
        raise ValueError(f"attention: segment_ids {segment_ids.shape} must be [batch, seq] = {(b, s)}")
    backend = topology.platform()
    impl = resolve(implementation, q.dtype, backend)
    if impl == "xla":
        return _xla(q, k, v, segment_ids)
    if impl == "cudnn":
        if q.dtype not in map(jnp.dtype, CUDNN_DTYPES):
            raise ValueError(f"attention 'cudnn' needs bfloat16 or float16 inputs, got {q.dtype}; use 'xla' or 'auto'")
        if backend != "gpu":
            raise ValueError(f"attention 'cudnn' needs a GPU, this backend is {backend}; use 'xla' or 'auto'")
        return dot_product(q, k, v, segment_ids, "cudnn")
    if backend != "tpu" and not interpret:
        raise ValueError(f"attention 'splash' needs a TPU, this backend is {backend}; use 'xla' or 'auto'")
    return _splash(q, k, v, segment_ids, interpret)


def _xla(q, k, v, segment_ids):
    b, s, n, d = q.shape
    kv = k.shape[2]
    # head-major [batch, kv_heads, group, seq, head_dim]: each KV head serves n // kv query heads
    qh = q.reshape(b, s, kv, n // kv, d).transpose(0, 2, 3, 1, 4)
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    out = kernels.causal_attention(qh, kh, vh, segment_mask(segment_ids), XLA_BLOCK)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, s, n, d)


def dot_product(q, k, v, segment_ids, implementation: str):
    """`jax.nn.dot_product_attention` with the segments as a boolean mask and `is_causal`; `implementation`
    "cudnn" on GPU, "xla" is the same call on any backend (the CPU tests' stand-in for the mask logic)."""
    mask = segment_mask(segment_ids)[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=implementation)


def _splash_block(s: int) -> int:
    for block in (SPLASH_BLOCK, 256, 128):
        if s % block == 0:
            return block
    raise ValueError(f"attention 'splash' needs seq ({s}) to be a multiple of 128")


def _splash_kernel(s: int, group: int, block: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    mask = splash.MultiHeadMask([splash.CausalMask((s, s)) for _ in range(group)])
    sizes = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    # built inside each trace: the kernel holds its mask's block tables as arrays, which become constants of the
    # program (splash caches the numpy work of making them). Made eagerly, they would be placed on the mesh's
    # devices, which cannot hold arrays when they are a compile-only TPU topology's
    return splash.make_splash_mqa_single_device(mask, block_sizes=sizes, interpret=interpret)


def _splash(q, k, v, segment_ids, interpret):
    """Splash per device: under a mesh (`jax.set_mesh`), inside a `shard_map` over the activations' shardings
    (a Pallas kernel is not partitioned by XLA); heads stay split only where the KV heads split alike."""
    mesh = jax.sharding.get_abstract_mesh()
    local = functools.partial(_splash_local, interpret=interpret)
    if mesh.empty:
        return local(q, k, v, segment_ids)
    q_spec = logical_to_spec(("batch", "length", "act_heads", None), q.shape, mesh)
    kv_spec = logical_to_spec(("batch", "length", "act_kv_heads", None), k.shape, mesh)
    if q_spec[1] is not None:
        raise ValueError(f"attention 'splash' runs whole sequences per device; the length axis is sharded {q_spec}")
    if q_spec[2] != kv_spec[2]:  # a shard's query heads would not be the ones its KV heads serve
        q_spec, kv_spec = P(q_spec[0], None, None, None), P(kv_spec[0], None, None, None)
    per_device = jax.shard_map(
        local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, P(q_spec[0], None)), out_specs=q_spec, check_vma=False
    )
    return per_device(q, k, v, segment_ids)


def _splash_local(q, k, v, segment_ids, interpret):
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    b, s, n, d = q.shape
    kv = k.shape[2]
    kernel = _splash_kernel(s, n // kv, _splash_block(s), interpret)
    # splash does not scale the scores: fold 1/sqrt(d) into q
    qh = (q * (d**-0.5)).astype(q.dtype).reshape(b, s, kv, n // kv, d).transpose(0, 2, 3, 1, 4)
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    segments = splash.SegmentIds(q=segment_ids, kv=segment_ids)
    per_kv_head = jax.vmap(kernel, in_axes=(0, 0, 0, None))
    out = jax.vmap(per_kv_head)(qh, kh, vh, segments)
    return out.astype(q.dtype).transpose(0, 3, 1, 2, 4).reshape(b, s, n, d)
