"""The replay tolerance's calibration (`gpu_workers.calibration`) against independent references.

`competing_spreads` is checked on positions built so that the competing set is known by construction: the
validator's logits put each listed token's noisy score (logit + the seed's noise at that position) where the
test wants it, and the worker's logprobs are the validator's plus chosen errors and a per-row constant (a
different log-normaliser, which a spread must ignore). A random case is checked against a numpy
recomputation. The noise itself is `gpu_workers.replay.noise_at`, tested against a numpy hash in
test_replay.py. `replay_tolerance` is checked against exact decimal arithmetic.
"""

from __future__ import annotations

import math
from decimal import ROUND_CEILING, Decimal

import numpy as np
import pytest
import torch

from gpu_workers.calibration import COMPETING_WINDOW, competing_spreads, replay_tolerance
from gpu_workers.replay import noise_at

VOCAB = 64
SEED = 123456789


def _noise(seed: int, position: int, ids) -> np.ndarray:
    ids = np.asarray(ids, dtype=np.int64)
    return noise_at([seed] * len(ids), [position] * len(ids), torch.as_tensor(ids)).double().numpy()


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    top = x.max(axis=-1, keepdims=True)
    return x - top - np.log(np.exp(x - top).sum(axis=-1, keepdims=True))


def _build(rows, seed: int = SEED):
    """rows: per position, (ids, noisy scores wanted under the validator, worker errors, row constant).
    The validator's logits place each listed token's noisy score exactly there (unlisted tokens far below);
    the worker's logprob is the validator's + error + constant."""
    logits = np.full((len(rows), VOCAB), -40.0, dtype=np.float32)
    for j, (ids, scores, _, _) in enumerate(rows):
        logits[j, ids] = np.asarray(scores) - _noise(seed, j, ids)
    lp = _log_softmax(logits)
    listed = [
        {int(t): float(lp[j, t] + e + c) for t, e in zip(ids, errors)} for j, (ids, _, errors, c) in enumerate(rows)
    ]
    return listed, logits


def test_spreads_over_the_competing_tokens_and_over_every_listed_token():
    rows = [
        # within 3 of the best: tokens 5, 9 and 11 (2.9 below); 2 (3.1 below) and 40 (8 below) do not compete
        ([5, 9, 11, 2, 40], [1.0, 0.2, -1.9, -2.1, -7.0], [0.1, -0.05, 0.2, 0.9, -1.5], 0.3),
        # one token competes alone: its competing spread is 0, the listed spread is not
        ([7, 8, 30], [4.0, 0.5, -6.0], [0.0, 0.4, -0.6], -1.2),
        # every listed token competes (dict order is not score order)
        ([33, 1, 17], [-0.5, 0.0, -2.5], [0.25, -0.125, 0.0], 0.0),
        # a single listed token: nothing to spread
        ([12], [0.0], [0.7], 0.5),
    ]
    listed, logits = _build(rows)
    competing, every = competing_spreads(listed, logits, SEED)
    np.testing.assert_allclose(competing, [0.25, 0.0, 0.375, 0.0], atol=1e-5)
    np.testing.assert_allclose(every, [2.4, 1.0, 0.375, 0.0], atol=1e-5)
    assert competing.shape == every.shape == (4,)


def test_window_sets_which_tokens_compete():
    rows = [([3, 4, 6, 10], [0.0, -1.0, -2.0, -3.5], [0.0, 0.3, -0.4, 1.0], 0.0)]
    listed, logits = _build(rows)
    assert competing_spreads(listed, logits, SEED, window=0.5)[0][0] == pytest.approx(0.0, abs=1e-5)
    assert competing_spreads(listed, logits, SEED, window=1.5)[0][0] == pytest.approx(0.3, abs=1e-5)
    assert competing_spreads(listed, logits, SEED)[0][0] == pytest.approx(0.7, abs=1e-5)  # window 3
    assert competing_spreads(listed, logits, SEED, window=4.0)[0][0] == pytest.approx(1.4, abs=1e-5)
    assert COMPETING_WINDOW == 3.0  # twice the bfloat16 default margin, 2 x 0.75


