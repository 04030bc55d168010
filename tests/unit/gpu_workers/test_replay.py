"""The replayable sampler's noise and choice, and the validator's replay check, against independent references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gpu_workers.checks import SamplingTolerance, check_near_tie_budget, check_replay_batch
from gpu_workers.replay import GUMBEL_MAX, gumbel_noise, noise_at, noisy_max, uniform_bits

U32 = np.uint64(0xFFFFFFFF)


def _fmix32_ref(h: np.ndarray) -> np.ndarray:
    """murmur3's fmix32 in numpy uint64 (wrapping multiplication), written from the published constants."""
    h = h & U32
    h ^= h >> np.uint64(16)
    h = (h * np.uint64(0x85EBCA6B)) & U32
    h ^= h >> np.uint64(13)
    h = (h * np.uint64(0xC2B2AE35)) & U32
    h ^= h >> np.uint64(16)
    return h


def _bits_ref(seed: int, position: int, vocab: int) -> np.ndarray:
    """The documented hash of (seed, position, token) for every token, from the module docstring's recipe."""
    lo, hi = np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32)
    key = _fmix32_ref(lo ^ _fmix32_ref(hi ^ np.uint64(0x5BD1E995)))
    key = _fmix32_ref(key ^ ((np.uint64(position) * np.uint64(0x9E3779B1)) & U32) ^ np.uint64(0x68E31DA4))
    second = _fmix32_ref(key ^ np.uint64(0x27D4EB2F))
    tokens = np.arange(vocab, dtype=np.uint64)
    h = _fmix32_ref(key ^ ((tokens * np.uint64(0x85EBCA77)) & U32))
    return (_fmix32_ref((h + second) & U32) >> np.uint64(9)).astype(np.int64)


def test_noise_bits_match_an_independent_numpy_hash():
    seeds = [0, 1, 2**32 - 1, 2**32, 2**63 + 12345, 2**64 - 1]
    positions = [0, 1, 31, 1000, 2**20, 7]
    ours = uniform_bits(seeds, positions, 1000).numpy()
    for row, (seed, position) in enumerate(zip(seeds, positions)):
        np.testing.assert_array_equal(ours[row], _bits_ref(seed, position, 1000))


def test_noise_is_standard_gumbel_and_independent_across_positions_and_seeds():
    g = gumbel_noise(list(range(64)), [5] * 64, 4096).double()
    assert abs(float(g.mean()) - 0.5772) < 0.01 and abs(float(g.std()) - math.pi / 6**0.5) < 0.01
    assert float(g.max()) <= GUMBEL_MAX
    a = gumbel_noise([9] * 2, [0, 1], 4096).double()
    b = gumbel_noise([9, 10], [0, 0], 4096).double()
    for x, y in ((a[0], a[1]), (b[0], b[1])):
        assert abs(float(np.corrcoef(x.numpy(), y.numpy())[0, 1])) < 0.05
    tokens = torch.tensor([0, 17, 4095])
    np.testing.assert_array_equal(noise_at([9, 9, 9], [1, 1, 1], tokens).numpy(), a[1, tokens].float().numpy())


def test_gumbel_max_samples_the_softmax():
    """Over many seeds, the replayable choice's frequencies are softmax(z) (a chi-square test)."""
    z = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 20000
    choice, _ = noisy_max(z.expand(n, -1).clone(), list(range(n)), [3] * n)
    counts = np.bincount(choice.numpy(), minlength=len(z))
    expected = torch.softmax(z.double(), 0).numpy() * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, (counts, expected)  # 5 degrees of freedom: p = 0.001


@pytest.mark.parametrize("scale", [0.3, 3.0, 30.0])
def test_pruned_argmax_equals_the_dense_argmax(scale):
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(64, 3000, generator=gen) * scale
    z[::3, 1000:] = -math.inf  # rows with a top-k / top-p mask
    seeds, positions = list(range(100, 164)), list(range(64))
    choice, best = noisy_max(z, seeds, positions)
    dense = z + gumbel_noise(seeds, positions, 3000)
    torch.testing.assert_close(best, dense.max(-1).values)
    assert torch.equal(choice, dense.argmax(-1))


