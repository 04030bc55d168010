"""Compile targets: the platform a program is compiled for, and TPU slices as compile-only devices.

Every choice made per backend (attention kernel, `scan_layers = "auto"`, remat offload to pinned host memory,
XLA flags) follows `platform(mesh)`: the platform of the devices the program is compiled for, which is not the
host's when a CPU machine compiles for a TPU slice. `platform()` without a mesh reads the mesh in context
(`jax.set_mesh`), then falls back to `jax.default_backend()`.

TPU slices: `slice_spec(name)` reads the accelerator types users write and the topologies libtpu takes.
`v5p-N` and `v4-N` count TensorCores (two per chip, one JAX device per chip: v5p-8 is 4 chips, `v5p:2x2x1`);
`v6e-N` and `v5e-N` count chips (one core each). libtpu names (`v5p:4x4x4`, `v6e:2x4`) are accepted as they
are. `tpu_devices(name)` returns the slice's compile-only devices (`jax.experimental.topologies`): with libtpu
installed, XLA:TPU compiles for them on any host and reports the program's memory and cost; nothing can run
on them, so code that runs eagerly must never place an array there (build state with `jax.eval_shape` and
`ShapeDtypeStruct`s carrying `NamedSharding`s, and lower under `jax.set_mesh`).

Chip figures (Cloud TPU's published per-chip specifications):

| chip | HBM | bf16 peak | HBM bandwidth |
| --- | --- | --- | --- |
| v4 | 32 GiB | 275 TFLOP/s | 1228 GB/s |
| v5e | 16 GiB | 197 TFLOP/s | 819 GB/s |
| v5p | 95 GiB | 459 TFLOP/s | 2765 GB/s |
| v6e | 32 GiB | 918 TFLOP/s | 1640 GB/s |
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

import jax

GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def platform(mesh=None) -> str:
    """ "cpu", "gpu" or "tpu": of `mesh`'s devices (a `Mesh` or `AbstractMesh`), else of the mesh in context,
    else `jax.default_backend()`."""
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
    name = None
    if mesh is not None and not mesh.empty:
        if isinstance(mesh, jax.sharding.Mesh):
            name = mesh.devices.flat[0].platform
        else:
            device = getattr(mesh, "abstract_device", None)
            name = getattr(device, "platform", None)
    name = name or jax.default_backend()
    return "gpu" if name in GPU_PLATFORMS else name


def has_pinned_host(device=None) -> bool:
    """Whether `device` has pinned host memory apart from its own (GPU and TPU devices, compile-only TPU ones too),
    so that remat can offload activations there; never on CPU. Without `device`: whether the platform compiled for
    (`platform()`, also inside a jit, where no concrete device is at hand) is one that has it."""
    if device is None:
        return platform() in ("gpu", "tpu")
    return device.platform != "cpu" and "pinned_host" in {m.kind for m in device.addressable_memories()}


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU generation: libtpu's name, TensorCores per chip (v5p-N counts cores), HBM bytes, bf16 FLOP/s and
    HBM bytes/s per chip."""

    name: str
    cores: int
    hbm_bytes: int
    peak_flops: float
    hbm_bandwidth: float


CHIPS = {
    "v4": Chip("v4", 2, 32 * 2**30, 275e12, 1228e9),
    "v5e": Chip("v5e", 1, 16 * 2**30, 197e12, 819e9),
    "v5p": Chip("v5p", 2, 95 * 2**30, 459e12, 2765e9),
    "v6e": Chip("v6e", 1, 32 * 2**30, 918e12, 1640e9),
}
CHIP_ALIASES = {"v5litepod": "v5e", "v5": "v5p", "v6": "v6e"}  # other spellings of the generation

# chips -> physical shape of the slices users book (Cloud TPU's tables; MaxText's accelerator_to_spec_map)
SHAPES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8", 512: "8x8x8"}
SHAPES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}


@dataclasses.dataclass(frozen=True)
class SliceSpec:
    """A TPU slice: the name asked for, libtpu's topology name, its chip and chip count."""

    name: str
    topology: str
    chip: Chip
    chips: int


def slice_spec(name: str) -> SliceSpec:
    """The slice an accelerator type (`v5p-8`, `v6e-8`, `v5e-16`, `v4-8`) or libtpu topology (`v5p:2x2x1`)
    names; a ValueError that lists the accepted forms otherwise."""
    text = name.strip().lower()
    found = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", text) or re.fullmatch(r"(v\d+[a-z]*):(\d+(?:x\d+){1,2})", text)
    generation = CHIP_ALIASES.get(found.group(1), found.group(1)) if found else None
    if generation not in CHIPS:
        raise ValueError(
            f"topology {name!r}: not an accelerator type ({', '.join(f'{c}-N' for c in CHIPS)}, e.g. v5p-8, "
            f"v6e-8) or a libtpu topology (e.g. v5p:2x2x1, v6e:2x4)"
        )
    chip = CHIPS[generation]
    if ":" in text:
        dims = found.group(2)
        return SliceSpec(name, f"{generation}:{dims}", chip, math.prod(int(d) for d in dims.split("x")))
    count = int(found.group(2))
    if count % chip.cores:
        raise ValueError(f"topology {name!r}: {generation}-N counts TensorCores, {chip.cores} per chip")
    chips = count // chip.cores
    shapes = SHAPES_3D if chip.cores == 2 else SHAPES_2D
    if chips not in shapes:
        sizes = ", ".join(f"{generation}-{c * chip.cores}" for c in shapes)
        raise ValueError(
            f"topology {name!r}: no slice of {chips} chips in the table ({sizes}); give its shape, "
            f"e.g. {generation}:{next(iter(shapes.values()))}"
        )
    return SliceSpec(name, f"{generation}:{shapes[chips]}", chip, chips)


class LibtpuMissing(RuntimeError):
    """libtpu is not installed, so nothing can compile for a TPU on this host."""


def tpu_devices(name: str) -> tuple[SliceSpec, list]:
    """(the slice, its compile-only devices, one per chip). Needs libtpu (`pip install -e .[tpu-plan]`); the TPU
    VM metadata query is skipped and several processes may load libtpu at once (parallel tests)."""
    spec = slice_spec(name)
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "true")
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise LibtpuMissing(
            f"compiling for {name} needs libtpu, which is not installed: pip install -e '.[tpu-plan]' -c "
            "constraints.txt (the libtpu that jax pins; `make install` includes it)"
        ) from None
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(topology_name=spec.topology, platform="tpu").devices
    if len(devices) != spec.chips:
        raise ValueError(
            f"topology {name!r} ({spec.topology}): libtpu gave {len(devices)} devices for {spec.chips} chips"
        )
    return spec, list(devices)