def test_the_seeds_noise_decides_which_tokens_compete():
    """The same logits under another seed: the noisy scores move, so the competing set does; the all-listed
    spread does not depend on the seed."""
    rows = [([5, 9, 11, 2, 40], [1.0, 0.2, -1.9, -2.1, -7.0], [0.1, -0.05, 0.2, 0.9, -1.5], 0.3)]
    listed, logits = _build(rows)
    ids = np.array([5, 9, 11, 2, 40])
    lp = _log_softmax(logits)[0, ids]
    errors = np.array([0.1, -0.05, 0.2, 0.9, -1.5])

    def near(seed: int) -> np.ndarray:
        noisy = lp + _noise(seed, 0, ids)
        return noisy >= noisy.max() - 3.0

    assert list(near(SEED)) == [True, True, True, False, False]
    other = next(s for s in range(1000) if near(s)[3] and near(s).sum() >= 2)  # token 2 competes there
    competing, every = competing_spreads(listed, logits, other)
    chosen = errors[near(other)]
    assert competing[0] == pytest.approx(chosen.max() - chosen.min(), abs=1e-5)
    assert competing[0] >= 0.9 - 0.2 - 1e-5  # token 2's error 0.9 against at most 0.2 (or -1.5) for the rest
    assert every[0] == pytest.approx(2.4, abs=1e-5)


def test_unlisted_and_minus_infinity_entries_are_left_out():
    """-inf logprobs (vLLM lists them for tokens outside a nucleus) carry no error; they are dropped."""
    rows = [([5, 9, 11], [0.0, -0.5, -1.0], [0.2, 0.0, -0.1], 0.0)]
    listed, logits = _build(rows)
    listed[0][50] = -math.inf
    competing, every = competing_spreads(listed, logits, SEED)
    assert competing[0] == pytest.approx(0.3, abs=1e-5)
    assert every[0] == pytest.approx(0.3, abs=1e-5)


def test_random_positions_match_a_numpy_recomputation():
    rng = np.random.default_rng(7)
    n, seed = 24, 2**40 + 3
    logits = (rng.normal(size=(n, VOCAB)) * 2.5).astype(np.float32)
    lp = _log_softmax(logits)
    listed, ids_of, err_of = [], [], []
    for j in range(n):
        ids = rng.choice(VOCAB, size=int(rng.integers(1, 12)), replace=False)
        errors, shift = rng.normal(scale=0.2, size=len(ids)), rng.normal()
        listed.append({int(t): float(lp[j, t] + e + shift) for t, e in zip(ids, errors)})
        ids_of.append(ids)
        err_of.append(errors)
    want_competing, want_every = np.zeros(n), np.zeros(n)
    for j, (ids, errors) in enumerate(zip(ids_of, err_of)):
        if len(ids) < 2:
            continue
        noisy = lp[j, ids] + _noise(seed, j, ids)
        near = noisy >= noisy.max() - COMPETING_WINDOW
        want_every[j] = errors.max() - errors.min()
        want_competing[j] = errors[near].max() - errors[near].min()
    competing, every = competing_spreads(listed, logits, seed)
    np.testing.assert_allclose(competing, want_competing, atol=1e-5)
    np.testing.assert_allclose(every, want_every, atol=1e-5)
    assert (competing <= every + 1e-9).all()
    assert 0 < (competing < every - 1e-3).sum() < n  # the competing set differs from the listed one somewhere


def _tolerance_ref(spread: str, safety: str) -> float:
    """The smallest multiple of 0.01 that is at least safety x spread / 2, and at least 0.01, in exact decimals."""
    d = (Decimal(spread) * Decimal(safety) / 2).quantize(Decimal("0.01"), rounding=ROUND_CEILING)
    return float(max(d, Decimal("0.01")))


