"""Near-tie budgets that fit short completions and a tie margin measured per model (issue 36, item 2).

- The batch budget is a share of the batch's tokens (at least one near tie at full price), not 1 + a share: a
  64-token batch could buy 9 floor-priced choices (14% of its tokens) under 1 + 0.02 per token.
- With `tie_logit_tolerance` measured for the model, a choice anywhere past the honest near ties' gaps costs 1,
  while an honest near tie (a gap of a few hundredths of a logit) stays near the floor.

Rows are built on the seed's own noise (`gumbel_noise`, checked against a numpy hash in test_replay.py), so every
token's noisy score, and so every gap, is known by hand.
"""

from __future__ import annotations

import pytest
import torch

from gpu_workers.checks import CheckVerdict, SamplingTolerance, check_near_tie_budget, check_replay_batch
from gpu_workers.replay import gumbel_noise

VOCAB, SEED = 32, 77
FLOOR = SamplingTolerance().near_tie_floor


def _replayed(costs: list[float], tokens: int) -> list[CheckVerdict]:
    """One sample's replay verdict per cost (the batch's tokens shared among them)."""
    shares = [tokens // len(costs) + (i < tokens % len(costs)) for i in range(len(costs))]
    return [
        CheckVerdict("replay", True, numbers={"near_ties": 1, "near_tie_cost": c, "tokens": n})
        for c, n in zip(costs, shares)
    ]


def test_a_short_batch_cannot_buy_more_floor_priced_choices_than_a_long_one_per_token():
    cheap = _replayed([FLOOR] * 9, 64)  # 9 floor-priced choices in 64 tokens: 14%
    verdict = check_near_tie_budget(cheap, SamplingTolerance())
    assert not verdict.passed and verdict.numbers["near_tie_budget"] == pytest.approx(1.28)
    assert check_near_tie_budget(_replayed([FLOOR] * 5, 64), SamplingTolerance()).passed  # 8%, as in a long batch
    long = _replayed([FLOOR] * 80, 1024)  # 8% of a long batch's tokens
    assert check_near_tie_budget(long, SamplingTolerance()).passed
    # a batch always holds one near tie at full price, however short
    assert check_near_tie_budget(_replayed([1.0], 8), SamplingTolerance()).passed
    assert not check_near_tie_budget(_replayed([1.0, FLOOR], 8), SamplingTolerance()).passed


def _row_with_runner_up(gap: float, position: int = 0) -> tuple[torch.Tensor, int, int]:
    """Logits where token `best` wins the seed's noisy max and `runner` trails it by `gap` (temperature 1)."""
    g = gumbel_noise([SEED], [position], VOCAB)[0]
    best, runner = 3, 11
    row = torch.full((VOCAB,), -40.0)
    row[best] = 5.0 - g[best]
    row[runner] = 5.0 - gap - g[runner]
    return row, best, runner


@pytest.mark.parametrize("gap", [0.02, 0.05, 0.5, 1.2])
def test_a_measured_tie_margin_prices_choices_past_the_honest_gaps_at_one(gap):
    row, best, runner = _row_with_runner_up(gap)
    (own,) = check_replay_batch([([best], row[None], SEED)], 1.0, 1.0)
    assert own.passed and own.numbers["near_ties"] == 0
    default = SamplingTolerance()  # t = d = 0.75: priced on the 1.5-logit margin
    measured = SamplingTolerance(tie_logit_tolerance=0.07)  # tie margin 0.14: the demo policy's honest gaps
    (before,) = check_replay_batch([([runner], row[None], SEED)], 1.0, 1.0, default)
    (after,) = check_replay_batch([([runner], row[None], SEED)], 1.0, 1.0, measured)
    assert before.passed and after.passed  # within the margin both ways: a near tie, priced
    assert before.numbers["near_tie_cost"] == pytest.approx(FLOOR + (1 - FLOOR) * gap / 1.5, abs=1e-4)
    assert after.numbers["near_tie_cost"] == pytest.approx(min(1.0, FLOOR + (1 - FLOOR) * gap / 0.14), abs=1e-4)
    assert after.numbers["tie_margin"] == pytest.approx(0.14)
    if gap >= 0.14:
        assert after.numbers["near_tie_cost"] == 1.0 > before.numbers["near_tie_cost"]
    # the replay margin still bounds what passes
    (past,) = check_replay_batch(
        [([runner], row[None], SEED)], 1.0, 1.0, SamplingTolerance(replay_logit_tolerance=0.01)
    )
    assert past.passed == (gap <= 0.02)
