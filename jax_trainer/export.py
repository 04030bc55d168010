"""The learner's parameters <-> Hugging Face safetensors directories (the layout of docs/design.md section 4,
written and read by `bridge.weights`); this module is the JAX side:

- `load_params(model_dir, specs, shardings, dtype)` reads a checkpoint into sharded `jax.Array`s. Each
  device's slice is read from a memory map, so a host never holds the whole model, and replicated tensors
  are materialised once per tensor, never all at once.
- `export_params(arrays, specs, out_dir, version=..., source_dir=...)` writes the arrays as a complete version
  (`bridge.weights.write_version`); the transpose to the HF layout and the cast run on the devices.

In a multi-host job every process calls `export_params` (the gathers are collective); process 0 writes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from bridge.weights import ExportResult, HFCheckpoint, Path_, TensorSpec, WeightsError, resolve_dtype, write_version


def load_params(
    model_dir: str | Path,
    specs: Sequence[TensorSpec],
    shardings: Mapping[Path_, jax.sharding.Sharding],
    dtype="float32",
    verify: bool = True,
    ignore: Callable[[str], bool] = lambda name: False,
) -> dict[Path_, jax.Array]:
    """Read every spec's tensor into a `jax.Array` with the given sharding, cast to `dtype`.

    All shapes are checked before anything is read. Checkpoint tensors that no spec asks for are an error
    unless `ignore(name)` says otherwise (a tied `lm_head.weight`, RoPE caches of old checkpoints).
    """
    ckpt = HFCheckpoint(model_dir, verify=verify)
    np_dtype = resolve_dtype(dtype)
    wanted = {s.hf_name for s in specs}
    extra = sorted(n for n in ckpt.names() - wanted if not ignore(n))
    if extra:
        raise WeightsError(f"{ckpt.dir}: unexpected tensors the model has no place for: {', '.join(extra[:8])}")
    views = {s.path: s.to_jax(ckpt.array(s.hf_name, s.hf_shape)) for s in specs}
    out = {}
    for spec in specs:
        view = views.pop(spec.path)
        out[spec.path] = jax.make_array_from_callback(
            spec.jax_shape, shardings[spec.path], lambda idx, v=view: np.ascontiguousarray(v[idx], dtype=np_dtype)
        )
    return out


@functools.lru_cache(maxsize=None)
def _hf_layout_fn(perm: tuple[int, ...], hf_shape: tuple[int, ...], dtype: np.dtype):
    """A jitted JAX layout -> HF layout + cast, run where the shards live (compiled once per shape)."""
    inverse = tuple(int(i) for i in np.argsort(perm))
    return jax.jit(lambda x: x.transpose(inverse).reshape(hf_shape).astype(dtype))


def _hf_host_value(x, spec: TensorSpec, dtype: np.dtype) -> np.ndarray:
    """The tensor in HF layout and export dtype, whole on this host.

    Transpose and cast run on the devices, shard by shard and in parallel, so the host only gathers bytes
    already in the export dtype (half of float32's for bf16). An array spanning several processes is
    gathered collectively.
    """
    y = _hf_layout_fn(spec.perm, spec.hf_shape, np.dtype(dtype))(x)
    if getattr(y, "is_fully_addressable", True):
        return np.asarray(jax.device_get(y))
    return np.asarray(multihost_utils.process_allgather(y, tiled=True))


def export_params(
    arrays: Mapping[Path_, jax.Array],
    specs: Sequence[TensorSpec],
    out_dir: str | Path,
    *,
    version: int,
    source_dir: str | Path | None = None,
    hf_config: dict | None = None,
    dtype="bfloat16",
    max_shard_bytes: int = 2 << 30,
    fsync: bool = True,
    delta_bases: Sequence[tuple[int, Path]] | None = None,
) -> ExportResult | None:
    """Write `arrays` as a complete HF directory at `out_dir` (`bridge.weights.write_version`, which documents
    the other arguments); None on process > 0."""
    for spec in specs:
        if tuple(arrays[spec.path].shape) != spec.jax_shape:
            raise WeightsError(
                f"export: {spec.hf_name} has shape {list(arrays[spec.path].shape)}, expected {list(spec.jax_shape)}"
            )
    np_dtype = resolve_dtype(dtype)
    return write_version(
        specs,
        lambda spec: _hf_host_value(arrays[spec.path], spec, np_dtype),
        out_dir,
        version=version,
        writer=jax.process_index() == 0,
        source_dir=source_dir,
        hf_config=hf_config,
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
        fsync=fsync,
        delta_bases=delta_bases,
    )