@pytest.mark.parametrize(
    ("spread", "safety"),
    [
        ("0.875", "2"),  # 0.875 -> 0.88
        ("0.125", "2"),  # 0.125 -> 0.13
        ("0.3", "2"),
        ("0.07", "2"),  # 100 x 2 x 0.07 / 2 is 7.000000000000001 in floats: still 0.07, not 0.08
        ("0.28", "1.5"),  # 21.000000000000004 in floats: 0.21
        ("0.29", "2"),
        ("0.5", "1"),  # no safety: half the spread holds it
        ("0.5", "3"),
        ("0.25", "1.5"),
        ("0.333", "2"),
        ("0", "2"),  # the minimum
        ("0.001", "2"),
        ("0.01", "1"),
        ("4.2", "2"),
    ],
)
def test_tolerance_is_safety_times_half_the_spread_rounded_up_to_a_hundredth(spread, safety):
    d = replay_tolerance(float(spread), float(safety))
    assert d == pytest.approx(_tolerance_ref(spread, safety), abs=1e-12)
    assert 2 * d >= float(safety) * float(spread) - 1e-9  # the margin 2 d holds safety x the spread


def test_tolerance_default_safety_is_two():
    assert replay_tolerance(0.875) == pytest.approx(0.88)
    assert replay_tolerance(0.0) == pytest.approx(0.01)


@pytest.mark.parametrize(("spread", "safety"), [(-0.1, 2.0), (math.nan, 2.0), (math.inf, 2.0), (0.5, 0.5)])
def test_tolerance_refuses_a_negative_or_undefined_spread_and_a_safety_below_one(spread, safety):
    with pytest.raises(ValueError):
        replay_tolerance(spread, safety)


def test_near_tie_gaps_are_the_replayed_best_minus_the_token_at_positions_off_the_choice():
    """Three positions built on the seed's noise: the token is the choice (no gap), second by 0.3, third by 0.7
    (at temperature 0.5 the tempered gaps are doubled and the raw gaps given back)."""
    from gpu_workers.calibration import near_tie_gaps

    temperature, wanted = 0.5, [None, 0.3, 0.7]
    logits, tokens = np.full((3, VOCAB), -60.0), []
    for j, gap in enumerate(wanted):
        g = _noise(SEED, j, range(VOCAB))
        a, b, c = 5, 17, 40  # the best, then b and c below it, in tempered noisy score
        for token, below in ((a, 0.0), (b, 0.3 / temperature), (c, 0.7 / temperature)):
            logits[j, token] = temperature * (10.0 - below - g[token])
        tokens.append(a if gap is None else (b if gap == 0.3 else c))
    got = near_tie_gaps(tokens, torch.as_tensor(logits, dtype=torch.float32), SEED, temperature)
    assert got == pytest.approx([0.3, 0.7], abs=1e-4)
    assert len(near_tie_gaps([5, 5, 5], torch.as_tensor(logits, dtype=torch.float32), SEED, temperature)) == 0
    with pytest.raises(ValueError, match="2 tokens for logits of shape"):
        near_tie_gaps([5, 5], torch.as_tensor(logits), SEED)


@pytest.mark.parametrize("gap", [0.0, 0.005, 0.03, 0.38, 1.234])
def test_tie_tolerance_holds_the_largest_gap_in_hundredths(gap):
    from gpu_workers.calibration import tie_tolerance

    want = max(Decimal("0.01"), (Decimal(repr(gap)) / 2).quantize(Decimal("0.01"), rounding=ROUND_CEILING))
    assert tie_tolerance(gap) == float(want)
    assert 2 * tie_tolerance(gap) >= gap


def test_near_tie_rate_is_the_safety_times_the_honest_cost_rounded_up():
    from gpu_workers.calibration import near_tie_rate

    assert near_tie_rate(0.00057, 2.0) == 0.0012
    assert near_tie_rate(0.0, 2.0) == 0.0001
    assert near_tie_rate(0.0125, 1.5) == 0.0188
    for bad in ((-0.1, 2.0), (float("nan"), 2.0), (0.01, 0.5)):
        with pytest.raises(ValueError):
            near_tie_rate(*bad)


def test_logprob_tolerance_is_the_safety_times_the_largest_difference_in_hundredths():
    from gpu_workers.calibration import logprob_tolerance

    assert logprob_tolerance(0.36, 2.0) == 0.72
    assert logprob_tolerance(1.0408, 1.5) == 1.57
    assert logprob_tolerance(0.0, 2.0) == 0.01
    with pytest.raises(ValueError):
        logprob_tolerance(float("inf"), 2.0)


