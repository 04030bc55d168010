"""The replay check: every sampled token is the replayable sampler's choice for its seed and position
(`check_replay_batch`), and the batch's near ties stay within their budget (`check_near_tie_budget`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from gpu_workers.verdicts import _SHOWN, CheckVerdict, SamplingTolerance

if TYPE_CHECKING:
    import torch


REPLAY_LOGIT_TOLERANCE = {"float32": 0.02, "float16": 0.25, "bfloat16": 0.75}
"""Default `SamplingTolerance.replay_logit_tolerance` per worker dtype, from honest vLLM-worker / transformers-
validator runs (`tests/integration/test_replay_attacks.py` prints them): the largest replay gap seen was 0.50
logit units in bfloat16 (a peaked policy at T 0.6, top-p 0.9) and 0 in float32; the defaults leave room for
larger models, whose logits are larger and round coarser in bfloat16. Near ties grow with the model: at most 1.7%
of an honest bfloat16 tiny model's tokens (none in float32), 3.7-5.1% at the Qwen2.5-0.5B shape with random
weights (a flat policy), each with a gap under 0.21 of the margin; `SamplingTolerance.near_tie_floor` prices
them by their gap."""


def near_tie_costs(gaps, tie_margin: float, floor: float = SamplingTolerance.near_tie_floor):
    """What each near tie costs against the budgets, from its gap (the tie margin in the same units): `floor` +
    (1 - `floor`) x gap / tie margin, at most 1. Takes and returns a torch tensor or a numpy array."""
    ratio = gaps / tie_margin
    return floor + (1 - floor) * (ratio.clamp(max=1) if hasattr(ratio, "clamp") else ratio.clip(max=1))


def check_replay_batch(
    completions: Sequence[tuple[Sequence[int], Any, int]],
    temperature: float,
    top_p: float,
    tolerance: SamplingTolerance = SamplingTolerance(),
    dtype: str = "bfloat16",
    device: str = "cpu",
) -> list[CheckVerdict]:
    """Exact replay of the replayable sampler (`gpu_workers.replay`) on (tokens, logits [n, vocab], seed)
    completions (seed: an int, whose tokens are at positions 0..n-1; or a (seeds, positions) pair of sequences,
    one entry per token: a multi-turn episode's sampled tokens, each with its turn's seed and its position in
    its turn): one "replay" verdict per completion (`check_near_tie_budget` judges the batch's near ties).
    Each completion's logits are moved to `device` (a torch device) and replayed there; the noise is exact
    integer arithmetic on any device.

    At every position i the validator recomputes z = logits / T over its own top-p nucleus, the noise
    g(seed, i, j) and the best noisy score; the submitted token t passes when z_t + g_t is within the margin
    2 d / T of that best score (d = the logit tolerance), since each of the two scores can be off by d / T. A
    token that passes without being the validator's own argmax is a near tie: it may be an honest rounding
    difference or a cheater's choice, so near ties are priced by their gap (`SamplingTolerance.near_tie_floor`)
    against a per-sample and a per-batch budget.
    With top-p < 1, a best token that the worker's logits could have left outside its nucleus (given the
    sampling check's `logit_tolerance`, the nucleus that check allows for) is passed over; the token then
    chosen is a near tie all the same. Every token that is not the validator's own choice costs at least
    `near_tie_floor`: its gap is measured to the best over the nucleus plus the token itself, so a token
    outside the nucleus scoring above the nucleus's best has gap 0, never a negative one.

    The typicality score is a second signal, reported, not judged: the sample's summed logprob minus its
    expectation under the validator's distribution at those positions, over the standard deviation of that sum
    (about standard normal for an honestly sampled completion; strongly positive when a cheater keeps picking
    likely tokens, strongly negative for unlikely ones).
    """
    import torch

    if not temperature > 0 or not 0 < top_p <= 1:
        raise ValueError(f"temperature must be > 0 and top_p in (0, 1], got {temperature} and {top_p}")
    d = (
        tolerance.replay_logit_tolerance
        if tolerance.replay_logit_tolerance is not None
        else REPLAY_LOGIT_TOLERANCE.get(dtype, REPLAY_LOGIT_TOLERANCE["bfloat16"])
    )
    # the work is many small elementwise passes: torch's thread pool costs more than it brings there (on a busy
    # 2-core host a sample took 0.7-0.9 s with 2 threads and 12-16 ms with one)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        slack = tolerance.logit_tolerance / temperature  # the sampling check's: the nucleus it allows for
        t = tolerance.tie_logit_tolerance if tolerance.tie_logit_tolerance is not None else d
        return _replay(
            completions, temperature, top_p, tolerance, 2 * d / temperature, slack, device, 2 * t / temperature
        )
    finally:
        torch.set_num_threads(threads)


def _replay(
    completions,
    temperature: float,
    top_p: float,
    tolerance: SamplingTolerance,
    margin: float,
    slack: float,
    device: str = "cpu",
    tie_margin: float | None = None,
) -> list[CheckVerdict]:
    """`check_replay_batch`'s work, one completion at a time; near ties are priced on `tie_margin` (default: the
    margin)."""
    import torch

    from gpu_workers.replay import noise_at, noisy_max

    tie_margin = margin if tie_margin is None else tie_margin
    verdicts = []
    for tokens, logits, seed in completions:
        logits = torch.as_tensor(logits).to(device).float()
        tokens = torch.as_tensor(np.asarray(tokens, dtype=np.int64)).to(device)
        n = len(tokens)
        if logits.ndim != 2 or logits.shape[0] != n or n == 0:
            verdicts.append(CheckVerdict("replay", False, (f"{n} tokens for logits of shape {tuple(logits.shape)}",)))
            continue
        if bool(((tokens < 0) | (tokens >= logits.shape[1])).any()):
            verdicts.append(CheckVerdict("replay", False, ("token ids outside the vocab",)))
            continue
        z = logits / temperature
        kept = _top_p_kept(z, top_p) if top_p < 1 else torch.ones_like(z, dtype=torch.bool)
        masked = z.masked_fill(~kept, -math.inf)
        if isinstance(seed, tuple):  # a multi-turn episode's tokens: each with its turn's seed and position
            seeds, positions = [int(x) for x in seed[0]], [int(x) for x in seed[1]]
            if len(seeds) != n or len(positions) != n:
                verdicts.append(CheckVerdict("replay", False, (f"{len(seeds)} seeds for {n} tokens",)))
                continue
            named = f"the seeds of sample {seeds[0]}'s turns"
        else:
            seeds, positions = [int(seed)] * n, list(range(n))
            named = f"seed {int(seed)}"
        rows = torch.arange(n, device=logits.device)
        choice, best = noisy_max(masked, seeds, positions)
        score = z[rows, tokens] + noise_at(seeds, positions, tokens)
        passed_over = torch.zeros_like(tokens, dtype=torch.bool)
        if top_p < 1:  # pass over best tokens the worker's nucleus may not have held
            for _ in range(4):
                redo = (best - score > margin) & ~_surely_kept(z, choice, top_p, slack)
                if not bool(redo.any()):
                    break
                passed_over |= redo
                masked[rows[redo], choice[redo]] = -math.inf
                picked = rows[redo].tolist()
                choice[redo], best[redo] = noisy_max(
                    masked[redo], [seeds[i] for i in picked], [positions[i] for i in picked]
                )
        # the best is taken over the validator's nucleus plus the token: a token outside the nucleus that beats
        # the nucleus's best has gap 0, not a negative one (which would price it below the floor); a row whose
        # nucleus was passed over entirely has no best and its token is off the seed
        gap = torch.where(torch.isfinite(best), (best - score).clamp(min=0), math.inf)
        off = torch.nonzero(gap > margin).flatten()
        near_mask = ((choice != tokens) | passed_over) & (gap <= margin)  # a pass-over is never free
        near = int(near_mask.sum())
        floor = tolerance.near_tie_floor
        cost = float(near_tie_costs(gap[near_mask], tie_margin, floor).sum())
        logp = torch.log_softmax(masked, dim=-1)
        p = logp.exp()
        plogp = torch.where(kept, p * logp, torch.zeros_like(p))
        neg_entropy = plogp.sum(dim=-1)
        variance = torch.where(kept, p * logp * logp, torch.zeros_like(p)).sum(dim=-1) - neg_entropy**2
        chosen_lp = z[rows, tokens] - torch.logsumexp(masked, dim=-1)  # over the nucleus, finite off it too
        typicality = float((chosen_lp.sum() - neg_entropy.sum()) / max(float(variance.sum()), 1e-12) ** 0.5)
        budget = tolerance.near_ties_per_sample + tolerance.near_ties_per_token * n
        numbers = {
            "tokens": n,
            "off_seed_tokens": len(off),
            "near_ties": near,
            "near_tie_cost": cost,
            "near_tie_budget": budget,
            "margin": margin,
            "tie_margin": tie_margin,
            "max_gap": float(gap.max()),
            "typicality": typicality,
            "mean_logprob": float(chosen_lp.mean()),
            "mean_neg_entropy": float(neg_entropy.mean()),
        }
        reasons = []
        if len(off):
            shown = off[:_SHOWN].tolist()
            reasons.append(
                f"{len(off)} of {n} tokens are not what {named} samples (positions {shown}: "
                f"noisy score short of the best by {[round(float(gap[i]), 3) for i in shown]}, margin "
                f"{margin:.3g} at temperature {temperature})"
            )
        if cost > budget:
            reasons.append(
                f"{near} near-tie tokens differ from the seed's replayed choice: cost {cost:.2f} over the budget "
                f"{budget:.2f} (largest gap {float(gap[near_mask].max()) / margin:.2f} of the margin)"
            )
        verdicts.append(CheckVerdict("replay", not reasons, tuple(reasons), numbers))
    return verdicts


def check_near_tie_budget(
    replayed: Sequence[CheckVerdict], tolerance: SamplingTolerance = SamplingTolerance()
) -> CheckVerdict:
    """The batch's near ties (their cost summed over its samples' replay verdicts) within the per-batch budget."""
    near = sum(int(v.numbers.get("near_ties", 0)) for v in replayed)
    cost = sum(float(v.numbers.get("near_tie_cost", 0.0)) for v in replayed)
    tokens = sum(int(v.numbers.get("tokens", 0)) for v in replayed)
    budget = max(tolerance.near_ties_per_sample, tolerance.near_ties_per_batch_token * tokens)
    numbers = {"near_ties": near, "near_tie_cost": cost, "near_tie_budget": budget, "tokens": tokens}
    if cost > budget:
        return CheckVerdict(
            "replay",
            False,
            (
                f"{near} near-tie tokens in the batch differ from the seeds' replayed choices: cost {cost:.2f} over "
                f"the budget {budget:.2f} for {tokens} tokens",
            ),
            numbers,
        )
    return CheckVerdict("replay", True, numbers=numbers)


def _top_p_kept(z: torch.Tensor, top_p: float) -> torch.Tensor:
    """vLLM's top-p set of each row of z [n, vocab]: in descending probability, a token is kept while the mass
    ranked before it is below top_p (the first token always)."""
    import torch

    ordered, order = z.sort(dim=-1, descending=True)
    probs = torch.softmax(ordered, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs
    keep_sorted = before < top_p
    keep_sorted[:, 0] = True
    return torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)


def _surely_kept(z: torch.Tensor, tokens: torch.Tensor, top_p: float, slack: float) -> torch.Tensor:
    """Whether each row's token stays in the top-p nucleus whatever each logit's error up to `slack` (in z
    units): at most the mass of the tokens within 2 slack below it or above can rank above it."""
    import torch

    rows = torch.arange(len(tokens), device=z.device)
    zt = z[rows, tokens]
    probs = torch.softmax(z.double(), dim=-1)
    above = z > (zt - 2 * slack)[:, None]
    above[rows, tokens] = False
    high = (probs * above).sum(dim=-1) * math.exp(slack)
    rest = (1 - (probs * above).sum(dim=-1)) * math.exp(-slack)
    return (high / (high + rest)) < top_p
