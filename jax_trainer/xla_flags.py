"""XLA flags that make the learner faster on a given platform; they must be set before jax starts a backend.

XLA reads `XLA_FLAGS` once, when the first backend is created, so `apply(platform)` has to run before the
first jax computation (best: before `import jax`). Flags the user already put in `XLA_FLAGS` win: a flag is
only added when its name is not there yet.

Measured on a 2-core x86 CPU (`benchmarks/train_step.py`, float32 GRPO step of a 4-layer Qwen2):

- `--xla_cpu_experimental_ynn_fusion_type=dot,eltwise,reduce`: XLA:CPU lets YNNPACK fuse elementwise and
  reduction work into the matmuls it already runs through YNNPACK; a few percent on the whole step.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

FLAGS: dict[str, tuple[str, ...]] = {
    "cpu": ("--xla_cpu_experimental_ynn_fusion_type=dot,eltwise,reduce",),
    "gpu": (),
    "tpu": (),
}


def apply(platform: str = "cpu", env: MutableMapping[str, str] = os.environ) -> list[str]:
    """Append `platform`'s flags to `env["XLA_FLAGS"]` (those not set already); returns the flags added."""
    if platform not in FLAGS:
        raise ValueError(f"xla_flags: platform {platform!r} is not one of {', '.join(FLAGS)}")
    current = env.get("XLA_FLAGS", "").split()
    names = {flag.split("=", 1)[0] for flag in current}
    added = [flag for flag in FLAGS[platform] if flag.split("=", 1)[0] not in names]
    if added:
        env["XLA_FLAGS"] = " ".join(current + added)
    return added
