"""The learner's memory plan (`jax_trainer.plan`, `intellect plan`) on tiny models."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import jax
import numpy as np
from flax import nnx

from jax_trainer.config import LossConfig, OptimConfig
from jax_trainer.models import ModelConfig, abstract_model, init_random
from jax_trainer.plan import extrapolate_layers, plan_step
from jax_trainer.sharding import make_mesh
from jax_trainer.train_step import GRPOTrainer

CFG = ModelConfig(
    model_type="qwen2",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    qkv_bias=True,
    tie_embeddings=False,
)
OPTIM = OptimConfig(lr=1e-3, warmup_steps=0, grad_clip=1.0)


def _trainer(cfg, mesh, remat=False):
    return GRPOTrainer(abstract_model(cfg, remat=remat), mesh, LossConfig(), OPTIM)


def test_plan_counts_the_parameters_and_adam_moments_of_each_shard():
    one = make_mesh(fsdp=1, devices=jax.devices()[:1])
    concrete = init_random(CFG, mesh=one)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(concrete, nnx.Param)))
    plan = plan_step(_trainer(CFG, one), micro_batches=2, rows=2, seq_len=32)
    assert plan.params == 4 * n_params
    assert 2 * plan.params <= plan.opt_state <= 2 * plan.params + 1024  # mu and nu, plus step counters
    assert plan.batch == 7 * 4 * 2 * 2 * 32  # seven int32 / float32 arrays of [2, 2, 32]
    assert plan.temporaries >= plan.params  # the accumulated gradients at least
    assert plan.peak >= plan.params + plan.opt_state + plan.temporaries
    sharded = plan_step(_trainer(CFG, make_mesh(fsdp=-1)), micro_batches=2, rows=8, seq_len=32)
    assert sharded.devices == 8 and sharded.params < plan.params / 3  # fsdp shards what divides


def test_depth_extrapolation_matches_a_direct_compile():
    mesh = make_mesh(fsdp=1, devices=jax.devices()[:1])
    deep = dataclasses.replace(CFG, num_layers=3)
    plans = {
        n: plan_step(_trainer(dataclasses.replace(CFG, num_layers=n), mesh, remat=True), 1, 2, 64) for n in (1, 2, 3)
    }
    guess = extrapolate_layers(plans[1], plans[2], deep.num_layers, 1, 2)
    for field in ("params", "opt_state", "temporaries", "peak"):
        direct, extrapolated = getattr(plans[3], field), getattr(guess, field)
        assert abs(extrapolated - direct) <= 0.1 * direct, (field, direct, extrapolated)
    assert "extrapolated" in guess.lines()[0]


def test_plan_command_says_whether_it_fits(tiny_model):
    base = tiny_model()
    cmd = [sys.executable, "-m", "intellect", "plan", "configs/demo.toml", "--model.path", str(base)]
    fits = subprocess.run(cmd + ["--device-memory-gib", "4"], capture_output=True, text=True, timeout=300)
    assert fits.returncode == 0 and "fits in 4.00 GiB" in fits.stdout, fits.stdout + fits.stderr[-2000:]
    assert "parameters" in fits.stdout and "optimizer state" in fits.stdout and "step temporaries" in fits.stdout
    tight = subprocess.run(cmd + ["--device-memory-gib", "0.001"], capture_output=True, text=True, timeout=300)
    assert tight.returncode == 1 and "DOES NOT FIT" in tight.stdout, tight.stdout + tight.stderr[-2000:]


def test_the_update_holds_no_second_copy_of_the_state():
    """A step that may be skipped (non-finite loss) must not keep the old parameters and moments beside the new
    ones: with activations negligible (one row of 8 tokens), the temporaries are the gradients: 1.5x the
    parameters (2.1x with the learner's XLA:CPU fusion flags, which a process that ran `intellect train` first
    has), against 3.0x when old and new values were selected with `where`."""
    wide = dataclasses.replace(CFG, hidden_size=256, intermediate_size=512, num_layers=4, head_dim=64)
    one = make_mesh(fsdp=1, devices=jax.devices()[:1])
    plan = plan_step(_trainer(wide, one), micro_batches=2, rows=1, seq_len=8)
    assert plan.params <= plan.temporaries < 2.5 * plan.params, (plan.temporaries, plan.params)


def test_a_cpu_plan_adds_the_host_runtime_to_its_devices_peaks():
    """On CPU devices the host's memory is every device's: the plan's host total is the local devices' peaks
    plus the process's runtime, which is its resident set less the arrays it holds (so arrays allocated in
    between, sharded or replicated, do not move it)."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from jax_trainer.plan import runtime_bytes

    two = make_mesh(fsdp=2, devices=jax.devices()[:2])
    plan = plan_step(_trainer(CFG, two), micro_batches=1, rows=2, seq_len=16)
    assert plan.host_devices == 2
    assert 50 << 20 < plan.host_runtime < 8 << 30
    assert any(line.split()[:2] == ["this", "host"] for line in plan.lines())
    before = runtime_bytes()
    sharded = jax.device_put(jnp.ones((64 << 20) // 4, jnp.float32), NamedSharding(two, PartitionSpec("fsdp")))
    replicated = jax.device_put(jnp.ones((32 << 20) // 4, jnp.float32), NamedSharding(two, PartitionSpec()))
    jax.block_until_ready((sharded, replicated))
    np.testing.assert_allclose(runtime_bytes(), before, atol=24 << 20)  # 128 MiB were allocated
    del sharded, replicated


def test_lora_plan_counts_the_frozen_base_and_the_adapters_moments_alone():
    from jax_trainer.models.lora import LoraSpec

    mesh = make_mesh(fsdp=4, tensor=2)
    lora = LoraSpec(4, 8.0, ("q", "k", "v", "o", "gate", "up", "down"))
    full = plan_step(_trainer(CFG, mesh), 1, 8, 64)
    model = abstract_model(CFG, lora=lora)
    adapted = plan_step(GRPOTrainer(model, mesh, LossConfig(), OPTIM), 1, 8, 64)
    adapters = sum(
        int(np.prod(x.sharding.shard_shape(x.shape))) * 4
        for x in jax.tree.leaves(GRPOTrainer(model, mesh, LossConfig(), OPTIM).abstract_state().params)
    )
    assert adapted.params == full.params + adapters  # the frozen base, sharded as before, plus the adapters
    # Adam's two moments of the adapters alone, and the optimizer's step counters
    assert 2 * adapters <= adapted.opt_state <= 2 * adapters + 16 and adapted.opt_state < full.opt_state / 3
