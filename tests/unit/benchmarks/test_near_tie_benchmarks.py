"""benchmarks/near_tie_cheater.py's cheapest near tie of a sample against a numpy recomputation, and
benchmarks/near_tie_ledger.py's replay of the learner's default (near-tie samples left out) on a batch worked by
hand."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from near_tie_cheater import cheapest_near_tie  # noqa: E402
from near_tie_ledger import dropping  # noqa: E402

from gpu_workers.replay import noise_at  # noqa: E402


def test_the_cheapest_near_tie_is_the_runner_up_s_smallest_gap_priced_as_the_replay_prices_it():
    rng = np.random.default_rng(0)
    n, vocab, seed, temperature = 6, 40, 77, 0.8
    logits = torch.as_tensor(rng.normal(0, 1.5, (n, vocab)), dtype=torch.float32)
    noisy = np.stack(
        [
            logits[j].double().numpy() / temperature
            + noise_at([seed] * vocab, [j] * vocab, torch.arange(vocab)).double().numpy()
            for j in range(n)
        ]
    )
    tokens = noisy.argmax(-1).tolist()  # the seed's own choices: a sample with no near tie
    runner_up = np.sort(noisy, -1)[:, -2]
    gaps = noisy.max(-1) - runner_up
    margin, tie_margin = float(np.quantile(gaps, 0.7)), float(np.min(gaps)) * 2
    held = gaps[gaps <= margin]
    expected = np.min(0.25 + 0.75 * np.minimum(held / tie_margin, 1))
    got = cheapest_near_tie(tokens, logits, seed, temperature, margin, tie_margin)
    assert got == pytest.approx(expected, abs=1e-4)
    assert cheapest_near_tie(tokens, logits, seed, temperature, float(gaps.min()) / 2, tie_margin) is None


BATCH = {  # 4 samples of 8 tokens; sample 2 has an honest near tie (0.5); sample 1's answer costs nothing
    "rewards": [1.0, 0.0, 0.0, 0.0],
    "cost": [0.0, 0.0, 0.5, 0.0],
    "tokens": [8, 8, 8, 8],
    "honest_accepted": True,
    "candidates": [[1, 0.0, 8, 0], [3, 0.6, 8, 1]],  # [sample, near-tie cost, tokens, choices]
    "cheapest": [0.3, 0.3, 0.0, None],  # sample 3 offers no near tie to take
}
BUDGETS = (1.0, 0.05, 0.02)  # per-batch budget max(1, 0.02 x 32 tokens) = 1


def test_left_out_near_tie_samples_leave_the_cheater_only_free_swaps_and_what_it_can_pay_to_keep_out():
    # trained by an honest worker: samples 0, 1, 3 (2 took a near tie): mean 1/3
    # the cheater: the free swap makes sample 1 right; the paid swap of sample 3 would take a near tie (left out);
    # at each sample's own price it cannot keep sample 3 out (none offered): it trains 0, 1, 3 = 2/3
    measured = dropping([BATCH], rate=1.0, slack=10.0, budgets=BUDGETS, drop_cost=None)
    assert measured["gain_points"] == pytest.approx(100 * (2 / 3 - 1 / 3), abs=0.01)
    assert (measured["free_swaps"], measured["selected"], measured["honest_dropped_share"]) == (1, 0, 0.25)
    # at the floor price, assumed available anywhere, it keeps sample 3 out too (cost 0.5 + 0.25 within 1): 2 of 2
    floor = dropping([BATCH], rate=1.0, slack=10.0, budgets=BUDGETS, drop_cost=0.25)
    assert floor["gain_points"] == pytest.approx(100 * (1 - 1 / 3), abs=0.01) and floor["selected"] == 1
    # a ledger with 0.6 of room leaves no room for that near tie (0.75 > 0.6): back to the free swap alone
    tight = dropping([BATCH], rate=0.0, slack=0.6, budgets=BUDGETS, drop_cost=0.25)
    assert tight["gain_points"] == pytest.approx(100 * (2 / 3 - 1 / 3), abs=0.01) and tight["strikes"] == 0
