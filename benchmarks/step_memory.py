"""How much one learner step grows the process, against the temporaries XLA planned for it; printed as JSON.

Runs `GRPOTrainer.step` (remat, float32, `logprob_source = "recompute"`) on random weights of MODEL_DIR's shape,
optionally cut to `--layers`, over `--devices` fake CPU devices, with the XLA:CPU flags the learner picks
(`--lean`: without YNNPACK fusion, as without host memory retention; `--ynn TYPES` sets the fusion types
explicitly). The resident set is sampled every 5 ms during each step; the growth over the resident set before
the step (after handing freed memory back) is what the step allocated, planned or not.

    python benchmarks/step_memory.py MODEL_DIR [--layers 8] [--devices 2] [--lean] [--chunk 32] [--steps 1]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--layers", type=int, default=None, help="cut the model to this depth (default: all)")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--lean", action="store_true", help="the learner's flags without host memory retention")
    ap.add_argument("--ynn", default=None, help="--xla_cpu_experimental_ynn_fusion_type value ('' = none)")
    ap.add_argument("--chunk", type=int, default=128, help="trainer.logprob_chunk")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq", type=int, default=160)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=1)
    args = ap.parse_args()

    flags = [f"--xla_force_host_platform_device_count={args.devices}"]
    if args.ynn is not None:
        flags.append(f"--xla_cpu_experimental_ynn_fusion_type={args.ynn}")
    os.environ["XLA_FLAGS"] = " ".join(flags)
    sys.path.insert(0, str(ROOT))
    from jax_trainer import host, xla_flags

    xla_flags.apply("cpu", lean=args.lean)
    import jax
    import numpy as np
    from flax import nnx

    from jax_trainer.config import LossConfig, OptimConfig, TrainerConfig
    from jax_trainer.models import ModelConfig, init_random
    from jax_trainer.plan import plan_of
    from jax_trainer.sharding import make_mesh
    from jax_trainer.train_step import GRPOTrainer

    hf = json.loads((args.model / "config.json").read_text())
    if args.layers:
        hf["num_hidden_layers"] = args.layers
    cfg = ModelConfig.from_hf(hf)
    mesh = make_mesh(fsdp=-1)
    model = init_random(cfg, mesh, "float32", "float32", remat=True)
    rows = args.samples // args.micro_batches
    trainer = GRPOTrainer(
        model,
        mesh,
        LossConfig(logprob_source="recompute"),
        OptimConfig(lr=1e-6, warmup_steps=0, grad_clip=1.0),
        TrainerConfig(micro_batch_size=rows, micro_batches=args.micro_batches, logprob_chunk=args.chunk),
    )
    state = trainer.init_state(nnx.split(model)[1])
    del model
    rng = np.random.default_rng(0)
    batch = {}
    for key, spec in trainer.abstract_batch(args.micro_batches, rows, args.seq).items():
        shape = spec.shape
        if key == "tokens":
            value = rng.integers(0, cfg.vocab_size, shape, dtype=np.int32)
        elif key == "positions":
            value = np.broadcast_to(np.arange(args.seq, dtype=np.int32), shape).copy()
        elif key in ("segment_ids", "loss_mask"):
            value = np.ones(shape, np.int32 if key == "segment_ids" else np.float32)
        elif key == "completion_lens":
            value = np.full(shape, float(args.seq), np.float32)
        elif key == "inference_logprobs":
            value = np.full(shape, -5.0, np.float32)
        else:  # advantages
            value = rng.standard_normal(shape).astype(np.float32)
        batch[key] = jax.device_put(value, spec.sharding)

    compiled = trainer.jitted_step(state, batch).lower(state, batch, None).compile()
    plan = plan_of(compiled, mesh, state, batch)
    trainer._compiled[batch["tokens"].shape] = compiled
    report = {
        "layers": cfg.num_layers,
        "devices": args.devices,
        "xla_flags": os.environ["XLA_FLAGS"],
        "chunk": args.chunk,
        "planned_temporaries_gib": round(plan.temporaries * args.devices / 2**30, 3),
        "plan_host_gib": round(plan.host_peak / 2**30, 3),
        "steps": [],
    }
    for _ in range(args.steps):
        host.release_freed_memory()
        base = host.resident_bytes()
        peak, stop = [base], threading.Event()

        def sample(peak=peak, stop=stop):
            while not stop.is_set():
                peak[0] = max(peak[0], host.resident_bytes())
                time.sleep(0.005)

        sampler = threading.Thread(target=sample)
        sampler.start()
        t0 = time.perf_counter()
        state, metrics = trainer.step(state, batch)
        jax.block_until_ready((state, metrics))
        seconds = time.perf_counter() - t0
        stop.set()
        sampler.join()
        report["steps"].append(
            {
                "s": round(seconds, 1),
                "before_gib": round(base / 2**30, 3),
                "growth_gib": round((peak[0] - base) / 2**30, 3),
                "peak_gib": round(peak[0] / 2**30, 3),
            }
        )
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
