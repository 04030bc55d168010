"""The learner at the real model's shapes (SmolLM2-135M: Llama, 9 query / 3 KV heads of 64, tied embeddings,
vocabulary 49,152; `configs/shapes/smollm2-135m`), layers cut, on two fake CPU devices as `make demo` runs it.

- The train step under the learner's default XLA:CPU flags (`jax_trainer.xla_flags.FLAGS`, what
  `jax_trainer.host.prepare` applies with host memory retention on). With YNNPACK's `eltwise` fusion in them,
  this step died at its first run ("Instruction with unsupported layout in YNN fusion:
  f32[2,32,3,32]{3,1,2,0}", the rotary half of the 3 KV heads, transposed). Its loss is checked against numpy
  and its gradient norm against the same step compiled with no YNNPACK fusion at all (`LEAN`).
- `intellect parity`'s JAX forward on two devices, which deadlocked XLA:CPU in an all-reduce when it ran the
  model op by op; with a time limit, so that a deadlock fails the test instead of hanging it.

Each case runs in its own process (XLA reads its flags once per process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]
SHAPE = ROOT / "configs" / "shapes" / "smollm2-135m" / "config.json"

STEP = r"""
import json, sys
from jax_trainer import xla_flags
xla_flags.apply("cpu", lean=sys.argv[2] == "lean")
import jax, numpy as np
from flax import nnx
from jax_trainer.config import LossConfig, OptimConfig, TrainerConfig
from jax_trainer.models import ModelConfig, init_random
from jax_trainer.sharding import make_mesh
from jax_trainer.train_step import GRPOTrainer

hf = json.loads(open(sys.argv[1]).read())
hf["num_hidden_layers"] = 1
cfg = ModelConfig.from_hf(hf)
mesh = make_mesh(fsdp=-1)
model = init_random(cfg, mesh, "float32", "float32", remat="full", seed=0)
rows, seq = 4, 32
trainer = GRPOTrainer(
    model, mesh, LossConfig(logprob_source="recompute"), OptimConfig(lr=1e-6, warmup_steps=0, grad_clip=1.0),
    TrainerConfig(micro_batch_size=rows, micro_batches=1),
)
state = trainer.init_state(nnx.split(model)[1])
rng = np.random.default_rng(0)
values = {
    "tokens": rng.integers(0, cfg.vocab_size, (1, rows, seq), dtype=np.int32),
    "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (1, rows, seq)).copy(),
    "segment_ids": np.ones((1, rows, seq), np.int32),
    "loss_mask": (np.arange(seq) >= 8).astype(np.float32)[None, None].repeat(rows, 1),
    "advantages": np.repeat(rng.standard_normal((1, rows, 1)).astype(np.float32), seq, 2),
    "inference_logprobs": np.full((1, rows, seq), -5.0, np.float32),
    "completion_lens": np.full((1, rows, seq), seq - 8.0, np.float32),
}
specs = trainer.abstract_batch(1, rows, seq)
batch = {k: jax.device_put(values[k], specs[k].sharding) for k in specs}
state, metrics = trainer.step(state, batch)
mask, adv = values["loss_mask"][..., 1:], values["advantages"][..., 1:]
print(json.dumps({"loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
                  "expected_loss": float(-(adv * mask).sum() / mask.sum()), "devices": jax.device_count(),
                  "xla_flags": __import__("os").environ["XLA_FLAGS"]}))
"""


def _start(code: str, *args: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
    }
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(proc: subprocess.Popen, timeout: float) -> dict:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"no answer within {timeout} s (a deadlock?); stderr tail:\n{err[-3000:]}")
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_train_step_at_the_real_shape_holds_with_the_default_xla_flags():
    default, lean = _start(STEP, str(SHAPE), "default"), _start(STEP, str(SHAPE), "lean")
    got, ref = _result(default, 240), _result(lean, 240)
    assert got["devices"] == 2
    from jax_trainer import xla_flags

    assert all(flag in got["xla_flags"] for flag in xla_flags.FLAGS["cpu"])
    # pi_old is the policy itself: every ratio is 1, so the loss is -(mean advantage over completion tokens)
    assert got["loss"] == pytest.approx(got["expected_loss"], rel=1e-5, abs=1e-7)
    assert np.isfinite(got["grad_norm"]) and got["grad_norm"] > 0
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)


PARITY = r"""
import json, sys
import numpy as np
from jax_trainer.models import ModelConfig, init_random
from jax_trainer.sharding import make_mesh
from intellect.parity import jax_logits, parity_sequences

hf = json.loads(open(sys.argv[1]).read())
hf["num_hidden_layers"], hf["vocab_size"] = int(sys.argv[2]), int(sys.argv[3])
cfg = ModelConfig.from_hf(hf)
model = init_random(cfg, make_mesh(fsdp=-1), "float32", "float32", seed=0)
seqs = parity_sequences(cfg.vocab_size, int(sys.argv[4]), int(sys.argv[5]))
logits = jax_logits(model, seqs)
single = jax_logits(model, seqs[:1])[0]
again = jax_logits(model, seqs[1:])
print(json.dumps({"tokens": sum(map(len, logits)), "finite": bool(all(np.isfinite(x).all() for x in logits)),
                  "batched_vs_alone": float(np.abs(logits[0] - single).max()),
                  "batched_vs_others": float(max(np.abs(a - b).max() for a, b in zip(logits[1:], again)))}))
"""


def test_parity_forward_on_two_fake_devices_does_not_deadlock():
    # 8 layers, vocabulary cut to 4096, 8 sequences up to 256 tokens, three forwards: run op by op, one forward
    # of 8 x 256 tokens at this size deadlocked in 3 of 3 runs (the whole model too); jitted, seconds
    got = _result(_start(PARITY, str(SHAPE), "8", "4096", "8", "256"), 240)
    assert got["tokens"] > 0 and got["finite"]
    # a sequence scored alone or in another padded batch gets the same logits
    assert got["batched_vs_alone"] < 1e-4 and got["batched_vs_others"] < 1e-4