def _honest(logits: torch.Tensor, seed: int, temperature: float) -> torch.Tensor:
    return noisy_max(logits / temperature, [seed] * len(logits), list(range(len(logits))))[0]


def test_replay_accepts_the_seed_choice_under_rounding_and_rejects_other_tokens():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(200, 500, generator=gen) * 2
    tolerance = SamplingTolerance(replay_logit_tolerance=0.05)
    tokens = _honest(logits, 77, 0.7)
    perturbed = logits + (torch.rand(logits.shape, generator=gen) - 0.5) * 0.02  # the validator's rounding
    (honest,) = check_replay_batch([(tokens, perturbed, 77)], 0.7, 1.0, tolerance)
    assert honest.passed, honest.reasons
    other_seed = _honest(logits, 78, 0.7)
    (wrong_seed,) = check_replay_batch([(other_seed, perturbed, 77)], 0.7, 1.0, tolerance)
    differ = int((other_seed != tokens).sum())  # each differing token is off-seed or, rarely, a near tie
    assert not wrong_seed.passed and differ > 100
    assert wrong_seed.numbers["off_seed_tokens"] + wrong_seed.numbers["near_ties"] == differ
    changed = tokens.clone()
    changed[100] = int(logits[100].argmin())
    (one,) = check_replay_batch([(changed, perturbed, 77)], 0.7, 1.0, tolerance)
    assert not one.passed and one.numbers["off_seed_tokens"] == 1 and "positions [100]" in one.reasons[0]


def test_near_ties_pass_within_budget_and_fail_beyond_it():
    logits = torch.zeros(50, 4)
    logits[:, 1] = -100.0
    seed = 5
    best = _honest(logits, seed, 1.0)
    noise = gumbel_noise([seed] * 50, list(range(50)), 4)
    scores = logits + noise
    ranked = scores.sort(-1, descending=True)
    gaps = ranked.values[:, 0] - ranked.values[:, 1]
    close = torch.nonzero(gaps < 0.5).flatten()
    assert len(close) >= 5
    tolerance = SamplingTolerance(  # a floor of 1: every near tie costs 1, whatever its gap
        replay_logit_tolerance=0.25,
        near_tie_floor=1.0,
        near_ties_per_sample=2,
        near_ties_per_token=0.0,
        near_ties_per_batch_token=0.0,
    )
    runner_up = best.clone()
    runner_up[close[:2]] = ranked.indices[close[:2], 1]
    (two,) = check_replay_batch([(runner_up, logits, seed)], 1.0, 1.0, tolerance)
    assert two.passed and two.numbers["near_ties"] == 2
    runner_up[close[:5]] = ranked.indices[close[:5], 1]
    (five,) = check_replay_batch([(runner_up, logits, seed)], 1.0, 1.0, tolerance)
    assert not five.passed and five.numbers["near_ties"] == 5 and five.numbers["off_seed_tokens"] == 0
    assert not check_near_tie_budget([two, two], tolerance).passed  # 4 > 2 in the batch
    assert check_near_tie_budget([two], tolerance).passed


def _runner_up_batch(flip, samples: int = 16, n: int = 32, vocab: int = 4):
    """Replay inputs of `samples` completions on flat logits, each the seed's choice except at the positions
    `flip(gap)` picks (gap: the best noisy score minus the runner-up's), where the runner-up is taken."""
    logits = torch.zeros(n, vocab)
    batch = []
    for seed in range(samples):
        ranked = (logits + gumbel_noise([seed] * n, list(range(n)), vocab)).sort(-1, descending=True)
        tokens = ranked.indices[:, 0].clone()
        where = flip(ranked.values[:, 0] - ranked.values[:, 1])
        tokens[where] = ranked.indices[where, 1]
        batch.append((tokens, logits, seed))
    return batch


def _judged(batch, tolerance):
    samples = check_replay_batch(batch, 1.0, 1.0, tolerance)
    return samples, check_near_tie_budget(samples, tolerance)


