"""The learner's memory plan: per-device bytes of one train step, from XLA's analysis of the compiled step.

`plan_step(trainer, micro_batches, rows, seq_len)` lowers and compiles the very step `GRPOTrainer.step` runs,
on abstract arrays (`jax.ShapeDtypeStruct`s carrying their shardings: nothing is allocated), and reads the
compiled executable's memory analysis. Per device:

- parameters and optimizer state: the bytes of each array's shard on that device (the state is donated, so
  the new state reuses these buffers); with LoRA, parameters count the frozen base and the adapters, the
  optimizer state the adapters' moments alone;
- batch: the packed micro-batches' shard;
- temporaries: XLA's temporary buffers of the whole step (gradient accumulators, activations of the
  micro-batch being processed, recomputed activations under remat, logits chunks, optimizer update);
- peak: arguments + temporaries + outputs not aliased to an argument, XLA's own estimate of the step's
  footprint.

On CPU devices (fake ones included) every device's memory is the host's, so the plan adds the host's total:
the local devices' peaks plus the process's own runtime (interpreter, libraries, the compiled step), measured
in the planning process once the step is compiled. XLA:CPU also allocates some memory outside its buffer
assignment (inside library calls such as YNNPACK's fused matmuls) that no analysis of the program shows.

The largest models compile slowly on one host (every layer is its own HLO), so `plan_step` can compile two
shallow copies of the model (`layers` and 2 x `layers` deep) and extrapolate each figure linearly in depth:
`extrapolate_layers` does that and says so in the plan.
"""

from __future__ import annotations

import dataclasses
import math

import jax


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-device bytes of one train step."""

    devices: int
    mesh: dict[str, int]
    params: int
    opt_state: int
    batch: int
    temporaries: int
    outputs_not_aliased: int
    peak: int
    note: str = ""
    host_devices: int = 0  # CPU devices of this process, which share the host's memory (0: accelerators)
    host_runtime: int = 0  # the process's resident bytes besides its arrays, measured after compiling

    @property
    def host_peak(self) -> int:
        """The process's peak on a CPU host: every local device's peak plus the runtime (0 on accelerators)."""
        return self.host_devices * self.peak + self.host_runtime if self.host_devices else 0

    def fits(self, device_bytes: int) -> bool:
        return self.peak <= device_bytes

    def lines(self, device_bytes: int | None = None) -> list[str]:
        mesh = " x ".join(f"{k} {v}" for k, v in self.mesh.items())
        out = [
            f"memory plan per device ({self.devices} device{'s' if self.devices > 1 else ''}: {mesh})"
            f"{' ' + self.note if self.note else ''}:",
            f"  parameters        {_size(self.params)}",
            f"  optimizer state   {_size(self.opt_state)}",
            f"  batch             {_size(self.batch)}",
            f"  step temporaries  {_size(self.temporaries)}  (gradients, activations, updates)",
            f"  peak              {_size(self.peak)}",
        ]
        if self.host_devices:
            out.append(
                f"  this host         {_size(self.host_peak)}  ({self.host_devices} CPU device"
                f"{'s' if self.host_devices > 1 else ''} x peak + {_size(self.host_runtime).strip()} of runtime)"
            )
        if device_bytes:
            verdict = "fits" if self.fits(device_bytes) else "DOES NOT FIT"
            out.append(
                f"  {verdict} in {_size(device_bytes).strip()} per device ({100 * self.peak / device_bytes:.0f}% used)"
            )
        return out


def _size(n: int) -> str:
    return f"{n / 2**30:9.2f} GiB" if n >= 2**30 else f"{n / 2**20:9.1f} MiB"


def _shard_bytes(tree) -> int:
    """Bytes of one device's shards of the arrays (ShapeDtypeStructs with shardings) in `tree`."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
        total += math.prod(shape) * leaf.dtype.itemsize
    return total


def plan_step(trainer, micro_batches: int, rows: int, seq_len: int) -> MemoryPlan:
    """The memory plan of `trainer`'s step on batches of [micro_batches, rows, seq_len] (nothing allocated; a
    trainer with a KL reference gets an abstract one in its place, so use a trainer built for planning)."""
    return plan_of(*compile_step(trainer, micro_batches, rows, seq_len))


def compile_step(trainer, micro_batches: int, rows: int, seq_len: int, compiler_options: dict | None = None):
    """(compiled step, mesh, abstract state, abstract batch): `trainer`'s step compiled on abstract arrays for
    its mesh's devices, which may be compile-only ones (`jax_trainer.topology.tpu_devices`), with XLA
    `compiler_options` if given."""
    state = trainer.abstract_state()
    batch = trainer.abstract_batch(micro_batches, rows, seq_len)
    reference = None
    if trainer.ref_params is not None:  # the KL reference: the same shapes and shardings as the parameters
        trainer.ref_params = reference = state.params
    frozen = trainer.abstract_frozen()
    compiled = trainer.lower(state, batch, reference, frozen).compile(compiler_options=compiler_options)
    return compiled, trainer.mesh, state, batch, frozen


def plan_of(compiled, mesh, state, batch, frozen=None) -> MemoryPlan:
    """The plan of an already compiled step (`GRPOTrainer.step` logs it when it compiles); `frozen`: the frozen
    base under LoRA adapters, counted with the parameters."""
    analysis = compiled.memory_analysis()
    arguments = analysis.argument_size_in_bytes
    outputs = analysis.output_size_in_bytes - analysis.alias_size_in_bytes
    temporaries = analysis.temp_size_in_bytes
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    on_host = bool(local) and all(d.platform == "cpu" for d in local)
    return MemoryPlan(
        devices=mesh.size,
        mesh=dict(mesh.shape),
        params=_shard_bytes(state.params) + (_shard_bytes(frozen) if frozen is not None else 0),
        opt_state=_shard_bytes(state.opt_state),
        batch=_shard_bytes(batch),
        temporaries=temporaries,
        outputs_not_aliased=outputs,
        peak=arguments + temporaries + outputs,
        host_devices=len(local) if on_host else 0,
        host_runtime=runtime_bytes() if on_host else 0,
    )


def runtime_bytes() -> int:
    """This process's resident bytes besides the jax arrays it holds (interpreter, libraries, compiled programs),
    after handing what the C allocator holds free back to the system (`jax_trainer.host`)."""
    from jax_trainer import host

    host.release_freed_memory()
    arrays = sum(shard.data.nbytes for x in jax.live_arrays() for shard in x.addressable_shards)
    return max(host.resident_bytes() - arrays, 0)


def extrapolate_layers(
    shallow: MemoryPlan, deeper: MemoryPlan, layers: int, shallow_layers: int, deeper_layers: int
) -> MemoryPlan:
    """Each figure of a `layers`-deep model, linear in depth through two plans of shallower copies."""

    def at(a: int, b: int) -> int:
        per_layer = (b - a) / (deeper_layers - shallow_layers)
        return int(round(a + per_layer * (layers - shallow_layers)))

    return MemoryPlan(
        devices=shallow.devices,
        mesh=shallow.mesh,
        params=at(shallow.params, deeper.params),
        opt_state=at(shallow.opt_state, deeper.opt_state),
        batch=shallow.batch,
        temporaries=at(shallow.temporaries, deeper.temporaries),
        outputs_not_aliased=at(shallow.outputs_not_aliased, deeper.outputs_not_aliased),
        peak=at(shallow.peak, deeper.peak),
        host_devices=deeper.host_devices,
        host_runtime=deeper.host_runtime,
        note=f"[{layers} layers, extrapolated from compiled {shallow_layers}- and {deeper_layers}-layer copies]",
    )
