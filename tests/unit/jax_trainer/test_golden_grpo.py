"""A golden GRPO curve: a small, fixed, on-policy run whose per-step loss and reward are kept in
`golden/grpo_curve.json`, so that any change to the numbers (the loss, the advantages, the packing, the
optimizer, the schedule, the model) fails here rather than showing up later as a different learning curve.

The run: a 2-layer llama-shaped model (vocab 16) from a fixed seed, on one CPU device (sums reduced across
fake devices arrive in any order, and AdamW's first step turns such last-bit differences of near-zero gradients
into whole steps: on 8 devices a loaded CI host moved the first loss by 0.9 %); one fixed prompt; each step
samples 32 completions of one token from the current policy at the
loss temperature (inverse CDF on fixed uniforms), rewards 1 for a token below 8, packs them in fixed shapes
and trains on them with the recipe's loss defaults, two optimizer steps per batch (so the second sees ratios
away from 1 and the clipping) and a warmed-up cosine schedule. It takes 15-30 s on a loaded 2-core machine.

Tolerance: loss, gradient norm, entropy and the policy's probability of a rewarded token within 1e-4 relative
plus 1e-6 absolute; rewards exactly (they are counts / 32). The run has its own interpreter with its own
`XLA_FLAGS` (XLA's default CPU numerics): the learner's speed flag
`--xla_cpu_experimental_ynn_fusion_type` fuses work into the matmuls (with epsilon 1e-8 it moved the first loss
by 2.3e-4), and an in-process `intellect train` elsewhere in the suite used to leave it in the environment. A
change of the objective or the optimizer moves the numbers by orders of magnitude more.

AdamW's epsilon is 1e-6 here, not 1e-8, for the same reason as the single device: another CPU, or another
XLA:CPU matmul kernel, sums in another order, and with 1e-8 the gradients at float32's noise floor became steps
of the full learning rate (an AMD EPYC moved the first loss by 1.6e-3 and p(rewarded) by 8e-5 against a curve
made on an Intel Xeon). With 1e-6, kernels that sum in different orders agree within 7% of the tolerance, and
a 1% change of the learning rate still exceeds it 12-760x.

When a change is meant to move the numbers, regenerate the file and commit it with the change, saying why:

    GOLDEN_UPDATE=1 .venv/bin/python -m pytest tests/unit/jax_trainer/test_golden_grpo.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_trainer.config import LossConfig, OptimConfig, TrainerConfig
from jax_trainer.models import ModelConfig, init_random
from jax_trainer.sharding import make_mesh
from jax_trainer.source import Rollout, build_step_batch
from jax_trainer.train_step import GRPOTrainer

GOLDEN = Path(__file__).with_name("golden") / "grpo_curve.json"
STEPS, SAMPLES, GROUP, REWARDED = 8, 32, 8, 8  # reward 1 for tokens 0..7
RTOL, ATOL = 1e-4, 1e-6


def run_curve() -> dict[str, list[float]]:
    cfg = ModelConfig(
        model_type="llama",
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
    )
    mesh = make_mesh(fsdp=1, devices=jax.devices()[:1])  # one device: no cross-device sums in arrival order
    model = init_random(cfg, mesh=mesh, seed=1)
    loss = LossConfig()  # the recipe defaults: token_mean, eps 0.2/0.2, delta 4, temperature 0.6, recompute
    trainer = GRPOTrainer(
        model,
        mesh,
        loss,
        OptimConfig(lr=3e-4, warmup_steps=2, schedule="cosine", grad_clip=1.0, eps=1e-6),
        TrainerConfig(steps=2 * STEPS, steps_per_batch=2),
    )
    state = trainer.init_state(nnx.split(model)[1])
    prompt = np.array([3, 1, 4, 1, 5, 9, 2, 6], np.int32)
    uniforms = np.random.default_rng(20250517).random((STEPS, SAMPLES))

    @jax.jit
    def next_token_probs(params):
        logits = trainer.model(params)(jnp.asarray(prompt[None]))[0, -1].astype(jnp.float32)
        return jax.nn.softmax(logits / loss.temperature)

    curve: dict[str, list[float]] = {key: [] for key in ("loss", "grad_norm", "entropy", "reward_mean", "p_rewarded")}
    for step in range(STEPS):
        p = np.asarray(next_token_probs(state.params), np.float64)
        tokens = np.minimum(np.searchsorted(np.cumsum(p / p.sum()), uniforms[step]), len(p) - 1)
        samples = [
            Rollout(
                np.r_[prompt, t].astype(np.int32),
                len(prompt),
                np.r_[np.zeros(len(prompt)), np.log(p[t])].astype(np.float32),
                float(t < REWARDED),
                i // GROUP,
                step,
            )
            for i, t in enumerate(tokens)
        ]
        batch = build_step_batch(samples, step, rows=4, seq_len=40, micro_batches=2)  # 16 samples each
        assert batch is not None, f"step {step}: every group had one reward (the fixed uniforms should prevent it)"
        state, metrics = trainer.step(state, trainer.device_batch(batch.packed))
        for key in ("loss", "grad_norm", "entropy"):
            curve[key].append(float(np.asarray(metrics[key])))
        curve["reward_mean"].append(batch.stats["reward_mean"])
        curve["p_rewarded"].append(float(p[:REWARDED].sum()))
    return curve


def run_curve_in_a_fresh_process() -> dict[str, list[float]]:
    """`run_curve` in its own interpreter with XLA's default flags: neither what ran before it in the test
    process (compiled programs, JAX's state) nor flags left in the environment may reach its numbers."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_grpo_curve_matches_the_golden_one():
    curve = run_curve_in_a_fresh_process()
    if os.environ.get("GOLDEN_UPDATE"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(
            json.dumps(
                {
                    "about": "per-step loss, mean reward and p(token < 8) of "
                    "tests/unit/jax_trainer/test_golden_grpo.py; regenerate with GOLDEN_UPDATE=1 "
                    ".venv/bin/python -m pytest tests/unit/jax_trainer/test_golden_grpo.py",
                    **curve,
                },
                indent=1,
            )
            + "\n"
        )
    golden = json.loads(GOLDEN.read_text())
    assert curve["reward_mean"] == golden["reward_mean"], (curve["reward_mean"], golden["reward_mean"])
    for key in ("loss", "grad_norm", "entropy", "p_rewarded"):
        np.testing.assert_allclose(curve[key], golden[key], rtol=RTOL, atol=ATOL, err_msg=key)
    assert golden["p_rewarded"][-1] > golden["p_rewarded"][0], "the run no longer learns the rewarded tokens"


if __name__ == "__main__":  # run_curve_in_a_fresh_process
    print(json.dumps(run_curve()))
