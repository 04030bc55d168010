"""The learner's parameters <-> Hugging Face safetensors directories (the layout of docs/design.md section 4,
written and read by `bridge.weights`); this module is the JAX side:

- `load_params(model_dir, specs, shardings, dtype)` reads a checkpoint into sharded `jax.Array`s, one
  `jax.make_array_from_callback` per array and nothing compiled. Each device's slice is read from a memory map
  (for a stacked array of scanned layers, that slice of every layer's tensor, stacked on the host), so a host
  never holds the whole model, and replicated tensors are materialised once per array, never all at once.
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
    groups: dict[Path_, list[TensorSpec]] = {}
    for spec in specs:
        groups.setdefault(spec.path, []).append(spec)
    views = {path: [s.to_jax(ckpt.array(s.hf_name, s.hf_shape)) for s in group] for path, group in groups.items()}
    out = {}
    for path, group in groups.items():
        layered = _stacked_order(path, group)
        parts = views.pop(path)
        if layered:
            shape = (len(group), *group[0].jax_shape)

            def read(idx, parts=parts):
                # one device's slice of the stacked array: its slice of each layer's tensor, stacked on the host
                return np.stack([np.asarray(v[idx[1:]], dtype=np_dtype) for v in parts[idx[0]]])

        else:
            shape = group[0].jax_shape

            def read(idx, view=parts[0]):
                return np.ascontiguousarray(view[idx], dtype=np_dtype)

        out[path] = jax.make_array_from_callback(shape, shardings[path], read)
    return out


def _stacked_order(path: Path_, group: Sequence[TensorSpec]) -> bool:
    """Whether the specs at `path` are the layers 0..n-1 of one stacked array (in that order) or one tensor."""
    layers = [s.layer for s in group]
    if layers == [None]:
        return False
    if layers != list(range(len(group))) or len({s.jax_shape for s in group}) != 1:
        raise WeightsError(f"tensor specs of {path}: layers {layers} of one shape expected, in order from 0")
    return True


@functools.lru_cache(maxsize=None)
def _hf_layout_fn(perm: tuple[int, ...], hf_shape: tuple[int, ...], dtype: np.dtype, layered: bool):
    """A jitted JAX layout -> HF layout + cast, run where the shards live (compiled once per shape); `layered`
    takes one layer (a traced index, so one program serves every layer) of a stacked array first."""
    inverse = tuple(int(i) for i in np.argsort(perm))

    def layout(x, layer):
        x = jax.lax.dynamic_index_in_dim(x, layer, keepdims=False) if layered else x
        return x.transpose(inverse).reshape(hf_shape).astype(dtype)

    return jax.jit(layout)


def _hf_host_value(x, spec: TensorSpec, dtype: np.dtype) -> np.ndarray:
    """The tensor in HF layout and export dtype, whole on this host.

    Transpose and cast run on the devices, shard by shard and in parallel, so the host only gathers bytes
    already in the export dtype (half of float32's for bf16). An array spanning several processes is
    gathered collectively.
    """
    layered = spec.layer is not None
    y = _hf_layout_fn(spec.perm, spec.hf_shape, np.dtype(dtype), layered)(x, spec.layer if layered else 0)
    if getattr(y, "is_fully_addressable", True):
        return np.asarray(jax.device_get(y))
    return np.asarray(multihost_utils.process_allgather(y, tiled=True))


def host_values(arrays: Mapping[Path_, jax.Array], specs: Sequence[TensorSpec], dtype):
    """`write_version`'s `host_value` for `arrays`: each spec's tensor in HF layout and `dtype`, whole on this host."""
    np_dtype = resolve_dtype(dtype)
    _check_shapes(arrays, specs)
    return lambda spec: _hf_host_value(arrays[spec.path], spec, np_dtype)


def _check_shapes(arrays: Mapping[Path_, jax.Array], specs: Sequence[TensorSpec]) -> None:
    for spec in specs:
        shape = tuple(arrays[spec.path].shape)
        shape = shape if spec.layer is None else shape[1:]
        if shape != spec.jax_shape or (spec.layer is not None and spec.layer >= arrays[spec.path].shape[0]):
            raise WeightsError(
                f"export: {spec.hf_name} has shape {list(shape)}"
                f"{'' if spec.layer is None else f' (layer {spec.layer} of {arrays[spec.path].shape[0]})'}"
                f", expected {list(spec.jax_shape)}"
            )


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
    host_value: Callable[[TensorSpec], np.ndarray] | None = None,
) -> ExportResult | None:
    """Write `arrays` as a complete HF directory at `out_dir` (`bridge.weights.write_version`, which documents
    the other arguments); None on process > 0. `host_value`: each spec's tensor in HF layout and the export
    dtype, whole on this host (default: `host_values(arrays, specs, dtype)`)."""
    return write_version(
        specs,
        host_value or host_values(arrays, specs, dtype),
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
