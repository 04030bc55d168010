"""One GRPO step on a tiny random model, printed as JSON; run by test_multihost.py in 1 or 2 processes.

python multihost_step.py PROCESS_ID NUM_PROCESSES PORT     (XLA_FLAGS sets the local CPU device count)
"""

import json
import sys

import jax
import numpy as np


def main() -> None:
    pid, nproc, port = (int(a) for a in sys.argv[1:4])
    if nproc > 1:
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=nproc, process_id=pid)
    from flax import nnx

    from jax_trainer.config import LossConfig, OptimConfig
    from jax_trainer.models import ModelConfig, init_random
    from jax_trainer.sharding import make_mesh
    from jax_trainer.source import InMemorySource, Rollout
    from jax_trainer.train_step import GRPOTrainer

    cfg = ModelConfig(
        model_type="qwen2",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        qkv_bias=True,
    )

    def rollouts(position):
        rng = np.random.default_rng(position)
        return [
            Rollout(
                rng.integers(0, 96, 20).astype(np.int32),
                4,
                np.r_[np.zeros(4), -rng.random(16)].astype(np.float32),
                float(rng.random()),
                i // 4,
                0,
            )
            for i in range(16)
        ]

    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    model = init_random(cfg, mesh=mesh, seed=0)
    trainer = GRPOTrainer(model, mesh, LossConfig(), OptimConfig(lr=1e-3, warmup_steps=0, grad_clip=1.0))
    state = trainer.init_state(nnx.split(model)[1])
    source = InMemorySource(rollouts, rows=8, seq_len=64, async_level=9)
    losses = []
    for _ in range(2):
        state, metrics = trainer.step(state, trainer.device_batch(source.next(0).packed))
        losses.append(float(np.asarray(metrics["loss"].addressable_data(0))))
    print(
        json.dumps(
            {
                "process": jax.process_index(),
                "processes": jax.process_count(),
                "devices": jax.device_count(),
                "losses": losses,
            }
        ),
        flush=True,
    )
    if nproc > 1:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
