"""AdamW with a warmup and a constant, linear or cosine schedule (optax).

Gradient clipping is not part of the chain: the train step clips by global norm itself so that it can report
the norm before and after (and skip non-finite updates before the optimizer ever sees them).
"""

from __future__ import annotations

import jax.numpy as jnp
import optax

from jax_trainer.config import OptimConfig


def learning_rate(s: OptimConfig, total_steps: int) -> optax.Schedule:
    """lr * (k + 1) / warmup_steps for the first warmup steps (the first update is not wasted at lr 0), then
    constant, linear decay to 0, or cosine decay to 0 over the remaining `total_steps - warmup_steps`
    (`total_steps`: the optimizer steps of the run, `trainer.steps`)."""
    warmup = max(int(s.warmup_steps), 0)
    decay = max(total_steps - warmup, 1)
    if s.schedule == "constant":
        after = optax.constant_schedule(s.lr)
    elif s.schedule == "linear":
        after = optax.linear_schedule(s.lr, 0.0, decay)
    elif s.schedule == "cosine":
        after = optax.cosine_decay_schedule(s.lr, decay)
    else:
        raise ValueError(f"optim.schedule {s.schedule!r} is not one of constant, linear, cosine")
    if warmup == 0:
        return after

    def schedule(count):
        return jnp.where(count < warmup, s.lr * (count + 1) / warmup, after(jnp.maximum(count - warmup, 0)))

    return schedule


def make_optimizer(s: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """AdamW with `learning_rate`'s schedule; `s.grad_clip` is applied by the train step, not here."""
    return optax.adamw(learning_rate(s, total_steps), b1=s.b1, b2=s.b2, eps=s.eps, weight_decay=s.weight_decay)
