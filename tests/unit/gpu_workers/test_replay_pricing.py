"""The replay check prices every deviation from the replayed argmax: no free choice at the top-p boundary, no
negative cost for a token outside the validator's nucleus (issue 36, item 3).

Each case is built on crafted logits around the seed's own noise (`gumbel_noise`, itself checked against an
independent numpy hash in test_replay.py), so the scores, the nucleus and the costs are known by hand.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gpu_workers.checks import SamplingTolerance, check_replay_batch
from gpu_workers.replay import gumbel_noise

FLOOR = SamplingTolerance().near_tie_floor
MARGIN = 2 * 0.75  # the bfloat16 default replay logit tolerance, at temperature 1


def _row(probs: dict[int, float], vocab: int) -> torch.Tensor:
    """Logits whose softmax gives `probs` to the named tokens and shares the rest equally among the others."""
    rest = (1 - sum(probs.values())) / (vocab - len(probs))
    row = torch.full((vocab,), math.log(rest) if rest > 0 else -30.0)
    for token, p in probs.items():
        row[token] = math.log(p)
    return row


def _nucleus(row: torch.Tensor, top_p: float) -> set[int]:
    """vLLM's top-p set written out: in descending probability, a token is kept while the mass before it is
    below top_p."""
    probs = np.exp(row.double().numpy() - row.double().numpy().max())
    probs /= probs.sum()
    kept, before = set(), 0.0
    for token in np.argsort(-probs, kind="stable"):
        if before >= top_p:
            break
        kept.add(int(token))
        before += probs[token]
    return kept


def test_the_top_p_pass_over_makes_no_choice_free():
    """The seed's choice is the second most likely token (p = 0.29, inside the nucleus whatever the sampling
    check's logit tolerance); a cheater submits the most likely one (p = 0.70). The replay's own slack (3x the
    sampling check's) said the worker's nucleus might not have held the seed's choice, passed over it and
    accepted the cheater's token at cost 0."""
    vocab, seed, top_p = 16, 3, 0.9
    g = gumbel_noise([seed], [0], vocab)[0]
    cheat, chosen = int(g.argmin()), int(g.argmax())
    row = _row({cheat: 0.70, chosen: 0.29}, vocab)
    assert _nucleus(row, top_p) == {cheat, chosen}
    gap = float((row[chosen] + g[chosen]) - (row[cheat] + g[cheat]))
    assert gap > MARGIN, f"the seed's choice beats the cheat by {gap:.2f} only: not the case meant"
    (verdict,) = check_replay_batch([([cheat], row[None], seed)], 1.0, top_p)
    assert not verdict.passed and verdict.numbers["off_seed_tokens"] == 1, verdict.numbers
    (honest,) = check_replay_batch([([chosen], row[None], seed)], 1.0, top_p)
    assert honest.passed and honest.numbers["near_ties"] == 0 and honest.numbers["near_tie_cost"] == 0


def test_a_best_token_passed_over_at_the_boundary_costs_the_floor():
    """The validator's best token (p = 0.07) sits where a worker's logits, off by the sampling check's
    tolerance, could have left it out of the nucleus: the worker's next choice passes, priced at the floor."""
    vocab, seed, top_p = 64, 8, 0.9
    g = gumbel_noise([seed], [0], vocab)[0]
    order = torch.argsort(g)
    top, boundary, next_out = int(order[0]), int(order[-1]), int(order[vocab // 2])
    row = _row({top: 0.88, boundary: 0.07, next_out: 0.04}, vocab)
    assert _nucleus(row, top_p) == {top, boundary}
    gap = float((row[boundary] + g[boundary]) - (row[top] + g[top]))
    assert gap > MARGIN, f"the boundary token beats the top one by {gap:.2f} only: not the case meant"
    (verdict,) = check_replay_batch([([top], row[None], seed)], 1.0, top_p)
    assert verdict.passed, verdict.reasons
    assert verdict.numbers["near_ties"] == 1 and verdict.numbers["near_tie_cost"] == pytest.approx(FLOOR)


def _near_ties_and_one_outside(seed: int, vocab: int = 64):
    """Four positions: at 0-2 the runner-up's noisy score is 0.4 short of the best (a near tie costing
    0.25 + 0.75 x 0.4 / 1.5 = 0.45 each; 1.35 in all, over the sample's budget of 1 + 0.05 x 4 = 1.2);
    at 3 the validator's nucleus holds one token, and another token just outside it scores 1.5 above it."""
    g = gumbel_noise([seed] * 4, list(range(4)), vocab)
    logits = torch.full((4, vocab), -30.0)
    best, runner_up = [], []
    for i in range(3):
        order = torch.argsort(g[i], descending=True)
        a, b = int(order[0]), int(order[1])
        logits[i, a] = 0.0
        logits[i, b] = float(g[i, a] - g[i, b]) - 0.4
        assert abs(float(logits[i, b])) < math.log(9), "one of the two alone would fill the nucleus"
        best.append(a)
        runner_up.append(b)
    a, b = int(g[3].argmin()), int(g[3].argmax())
    logits[3, a] = 0.0
    logits[3, b] = -(float(g[3, b] - g[3, a]) - MARGIN)
    assert float(logits[3, b]) < -math.log(9), "the outside token would be inside the nucleus: not the case meant"
    return logits, best, runner_up, (a, b)


def test_a_token_outside_the_nucleus_refunds_no_near_tie_cost():
    """Three near ties that fail alone (1.35 > 1.2) passed with one token outside the validator's nucleus whose
    score, taken over unmasked logits, beat the nucleus's best: a negative gap and a cost of 0.25 - 0.75."""
    seed, top_p = 21, 0.9
    logits, best, runner_up, (inside, outside) = _near_ties_and_one_outside(seed)
    assert _nucleus(logits[3], top_p) == {inside}
    (alone,) = check_replay_batch([(runner_up + [inside], logits, seed)], 1.0, top_p)
    assert alone.numbers["near_ties"] == 3 and alone.numbers["near_tie_cost"] == pytest.approx(1.35, abs=1e-4)
    assert not alone.passed
    (refunded,) = check_replay_batch([(runner_up + [outside], logits, seed)], 1.0, top_p)
    assert refunded.numbers["near_ties"] + refunded.numbers["off_seed_tokens"] == 4
    assert refunded.numbers["near_tie_cost"] >= 1.35 + FLOOR - 1e-4 or refunded.numbers["off_seed_tokens"] == 1
    assert not refunded.passed, refunded.numbers
    (honest,) = check_replay_batch([(best + [inside], logits, seed)], 1.0, top_p)
    assert honest.passed and honest.numbers["near_ties"] == 0


@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.5])
def test_every_token_off_the_replayed_argmax_costs_at_least_the_floor(top_p):
    """On random logits and random submitted tokens among the likely ones, every position whose token is not
    the validator's Gumbel-max over its own nucleus (computed here with a sort) is off-seed or a near tie,
    and the near ties cost at least the floor each."""
    gen = torch.Generator().manual_seed(5)
    vocab, n = 12, 300
    logits = torch.randn(n, vocab, generator=gen) * 1.5
    noise = gumbel_noise([9] * n, list(range(n)), vocab)
    argmax = []
    for i in range(n):
        kept = sorted(_nucleus(logits[i], top_p))
        argmax.append(kept[int(torch.argmax(logits[i, kept] + noise[i, kept]))])
    tokens = torch.topk(logits + torch.rand(n, vocab, generator=gen) * 3, 1).indices[:, 0]
    (verdict,) = check_replay_batch([(tokens, logits, 9)], 1.0, top_p)
    differ = int(sum(int(t) != a for t, a in zip(tokens, argmax)))
    assert differ > 30
    assert verdict.numbers["off_seed_tokens"] + verdict.numbers["near_ties"] == differ
    assert verdict.numbers["near_tie_cost"] >= FLOOR * verdict.numbers["near_ties"] - 1e-6
