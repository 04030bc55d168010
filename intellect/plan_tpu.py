"""`intellect plan CONFIG --topology NAME`: the learner's step compiled for a TPU slice by XLA:TPU, on any host.

The slice's devices are compile-only (`jax_trainer.topology.tpu_devices`, libtpu needed): the recipe's mesh is
laid over them, the model and optimizer state are abstract (`ShapeDtypeStruct`s with `NamedSharding`s), and the
very step `intellect train` runs is lowered under that mesh and compiled. What it prints per chip: XLA:TPU's
memory analysis (parameters, optimizer state, temporaries, peak) against the chip's HBM; the step's FLOPs and
bytes from the cost analysis scaled to the full depth (`jax_trainer.step_cost`, two extra 1- and 2-layer
compiles) and the roofline time; the compile time; the attention kernel in the compiled program.
`plan_tpu(cfg, topology)` returns the same figures as a dict (`benchmarks/tpu_compile.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path


def _fit_advice(state_bytes: int, temporaries: str, hbm: int, cfg, mesh: dict) -> str:
    """Which figure to change when the step does not fit: the state (parameters and optimizer state per chip), or
    the step's temporaries (`temporaries`: their size as the plan or the compiler states it)."""
    t, m = cfg.trainer, cfg.model
    if state_bytes > 0.8 * hbm:
        return (
            f"parameters and optimizer state alone take {state_bytes / 2**30:.1f} GiB per chip: raise trainer.fsdp "
            f"({mesh['fsdp']}) or trainer.tensor ({mesh['tensor']}) over a larger slice, or lower model.param_dtype"
        )
    hint = "" if m.remat == "full" else f', or set model.remat = "full" (now {m.remat!r})'
    return (
        f"the step's temporaries ({temporaries}) are mostly activations of trainer.micro_batch_size = "
        f"{t.micro_batch_size} rows of model.max_seq_len = {m.max_seq_len} tokens over data x fsdp = "
        f"{mesh['data']} x {mesh['fsdp']}: lower trainer.micro_batch_size{hint}"
    )


def _advice(plan, hbm: int, cfg) -> str:
    return _fit_advice(
        plan.params + plan.opt_state, f"{plan.temporaries / 2**30:.1f} GiB per chip", hbm, cfg, plan.mesh
    )


def _out_of_memory(exc: Exception) -> str | None:
    """XLA:TPU's own refusal of a program that cannot fit the chip (its first line), else None."""
    text = str(exc)
    return text.splitlines()[0] if "RESOURCE_EXHAUSTED" in text else None


