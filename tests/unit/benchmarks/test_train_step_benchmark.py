"""benchmarks/train_step.py computes the same GRPO step on both sides: its first step's loss and gradient norm
from JAX and from eager PyTorch (Hugging Face's Qwen2 on the same weights) agree, on a tiny shape. (It once
compared a temperature-0.6 JAX loss with a temperature-1 torch one and printed both without noticing.) With
`--other-form` the JAX step also runs with its layers in the other form (scanned here, the CPU default being
unrolled), which computes the same step."""

from __future__ import annotations

import json


def test_both_sides_compute_the_same_first_step(run_benchmark):
    tiny = "--hidden 64 --intermediate 128 --layers 1 --heads 2 --kv-heads 1 --vocab 128 --seq 96 --batch 2"
    args = tiny.split() + "--rounds 1 --steps 1 --peak-n 64 --peak-reps 1 --other-form".split()
    # one CPU device, as a user runs it
    done = run_benchmark("train_step.py", args, env={"XLA_FLAGS": None})
    out = json.loads(done.stdout)
    first = out["first_step"]
    assert first["agree"], first
    assert abs(first["jax_loss"] - first["torch_loss"]) <= 1e-4 * abs(first["torch_loss"]) + 1e-6, first
    other = out["other_form"]
    assert out["scan_layers"] == "auto" and out["jax_layers_scanned"] is False and other["layers_scanned"] is True
    assert abs(other["first_step_loss"] - first["jax_loss"]) <= 1e-5 * abs(first["jax_loss"]) + 1e-7, other
    assert abs(other["first_step_grad_norm"] - first["jax_grad_norm"]) <= 1e-4 * first["jax_grad_norm"], other
    assert other["tokens_per_s"]["median"] > 0 and other["default_over_other"] > 0
