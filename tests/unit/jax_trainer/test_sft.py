"""The SFT step against an independent reference: HF transformers' logits on the same weights, scored in torch
one example at a time (no packing), and a few steps that must lower the loss of a fixed batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jax_trainer.config import OptimConfig, TrainerConfig
from jax_trainer.models import load_hf
from jax_trainer.sft import SFTTrainer, pack_examples
from jax_trainer.sharding import make_mesh


def _examples(vocab: int, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        p, c = int(rng.integers(3, 12)), int(rng.integers(1, 8))
        out.append((rng.integers(3, vocab, p).tolist(), rng.integers(3, vocab, c).tolist()))
    return out


def _torch_reference(model_dir, examples):
    """Token-mean NLL and argmax accuracy over completion tokens, each example run on its own."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    nll, hits, count = 0.0, 0, 0
    with torch.no_grad():
        for prompt, completion in examples:
            ids = torch.tensor([prompt + completion])
            logits = model(ids).logits[0].double()
            logp = torch.log_softmax(logits, -1)
            for t in range(len(prompt), len(prompt) + len(completion)):  # token t is predicted at t - 1
                nll -= float(logp[t - 1, ids[0, t]])
                hits += int(int(torch.argmax(logits[t - 1])) == int(ids[0, t]))
                count += 1
    return nll / count, hits / count


def _fresh_params(model):
    """A copy of the model's parameters: the step donates its state, the model must outlive each test."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    return jax.tree.map(jnp.copy, nnx.split(model)[1])


@pytest.fixture(scope="module")
def setup(tiny_model):
    model_dir = tiny_model("qwen2", hidden=64, layers=2, heads=2, kv_heads=1, seed=3)
    mesh = make_mesh(1, -1, 1)
    model = load_hf(model_dir, mesh=mesh)
    examples = _examples(model.cfg.vocab_size, 40)
    packed = pack_examples(examples, rows=8, seq_len=48)
    return model_dir, mesh, model, examples, packed


def test_loss_and_accuracy_match_transformers(setup):
    model_dir, mesh, model, examples, packed = setup
    assert packed.shape[0] >= 2, "the batch must span several micro-batches to test accumulation"
    assert packed.completion_tokens == sum(len(c) for _, c in examples)
    trainer = SFTTrainer(model, mesh, OptimConfig(lr=1e-3, warmup_steps=0), TrainerConfig(logprob_chunk=16))
    state = trainer.init_state(_fresh_params(model))
    ref_loss, ref_acc = _torch_reference(model_dir, examples)
    got = trainer.evaluate(state.params, trainer.device_batch(packed))
    assert got["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert got["accuracy"] == pytest.approx(ref_acc, abs=1e-6)
    # the step reports the loss of the parameters it starts from
    _, metrics = trainer.step(state, trainer.device_batch(packed))
    assert float(metrics["loss"]) == pytest.approx(ref_loss, rel=1e-5)
    assert float(metrics["accuracy"]) == pytest.approx(ref_acc, abs=1e-6)


def test_steps_lower_the_loss_of_a_fixed_batch(setup):
    model_dir, mesh, model, examples, packed = setup
    trainer = SFTTrainer(model, mesh, OptimConfig(lr=3e-3, warmup_steps=0, grad_clip=1.0, weight_decay=0.0))
    state = trainer.init_state(_fresh_params(model))
    batch = trainer.device_batch(packed)
    first = trainer.evaluate(state.params, batch)["loss"]
    for _ in range(8):
        state, metrics = trainer.step(state, batch)
        assert np.isfinite(float(metrics["grad_norm"]))
    after = trainer.evaluate(state.params, batch)
    assert int(state.step) == 8 and int(state.skipped) == 0
    assert after["loss"] < 0.8 * first