def _tied_sample(seed: int, n: int, ties: dict[int, float], vocab: int = 32):
    """Logits [n, vocab] under which the replayable sampler's choice at every position is token 1, and token 2
    scores short of it by ties[i] (noise included) at the positions in `ties`: the completion takes token 2
    there (an honest engine's rounding flip) and token 1 elsewhere."""
    from gpu_workers.replay import gumbel_noise

    g = gumbel_noise([seed] * n, list(range(n)), vocab)
    z = -g - 5.0  # every noisy score -5
    z[:, 1] += 6.0  # token 1: noisy score 1, the best
    for i, gap in ties.items():
        z[i, 2] += 6.0 - gap
    tokens = [2 if i in ties else 1 for i in range(n)]
    return tokens, z, seed


def test_calibrated_budgets_hold_honest_samples_the_defaults_reject():
    """SmolLM2-135M-Instruct in bfloat16 ties on 2.5% of its tokens: an honest 8-token sample with three rounding
    flips costs more than the default per-sample budget (1 + 0.05 x 8), and an honest batch more than 0.02 per
    token. Budgets from `near_tie_budgets` over such samples let the real checks accept them."""
    from gpu_workers.calibration import near_tie_budgets
    from gpu_workers.checks import SamplingTolerance, check_near_tie_budget, check_replay_batch

    tol = SamplingTolerance(replay_logit_tolerance=0.88, tie_logit_tolerance=0.1)  # SmolLM2's calibration
    tie_margin = 2 * 0.1
    samples = [_tied_sample(7, 8, {1: 0.6 * tie_margin, 4: 0.5 * tie_margin, 6: 0.7 * tie_margin})]
    samples += [_tied_sample(100 + k, 8, {k % 8: 0.3 * tie_margin}) for k in range(7)]
    replayed = check_replay_batch(samples, 1.0, 1.0, tol, "float32")
    assert all(v.numbers["off_seed_tokens"] == 0 for v in replayed)
    costs = [v.numbers["near_tie_cost"] for v in replayed]
    assert [v.numbers["near_ties"] for v in replayed] == [3] + [1] * 7
    assert not replayed[0].passed and "over the budget" in replayed[0].reasons[0]  # the defaults reject it
    assert not check_near_tie_budget(replayed, tol).passed  # and the batch: cost/token above 0.02

    budgets = near_tie_budgets(costs, [8] * 8, [0] * 8, safety=2.0, rate_safety=2.0)
    calibrated = SamplingTolerance(
        replay_logit_tolerance=0.88,
        tie_logit_tolerance=0.1,
        near_ties_per_token=budgets["near_ties_per_token"],
        near_ties_per_batch_token=budgets["near_ties_per_batch_token"],
    )
    again = check_replay_batch(samples, 1.0, 1.0, calibrated, "float32")
    assert all(v.passed for v in again)
    assert check_near_tie_budget(again, calibrated).passed
    # the room is what was measured times the safety factor, not more: twice the worst sample's excess fits,
    # three times does not
    worst = replayed[0].numbers
    assert 1 + budgets["near_ties_per_token"] * 8 >= 1 + 2 * (worst["near_tie_cost"] - 1)
    assert 1 + budgets["near_ties_per_token"] * 8 < 1 + 3 * (worst["near_tie_cost"] - 1)


def test_budgets_stay_at_the_defaults_where_honest_work_fits_them():
    from gpu_workers.calibration import near_tie_budgets
    from gpu_workers.checks import SamplingTolerance

    d = SamplingTolerance()
    # the demo's bfloat16 policy: a near tie in a few samples, at most one per sample, 0.3% of the tokens
    costs = [0.0] * 60 + [0.4, 0.7, 1.0, 0.3]
    budgets = near_tie_budgets(costs, [9] * 64, [0] * 32 + [1] * 32)
    assert budgets["near_ties_per_token"] == d.near_ties_per_token
    assert budgets["near_ties_per_batch_token"] == d.near_ties_per_batch_token
    with pytest.raises(ValueError):
        near_tie_budgets([1.0], [8, 8], [0])