def test_rounding_near_ties_pass_where_a_count_budget_rejected_them():
    """An honest bfloat16 worker at the Qwen2.5-0.5B shape had near ties at 3.7-4.7% of its tokens, past the
    former budget of 3 + 4% of a batch's tokens, all within 0.21 of the margin: such a batch passes."""
    tolerance = SamplingTolerance(replay_logit_tolerance=1.0)  # margin 2 at T 1
    batch = _runner_up_batch(lambda gap: torch.nonzero(gap < 0.2).flatten()[:2])  # within 0.1 of the margin
    samples, whole = _judged(batch, tolerance)
    near, tokens = whole.numbers["near_ties"], whole.numbers["tokens"]
    assert near > 3 + 0.04 * tokens, f"only {near} near ties in {tokens} tokens: the case needs more"
    assert all(s.passed for s in samples) and whole.passed, (whole.reasons, [s.reasons for s in samples])
    assert whole.numbers["near_tie_cost"] <= 0.25 * near + 0.75 * 0.1 * near + 1e-6


def test_near_ties_chosen_across_the_margin_are_rejected_within_the_former_count_budget():
    """A cheater that takes a runner-up wherever it lies inside the margin, at fewer near ties than the former
    budget (3 + 4% of the batch's tokens) allowed, is rejected by what its choices cost."""
    tolerance = SamplingTolerance(replay_logit_tolerance=1.0)  # margin 2 at T 1
    batch = _runner_up_batch(lambda gap: torch.nonzero((gap > 1.4) & (gap <= 2.0)).flatten()[:1])
    samples, whole = _judged(batch, tolerance)
    near, tokens = whole.numbers["near_ties"], whole.numbers["tokens"]
    assert 0.03 * tokens < near <= 3 + 0.04 * tokens, f"{near} near ties in {tokens} tokens: not the case meant"
    assert all(s.numbers["off_seed_tokens"] == 0 for s in samples)  # every choice is inside the margin
    assert not whole.passed and "near-tie tokens in the batch" in whole.reasons[0]


def test_top_p_boundary_token_of_the_worker_is_passed_over():
    """A best token the worker's logits could have left out of its nucleus (given the sampling check's logit
    tolerance) does not fail an honest token."""
    temperature = 1.0
    logits = torch.tensor([[2.0, 1.0, 0.0, -0.2, -5.0]]).repeat(400, 1)
    seeds = 11
    worker = logits.clone()
    worker[:, 3] -= 0.15  # the worker's rounding ...
    before_validator = float(torch.softmax(logits[0], 0)[:3].sum())
    before_worker = float(torch.softmax(worker[0], 0)[:3].sum())
    top_p = (before_validator + before_worker) / 2  # ... puts token 3 out of its nucleus, not the validator's
    worker_kept = torch.tensor([True, True, True, False, False])
    masked = (worker / temperature).masked_fill(~worker_kept, -math.inf)
    tokens = noisy_max(masked, [seeds] * 400, list(range(400)))[0]
    tolerance = SamplingTolerance(replay_logit_tolerance=0.1, near_ties_per_token=0.05)
    (verdict,) = check_replay_batch([(tokens, logits, seeds)], temperature, top_p, tolerance)
    assert verdict.passed, verdict.reasons
    # each pass-over is a choice the validator cannot replay: priced, at least at the floor
    assert verdict.numbers["near_ties"] > 0
    assert verdict.numbers["near_tie_cost"] >= tolerance.near_tie_floor * verdict.numbers["near_ties"] - 1e-6
    strict = SamplingTolerance(logit_tolerance=0.001, replay_logit_tolerance=0.001, near_ties_per_token=0.05)
    (unexplained,) = check_replay_batch([(tokens, logits, seeds)], temperature, top_p, strict)
    assert not unexplained.passed  # with no room for rounding, the worker's boundary choices are off-seed


def test_typicality_separates_likely_picks_from_honest_samples():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(400, 300, generator=gen) * 2
    honest = _honest(logits, 1, 1.0)
    greedy = logits.argmax(-1)
    tolerance = SamplingTolerance(replay_logit_tolerance=0.01)
    (h,), (g,) = (check_replay_batch([(t, logits, 1)], 1.0, 1.0, tolerance) for t in (honest, greedy))
    assert abs(h.numbers["typicality"]) < 4 and g.numbers["typicality"] > 10
