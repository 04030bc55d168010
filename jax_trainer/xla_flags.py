"""XLA flags that make the learner faster on a given platform; they must be set before jax starts a backend.

XLA reads `XLA_FLAGS` once, when the first backend is created, so `apply(platform)` has to run before the
first jax computation (best: before `import jax`). Flags the user already put in `XLA_FLAGS` win: a flag is
only added when its name is not there yet.

An experimental XLA flag is in `FLAGS` only where a test of the real model's step holds with it
(`tests/unit/jax_trainer/test_real_shapes.py`: SmolLM2-135M's shapes, layers cut, on two fake devices).
`--xla_cpu_experimental_ynn_fusion_type=dot,eltwise,reduce` was the CPU default (a few percent on a 4-layer
Qwen2 step) until that step died at its first run with it: "Instruction with unsupported layout in YNN
fusion: f32[8,128,3,32]{3,1,2,0}" (the rotary half of 3 KV heads of 64, in a transposed layout that
YNNPACK's elementwise fusion does not take; `dot,reduce` and XLA's own default hold). So the CPU learner keeps
XLA's default fusions; `benchmarks/train_step.py --shape smollm2-135m` measures them (docs/learner.md).

YNNPACK's fusions allocate their intermediates themselves, outside XLA's buffer assignment, so no memory plan
sees them: a Qwen2.5-0.5B-shaped step (8 layers, 2 fake devices, 16 x 160 tokens) grew the process by 4.67 GiB
with them against 3.87 GiB of planned temporaries, and by 3.87 GiB against 3.23 GiB with no YNNPACK fusion
at all (`--xla_cpu_experimental_ynn_fusion_type=`, which was not slower there: 78 s a step against 83 s). A
tiny matmul-and-sum, [256, 896] x [896, 151936] summed over rows, grew it by 663 MiB fused (0 B planned) and
by 501 MiB unfused (153 MiB planned). `apply(platform, lean=True)` uses the `LEAN` flags instead: no YNNPACK fusion,
for learners whose memory is tight (`jax_trainer.host.prepare` picks them when host memory retention is off).

`SAFETY` flags are not about speed and go wherever this project starts JAX (every `intellect` command, the
tests): XLA:CPU ends the whole process (a fatal check, no Python error) when a participant of a collective
arrives more than 40 s after the first one (XLA's default). On a fake multi-device CPU mesh
(`--xla_force_host_platform_device_count`) all devices share the host's cores, so one device's share of a
step can lag; a Qwen2.5-0.5B-shaped model on 2 fake devices of a 2-core machine once lagged past 40 s. The
honest lag measured since: SmolLM2-135M's whole step (30 layers, fsdp 2, 2 micro-batches of 16 x 128 tokens,
remat full) on 2 fake devices of the 2-core machine under a load average of 6 raised no warning with XLA's
stuck-collective warning at 1 s, so no participant waited a second. The one wait seen to last longer was a
deadlock (`intellect parity` running the model op by op, docs/learner.md), which never ends. So the rendezvous
gets `COLLECTIVE_TIMEOUT_S` = 300 s: more than 7 times the longest lag ever seen here and 300 times the one
measured, after which a deadlock ends the process with XLA's message naming the collective instead of hanging.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

FLAGS: dict[str, tuple[str, ...]] = {
    "cpu": (),
    "gpu": (),
    "tpu": (),
}


LEAN: dict[str, tuple[str, ...]] = {"cpu": ("--xla_cpu_experimental_ynn_fusion_type=",), "gpu": (), "tpu": ()}

COLLECTIVE_TIMEOUT_S = 300
SAFETY: tuple[str, ...] = (
    f"--xla_cpu_collective_call_terminate_timeout_seconds={COLLECTIVE_TIMEOUT_S}",
    f"--xla_cpu_collective_timeout_seconds={COLLECTIVE_TIMEOUT_S}",
)


def apply(platform: str = "cpu", env: MutableMapping[str, str] = os.environ, lean: bool = False) -> list[str]:
    """Append `platform`'s flags (its `LEAN` ones with `lean`) and the `SAFETY` flags to `env["XLA_FLAGS"]`
    (those not set already); returns the flags added."""
    if platform not in FLAGS:
        raise ValueError(f"xla_flags: platform {platform!r} is not one of {', '.join(FLAGS)}")
    return _add((LEAN if lean else FLAGS)[platform] + SAFETY, env)


def apply_safety(env: MutableMapping[str, str] = os.environ) -> list[str]:
    """Append only the `SAFETY` flags (for processes that keep XLA's default numerics, such as the tests)."""
    return _add(SAFETY, env)


def _add(flags: tuple[str, ...], env: MutableMapping[str, str]) -> list[str]:
    current = env.get("XLA_FLAGS", "").split()
    names = {flag.split("=", 1)[0] for flag in current}
    added = [flag for flag in flags if flag.split("=", 1)[0] not in names]
    if added:
        env["XLA_FLAGS"] = " ".join(current + added)
    return added