def plan_tpu(cfg, topology: str, micro_batches: int | None = None, cost: bool = True) -> dict:
    """The plan of `cfg`'s learner step on the TPU slice `topology` (see the module docstring)."""
    from intellect.learner_setup import lora_spec, trainer_for
    from jax_trainer import step_cost
    from jax_trainer import topology as topo
    from jax_trainer.models import ModelConfig, abstract_model
    from jax_trainer.models.decoder import remat_name, resolve_scan_layers
    from jax_trainer.plan import _shard_bytes, compile_step, plan_of
    from jax_trainer.sharding import make_mesh

    spec, devices = topo.tpu_devices(topology)
    t, m = cfg.trainer, cfg.model
    mesh = make_mesh(t.data, t.fsdp, t.tensor, devices=devices)
    platform = topo.platform(mesh)
    config_path = Path(m.path) / "config.json"
    try:
        hf = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{config_path} not found: model.path must hold the model's config.json") from None
    model_cfg = dataclasses.replace(ModelConfig.from_hf(hf), attention=m.attention)
    micro = micro_batches or t.micro_batches or 1
    micro = -(-micro // t.steps_per_batch) * t.steps_per_batch
    scanned = resolve_scan_layers(m.scan_layers, platform)

    def trainer_at(layers: int, scan: bool, c=cfg):
        shaped = dataclasses.replace(model_cfg, num_layers=layers)
        model = abstract_model(shaped, m.param_dtype, m.compute_dtype, m.remat, scan, m.scan_unroll, lora_spec(c))
        return trainer_for(c, model, mesh, model if c.loss.kl_coef and c.model.lora is None else None)

    def compiled_at(layers: int, scan: bool, c=cfg, mb: int = micro, options=None):
        return compile_step(trainer_at(layers, scan, c), mb, c.trainer.micro_batch_size, m.max_seq_len, options)

    shape = {  # what was compiled, in the report whether it fits or not
        "topology": topology,
        "libtpu_topology": spec.topology,
        "chips": spec.chips,
        "mesh": dict(mesh.shape),
        "layers": model_cfg.num_layers,
        "scanned": scanned,
        "micro_batches": micro,
        "rows": t.micro_batch_size,
        "seq_len": m.max_seq_len,
    }
    t0 = time.perf_counter()
    try:
        compiled, _, state, batch, frozen = compiled_at(model_cfg.num_layers, scanned)
    except Exception as exc:  # XLA:TPU refuses a program that cannot fit, as it would on the slice
        refusal = _out_of_memory(exc)
        if refusal is None:
            raise
        trainer = trainer_at(model_cfg.num_layers, scanned)
        state, frozen = trainer.abstract_state(), trainer.abstract_frozen()
        state_bytes = _shard_bytes(state.params) + _shard_bytes(state.opt_state)
        state_bytes += _shard_bytes(frozen) if frozen is not None else 0
        return {
            **shape,
            "compile_s": round(time.perf_counter() - t0, 1),
            "plan": None,
            "hbm_bytes": spec.chip.hbm_bytes,
            "fits": False,
            "compiler": refusal,
            "state_bytes": state_bytes,
            "advice": _fit_advice(
                state_bytes, "the compiler's figure above", spec.chip.hbm_bytes, cfg, dict(mesh.shape)
            ),
        }
    compile_s = time.perf_counter() - t0
    plan = plan_of(compiled, mesh, state, batch, frozen)
    kernels = step_cost.mosaic_calls(compiled)
    out = {
        **shape,
        "compile_s": round(compile_s, 1),
        "attention": "splash" if kernels else "xla",
        "mosaic_calls": kernels,
        "plan": plan,
        "hbm_bytes": spec.chip.hbm_bytes,
        "fits": plan.fits(spec.chip.hbm_bytes),
        "advice": None if plan.fits(spec.chip.hbm_bytes) else _advice(plan, spec.chip.hbm_bytes, cfg),
    }
    if cost and out["fits"]:  # the cost of a step that cannot run is not worth two more compiles
        one_chunk = cfg.model_copy(
            update={
                "trainer": t.model_copy(
                    update={"logprob_chunk": m.max_seq_len, "steps_per_batch": 1, "micro_batches": 1}
                )
            }
        )
        # one row per batch shard: the compiles of the full vocabulary's logits at whole rows stay small
        shards = mesh.shape["data"] * mesh.shape["fsdp"]
        one_chunk = one_chunk.model_copy(
            update={"trainer": one_chunk.trainer.model_copy(update={"micro_batch_size": shards})}
        )
        programs = [compiled_at(n, False, one_chunk, 1, step_cost.COST_OPTIONS)[0] for n in (1, 2)]
        figures = [step_cost.analysed(p) for p in programs]
        out["cost_loops"] = max(step_cost.loops(p) for p in programs)
        rows = max(t.micro_batch_size // shards, 1)
        costs = step_cost.scale_layers(figures[0], figures[1], model_cfg.num_layers, micro, rows)
        if kernels:
            heads = model_cfg.num_heads
            if model_cfg.num_heads % mesh.shape["tensor"] == 0 and model_cfg.num_kv_heads % mesh.shape["tensor"] == 0:
                heads //= mesh.shape["tensor"]
            attention = step_cost.splash_flops(
                rows, m.max_seq_len, heads, model_cfg.head_dim, model_cfg.num_layers, remat_name(m.remat) != "none"
            )
            costs = dataclasses.replace(costs, attention_flops=micro * attention)
        out["cost"] = costs
        out["roofline_s"] = costs.roofline_s(spec.chip.peak_flops, spec.chip.hbm_bandwidth)
        out["roofline_with_kernels_s"] = costs.roofline_s(spec.chip.peak_flops, spec.chip.hbm_bandwidth, True)
    return out


def lines(result: dict, cfg) -> list[str]:
    """The printed plan."""
    from jax_trainer.topology import slice_spec

    chip = slice_spec(result["topology"]).chip
    m = cfg.model
    plan = result["plan"]
    out = [
        f"intellect plan: {m.path} ({result['layers']} layers, {'scanned' if result['scanned'] else 'unrolled'}) "
        f"on {result['topology']} ({result['libtpu_topology']}, {result['chips']} chips); {result['micro_batches']} "
        f"micro-batches of {result['rows']} x {result['seq_len']} tokens; params {m.param_dtype}, compute "
        f"{m.compute_dtype}, remat {m.remat}; XLA:TPU analysis",
    ]
    if plan is None:
        out.append(f"  XLA:TPU refused the program after {result['compile_s']:.1f} s: {result['compiler']}")
        out += [
            f"  parameters and optimizer state {result['state_bytes'] / 2**30:.2f} GiB per chip",
            f"  DOES NOT FIT in {result['hbm_bytes'] / 2**30:.2f} GiB per chip",
        ]
    else:
        out.append(
            f"  compiled in {result['compile_s']:.1f} s; attention {result['attention']}"
            + (f" ({result['mosaic_calls']} Mosaic tpu_custom_call in the program)" if result["mosaic_calls"] else "")
        )
        out += [line.replace("per device", "per chip") for line in plan.lines(result["hbm_bytes"])]
    cost = result.get("cost")
    if cost is not None:
        out += [
            f"  FLOPs per step    {cost.flops:.3e} per chip ({cost.layer_flops:.3e} per layer and row; XLA's cost "
            "analysis scaled to the full depth"
            + (
                f"; a lower bound: {result['cost_loops']} loops left in the analysed programs)"
                if result["cost_loops"]
                else ")"
            ),
            f"  bytes per step    {cost.bytes:.3e} to {cost.bytes_high:.3e} per chip (weights read once per "
            "micro-batch / once per row)",
            f"  roofline          {1e3 * result['roofline_s']:.2f} ms per step ({chip.peak_flops / 1e12:.0f} TFLOP/s, "
            f"{chip.hbm_bandwidth / 1e9:.0f} GB/s per chip; no collectives, no overlap losses)",
        ]
        if cost.attention_flops:
            out.append(
                f"  left out          Pallas kernels: splash attention's ~{cost.attention_flops:.3e} FLOPs per chip "
                f"(estimated; roofline with them {1e3 * result['roofline_with_kernels_s']:.2f} ms)"
            )
    if not result["fits"]:
        out.append(f"  to fit: {result['advice']}")
    return out


def run_tpu(cfg, args: argparse.Namespace) -> int:
    import os

    if args.devices:
        print("intellect plan: --devices is for CPU planning; --topology gives the slice's devices")
        return 2
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the host runs nothing: the TPU devices are compile-only
    from jax_trainer import xla_flags
    from jax_trainer.topology import LibtpuMissing, slice_spec

    try:
        slice_spec(args.topology)
    except ValueError as exc:
        print(f"intellect plan: {exc}")
        return 2
    xla_flags.apply("tpu")  # the flag set of the platform compiled for, not of this host
    try:
        result = plan_tpu(cfg, args.topology, args.micro_batches)
    except (LibtpuMissing, FileNotFoundError) as exc:
        print(f"intellect plan: {exc}")
        return 2
    if args.device_memory_gib and result["plan"] is not None:
        result["hbm_bytes"] = int(args.device_memory_gib * 2**30)
        result["fits"] = result["plan"].fits(result["hbm_bytes"])
        result["advice"] = None if result["fits"] else _advice(result["plan"], result["hbm_bytes"], cfg)
    for line in lines(result, cfg):
        print(line)
    return 0 if result["fits"] else 1
