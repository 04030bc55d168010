"""`intellect plan CONFIG [--devices N] [--device-memory-gib G] [--micro-batches M] [--depth-from L]`: will the
learner fit?

Prints, per device of the configured mesh, the bytes of parameters, optimizer state, the batch and the train
step's temporaries, from XLA's memory analysis of the compiled step on abstract arrays (`jax_trainer.plan`:
nothing is allocated, so a 32B model's plan runs on a laptop), and whether the peak fits the device memory
given. The model's shape comes from `model.path`'s config.json (only that file is read). With no accelerator
here, `--devices N` compiles for N fake CPU devices: XLA:CPU's memory analysis then stands in for the GPU's, an
estimate of the same program's buffers (fusion and layout choices differ per backend; XLA:CPU's peak was 1.4x
XLA:TPU's for the Qwen2.5-0.5B recipe and 2.9x for QwQ-32B's, benchmarks/RESULTS.md). Models
with scanned layers compile at their full depth (the scanned program holds one layer). `model.scan_layers =
"auto"` (the default) resolves as `intellect train` would resolve it here: unrolled on CPU devices, so a plan
made on CPU for an accelerator's scanned program says `--model.scan_layers true`. Unrolled models deeper than
`--depth-from` layers (default 8) are compiled at that depth and at twice it, and extrapolated linearly in depth
(their compile would otherwise take long on one host); the plan says when it did.

`--topology NAME` (`v5p-8`, `v5p-128`, `v6e-8`, `v5e-16`, or a libtpu topology such as `v5p:4x4x4`;
`jax_trainer.topology`) compiles the step for that TPU slice with XLA:TPU, from any host with libtpu installed
(`make install` installs it): the recipe's mesh over the slice's compile-only devices, and every choice made per
backend (attention "auto" = splash, scan_layers "auto" = scanned, remat offload to pinned host memory, the XLA
flag set) made for TPU. It prints XLA:TPU's memory analysis per chip against the chip's HBM, the step's FLOPs and
bytes per chip from the cost analysis scaled to the full depth (`jax_trainer.step_cost`), the roofline time
they imply, the compile time and the attention kernel found in the compiled program. A plan that does not fit
exits 1 and names the figure to change.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", type=Path, nargs="?", default=None, help="TOML recipe")
    p.add_argument(
        "--devices",
        type=int,
        default=None,
        help="plan for this many devices (fake CPU devices when there is no accelerator); default: "
        "the product of trainer.data/fsdp/tensor, or the local devices when one is -1",
    )
    p.add_argument("--device-memory-gib", type=float, default=None, help="memory of one device, to say if it fits")
    p.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        help="micro-batches per step (default trainer.micro_batches, else 1: memory depends on one)",
    )
    p.add_argument(
        "--topology",
        default=None,
        help="compile for this TPU slice with XLA:TPU (needs libtpu): v5p-8, v5p-128, v6e-8, v5e-16, v5p:4x4x4 ...",
    )
    p.add_argument(
        "--depth-from",
        type=int,
        default=8,
        help="unrolled models (model.scan_layers = false) deeper than this are compiled at this depth and twice it,"
        " then extrapolated",
    )


def _devices_needed(cfg, requested: int | None) -> int | None:
    if requested:
        return requested
    sizes = (cfg.trainer.data, cfg.trainer.fsdp, cfg.trainer.tensor)
    return None if -1 in sizes else sizes[0] * sizes[1] * sizes[2]


def run(args: argparse.Namespace) -> int:
    from intellect.cli import config_from_args

    cfg = config_from_args(args)
    if args.topology:
        from intellect.plan_tpu import run_tpu

        return run_tpu(cfg, args)
    devices = _devices_needed(cfg, args.devices)
    if devices and os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":  # before jax starts a backend
        flags = [
            f
            for f in os.environ.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")
        ]
        os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    from jax_trainer import host, xla_flags

    # the XLA:CPU flags `intellect train` would pick (`jax_trainer.host.prepare`), so the plan is of its program
    retain = cfg.trainer.retain_host_memory
    if retain == "auto":
        retain = host.auto_retain(cfg.model.path)[0]
    xla_flags.apply("cpu", lean=not retain)
    import jax

    from intellect.learner_setup import lora_spec, mesh_from_config, trainer_for
    from jax_trainer.models import ModelConfig, abstract_model
    from jax_trainer.models.decoder import resolve_scan_layers
    from jax_trainer.plan import extrapolate_layers, plan_step

    config_path = Path(cfg.model.path) / "config.json"
    try:
        hf = json.loads(config_path.read_text())
    except FileNotFoundError:
        print(f"intellect plan: {config_path} not found: model.path must hold the model's config.json")
        return 2
    model_cfg = ModelConfig.from_hf(hf)
    mesh = mesh_from_config(cfg)
    t, m = cfg.trainer, cfg.model
    micro_batches = args.micro_batches or t.micro_batches or 1
    micro_batches = -(-micro_batches // t.steps_per_batch) * t.steps_per_batch
    scanned = resolve_scan_layers(m.scan_layers)  # "auto" as the learner resolves it on this backend

    def plan_at(layers: int):
        shaped = dataclasses.replace(model_cfg, num_layers=layers)
        model = abstract_model(shaped, m.param_dtype, m.compute_dtype, m.remat, scanned, m.scan_unroll, lora_spec(cfg))
        reference = model if cfg.loss.kl_coef and m.lora is None else None  # LoRA's reference is its own base
        return plan_step(trainer_for(cfg, model, mesh, reference), micro_batches, t.micro_batch_size, m.max_seq_len)

    depth = model_cfg.num_layers
    if not scanned and depth > 2 * args.depth_from:
        plan = extrapolate_layers(
            plan_at(args.depth_from), plan_at(2 * args.depth_from), depth, args.depth_from, 2 * args.depth_from
        )
    else:
        plan = plan_at(depth)
    device_bytes = int(args.device_memory_gib * 2**30) if args.device_memory_gib else None
    print(
        f"intellect plan: {cfg.model.path} ({model_cfg.model_type}, {depth} layers, hidden {model_cfg.hidden_size},"
        f" vocab {model_cfg.vocab_size}); {micro_batches} micro-batches of {t.micro_batch_size} x "
        f"{m.max_seq_len} tokens; params {m.param_dtype}, compute {m.compute_dtype}, remat {m.remat}, "
        f"{'scanned' if scanned else 'unrolled'} layers; "
        f"{jax.devices()[0].platform} analysis"
    )
    for line in plan.lines(device_bytes):
        print(line)
    return 0 if device_bytes is None or plan.fits(device_bytes) else 1