def _logprob_sample(rng: np.random.Generator, errors, vocab: int = 64):
    """(tokens, stored logprobs, logits) of a completion whose stored logprobs are the validator's recomputed ones
    (T 1, top-p 1) plus `errors`: what an engine's rounding (or a worker) did to them."""
    n = len(errors)
    logits = rng.normal(0.0, 1.0, (n, vocab)).astype(np.float32)
    tokens = rng.integers(0, vocab, n)
    recomputed = _log_softmax(logits.astype(np.float64))[np.arange(n), tokens]
    return tokens.tolist(), (recomputed + np.asarray(errors)).tolist(), logits


# SmolLM2-135M-Instruct in bfloat16: an honest 3-token sample whose stored logprobs sat above the validator's by
# 0.19 on average (largest 0.306), over the default one-direction bound 0.05 + (0.1 + 0.306) / 3 = 0.185
SMOL_SHORT = [0.306, 0.17, 0.094]


def test_a_logprob_shift_on_every_token_stays_rejected_where_calibrated_bounds_accept_honest_short_samples():
    """The attack: a worker raises every claimed logprob of a 32-token sample by 0.07 nats (its sequence's ratio
    x e^2.2 wherever the learner reads the claim). The defaults reject it and reject SMOL_SHORT. Bounds that
    `logprob_mean_bounds` calibrates from honest work with SMOL_SHORT in it accept every honest sample and still
    reject the shift: honest errors of few tokens need a constant room, not room per token."""
    from gpu_workers.calibration import logprob_mean_bounds
    from gpu_workers.checks import SamplingTolerance, check_sampling_batch

    rng = np.random.default_rng(0)
    honest_errors = [SMOL_SHORT] + [rng.normal(0.0, 0.03, n) for n in (8, 16, 32, 32, 5, 12, 32, 20)]
    honest = [_logprob_sample(rng, e) for e in honest_errors]
    shifted = _logprob_sample(rng, 0.07 + rng.normal(0.0, 0.01, 32))

    defaults = SamplingTolerance()
    judged = check_sampling_batch(honest + [shifted], 1.0, 1.0, defaults, "bfloat16")
    assert not judged[0].passed and "one direction" in judged[0].reasons[0]  # the defaults reject honest work
    assert all(v.passed for v in judged[1:-1])
    assert not judged[-1].passed

    bounds = logprob_mean_bounds(honest_errors, "bfloat16", safety=2.0)
    calibrated = SamplingTolerance(
        mean_logprob_diff=bounds["mean_logprob_diff"],
        mean_signed_logprob_diff=bounds["mean_signed_logprob_diff"],
        logprob_diff_allowance=bounds["logprob_diff_allowance"],
    )
    again = check_sampling_batch(honest + [shifted], 1.0, 1.0, calibrated, "bfloat16")
    assert all(v.passed for v in again[:-1]), [v.reasons for v in again[:-1]]
    assert not again[-1].passed and "one direction" in " ".join(again[-1].reasons)
    # room per token sized to the short sample instead (2 x its need per token, 0.11) would let the shift through
    per_token = SamplingTolerance(mean_signed_logprob_diff=0.11)
    assert check_sampling_batch([shifted], 1.0, 1.0, per_token, "bfloat16")[0].passed
    # no room per token beyond the defaults (honest errors are centred), the room per sample from SMOL_SHORT
    assert bounds["mean_signed_logprob_diff"] == defaults.mean_signed_logprob_diff
    assert bounds["mean_logprob_diff"] == 0.15
    # the room is what was measured times the safety factor, not more: SMOL_SHORT shifted by twice its honest
    # excess over the per-token room fits, three times does not
    excess = sum(SMOL_SHORT) - max(SMOL_SHORT) - 0.05 * 3
    assert bounds["logprob_diff_allowance"] >= 2 * excess
    for times, passes in ((2, True), (3, False)):
        moved = [SMOL_SHORT[0], SMOL_SHORT[1] + (times - 1) * excess / 2, SMOL_SHORT[2] + (times - 1) * excess / 2]
        verdict = check_sampling_batch([_logprob_sample(rng, moved)], 1.0, 1.0, calibrated, "bfloat16")[0]
        assert verdict.passed is passes, (times, verdict.reasons)


