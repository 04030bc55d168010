"""The device mesh and the one table that maps logical axis names to mesh axes.

Every parameter and every constrained activation carries logical axis names (`embed`, `heads`, ...). This is
the only file that names a mesh axis (`data`, `fsdp`, `tensor`): change the table to change the parallelism.

- `data`: pure data parallelism (batch split, parameters replicated).
- `fsdp`: batch split AND parameters split along `embed` (ZeRO-3 style; XLA all-gathers them per layer).
- `tensor`: Megatron-style tensor parallelism over heads, the MLP's inner dimension and the vocabulary.

A logical axis whose size is not divisible by its mesh axes is replicated instead (e.g. 2 KV heads on a
tensor axis of 4): correct everywhere, and visible in `describe_shardings`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axes (None: replicated). Read top to bottom: that is the whole sharding policy.
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # parameters
    ("layers", None),  # the stacked layer axis of scanned layers: every device holds its slice of each layer
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
    ("lora_rank", None),  # a LoRA adapter's rank: small, never split; its other axis shards like the kernel's
    # activations
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
)


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over `devices` (default: all) with axes (data, fsdp, tensor); one size may be -1 (the rest)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    free = [k for k, v in sizes.items() if v == -1]
    if len(free) > 1:
        raise ValueError(f"mesh: at most one axis may be -1, got {sizes}")
    if any(v == 0 or v < -1 for v in sizes.values()):
        raise ValueError(f"mesh: axis sizes must be positive or -1, got {sizes}")
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if free:
        if len(devices) % fixed:
            raise ValueError(f"mesh: {len(devices)} devices are not divisible by the fixed axes {sizes}")
        sizes[free[0]] = len(devices) // fixed
    if math.prod(sizes.values()) != len(devices):
        raise ValueError(
            f"mesh: data*fsdp*tensor = {math.prod(sizes.values())} ({sizes}) but there are {len(devices)} devices"
        )
    shape = tuple(sizes[a] for a in MESH_AXES)
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES)


def logical_to_spec(
    axes: Sequence[str | None],
    shape: Sequence[int] | None = None,
    mesh: Mesh | None = None,
    rules: Sequence[tuple[str, str | tuple[str, ...] | None]] = LOGICAL_AXIS_RULES,
) -> PartitionSpec:
    """PartitionSpec for an array with these logical axes.

    With `shape` and `mesh`, a dimension that its mesh axes do not divide is replicated, and a mesh axis
    is used at most once per array (first dimension wins).
    """
    table: Mapping[str, str | tuple[str, ...] | None] = dict(rules)
    used: set[str] = set()
    out: list[str | tuple[str, ...] | None] = []
    for i, name in enumerate(axes):
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise KeyError(f"logical axis {name!r} has no rule in LOGICAL_AXIS_RULES ({', '.join(table)})")
        target = table[name]
        mesh_axes = () if target is None else ((target,) if isinstance(target, str) else tuple(target))
        mesh_axes = tuple(a for a in mesh_axes if a not in used)
        if mesh is not None:
            mesh_axes = tuple(a for a in mesh_axes if mesh.shape[a] > 1)
            if shape is not None and shape[i] % math.prod(mesh.shape[a] for a in mesh_axes):
                mesh_axes = ()
        used.update(mesh_axes)
        out.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*out)


def named_sharding(mesh: Mesh, axes: Sequence[str | None], shape: Sequence[int]) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(axes, shape, mesh))


def param_shardings(state, mesh: Mesh):
    """The NamedSharding of every nnx.Param of an (abstract) nnx.State, from its `axes` metadata.

    The result has the structure of `state` (each Variable now holds its sharding), so it can be zipped with
    the parameters by `jax.tree.map` or passed as `out_shardings`.
    """
    from flax import nnx

    def one(var):
        axes = var.get_metadata().get("axes")
        if axes is None:
            raise ValueError(f"parameter of shape {var.get_value().shape} has no logical `axes` metadata")
        return var.replace(named_sharding(mesh, axes, var.get_value().shape))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """Sharding constraint by logical names; a no-op outside `jax.set_mesh(mesh)`."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(axes, x.shape, mesh))


def describe_shardings(state) -> dict[str, str]:
    """{param path: partition spec} for logs and tests."""
    from flax import nnx

    flat = {}
    for path, var in nnx.to_flat_state(state):
        sharding = getattr(var.get_value(), "sharding", None)
        flat["/".join(map(str, path))] = str(getattr(sharding, "spec", sharding))
    return flat
