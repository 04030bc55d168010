"""AdamW with a warmup and a constant, linear or cosine schedule (optax).

Gradient clipping is not part of the chain: the train step clips by global norm itself so that it can report
the norm before and after (and skip non-finite updates before the optimizer ever sees them).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class OptimSettings:
    """Field names match the `[optim]` config section."""

    lr: float = 3e-7
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.99
    eps: float = 1e-8
    grad_clip: float = 0.1  # global-norm clip applied by the train step (INTELLECT-2: 0.1)
    warmup_steps: int = 25
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    total_steps: int = 1000  # length of the linear/cosine decay (the optimizer steps of the run)

    @classmethod
    def from_config(cls, section, total_steps: int) -> "OptimSettings":
        fields = {f.name for f in dataclasses.fields(cls)} - {"total_steps"}
        return cls(**{k: getattr(section, k) for k in fields if hasattr(section, k)}, total_steps=total_steps)


def learning_rate(s: OptimSettings) -> optax.Schedule:
    """lr * (k + 1) / warmup_steps for the first warmup steps (the first update is not wasted at lr 0), then
    constant, linear decay to 0, or cosine decay to 0 over the remaining `total_steps - warmup_steps`."""
    warmup = max(int(s.warmup_steps), 0)
    decay = max(s.total_steps - warmup, 1)
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


def make_optimizer(s: OptimSettings) -> optax.GradientTransformation:
    return optax.adamw(learning_rate(s), b1=s.b1, b2=s.b2, eps=s.eps, weight_decay=s.weight_decay)