def test_logprob_bounds_follow_an_honest_bias_and_stay_at_the_defaults_where_honest_work_fits_them():
    from gpu_workers.calibration import logprob_mean_bounds
    from gpu_workers.checks import SamplingTolerance

    d = SamplingTolerance()
    rng = np.random.default_rng(1)
    centred = [rng.normal(0.0, 0.02, 16) for _ in range(32)]
    bounds = logprob_mean_bounds(centred, "bfloat16")
    assert bounds["mean_signed_logprob_diff"] == d.mean_signed_logprob_diff
    assert bounds["logprob_diff_allowance"] == d.logprob_diff_allowance
    assert bounds["mean_logprob_diff"] == 0.15
    assert logprob_mean_bounds(centred, "float32")["mean_logprob_diff"] == 0.05
    # engines that disagree one way by 0.04 nats a token (a real bias, every sample): twice it per token
    biased = [0.04 + rng.normal(0.0, 0.005, 16) for _ in range(32)]
    b = logprob_mean_bounds(biased, "bfloat16")
    assert b["signed_bias"] == pytest.approx(0.04, abs=0.003)
    assert b["mean_signed_logprob_diff"] == pytest.approx(0.08, abs=0.011)
    with pytest.raises(ValueError):
        logprob_mean_bounds([np.array([np.nan])], "bfloat16")


# What `intellect calibrate` measured (near_tie_rate written, honest near-tie cost per token, completion tokens of
# its 2,048 honest samples), and the near-tie cheater against that calibration, strike-free
# (benchmarks/near_tie_cheater.py; benchmarks/RESULTS.md, issue 49): its choices and gain per sample
CHEATER_MEASURED = {
    "demo, RL step 10": (0.0038, 0.001878, 16399, 36 / 1024, 0.0371),
    "demo, RL step 30": (0.0023, 0.001142, 16397, 27 / 1024, 0.0312),
    "SmolLM2-135M-Instruct on syllogisms": (0.0267, 0.013309, 14973, 31 / 320, 0.0905),
}


@pytest.mark.parametrize("pool", sorted(CHEATER_MEASURED))
def test_near_tie_freedom_bounds_the_choices_a_cheater_bought_and_warns_where_it_gained_over_the_target(pool):
    from gpu_workers.calibration import FREEDOM_WARNING, freedom_warning, near_tie_freedom
    from gpu_workers.verdicts import SamplingTolerance

    rate, honest, tokens, choices, gain = CHEATER_MEASURED[pool]
    free = near_tie_freedom(rate, honest, tokens / 2048)
    assert free["choices_low"] == pytest.approx((rate - honest) * tokens / 2048)
    assert free["choices_high"] == pytest.approx(free["choices_low"] / SamplingTolerance.near_tie_floor)
    assert choices <= free["choices_high"]  # what the cheater bought is within what the ledger left it
    assert gain > FREEDOM_WARNING  # each of these pools let it gain more than the target: the command says so
    warning = freedom_warning(free, "bfloat16")
    assert warning and "float32" in warning and f"{free['choices_high']:.3f}" in warning


def test_a_ledger_at_the_honest_rate_leaves_no_freedom_and_no_warning():
    from gpu_workers.calibration import freedom_warning, near_tie_freedom

    free = near_tie_freedom(0.0023, 0.0023, 8.0)
    assert free == {"cost": 0.0, "choices_low": 0.0, "choices_high": 0.0}
    assert freedom_warning(free, "bfloat16") is None
    assert freedom_warning(near_tie_freedom(0.0018, 0.0009, 8.0), "bfloat16") is None  # 0.0288: below 0.03
    with pytest.raises(ValueError, match="finite"):
        near_tie_freedom(math.inf, 0.0, 8.0)
