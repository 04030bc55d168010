"""The sampling check: every sampled token lies in the top-p nucleus at the pool's temperature under the
validator's logits, and the stored logprobs are the ones those logits give (`check_sampling_batch`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from gpu_workers.verdicts import _SHOWN, CheckVerdict, SamplingTolerance

if TYPE_CHECKING:
    import torch


MAX_LOGPROB_DIFF = {"float32": 0.05, "float16": 1.0, "bfloat16": 0.75}
"""Default `SamplingTolerance.max_logprob_diff` per worker dtype (at T = 1, before the top-p boundary term).
A reported logprob is the denominator of the learner's importance ratio wherever the engine's logprobs are
used (`loss.logprob_source = "inference"`, TIS), so a worker that moves it within this bound moves that ratio
by as much. benchmarks/honest_calibration.py (tiny flat and peaked policies, T 0.6/1.0, in T = 1 units): float32
engines agreed to 0.005; a bfloat16 worker's token reached 0.36 at top-p 1.0 and 0.45 at top-p 0.9 (which
adds log(1 / 0.9) = 0.105), 0.16 at hidden 256 with Qwen2.5's vocabulary; bfloat16 keeps 2x room, and a shift
within it is a residual the validator cannot see (docs/verifiable-sampling.md). float16 is not calibrated and
keeps the former 1.0."""

MEAN_LOGPROB_DIFF = {"float32": 0.05, "float16": 0.05, "bfloat16": 0.15}
"""Default `SamplingTolerance.mean_logprob_diff` per worker dtype. An honest bfloat16 vLLM worker against a
bfloat16 transformers validator, 16 samples of 32 tokens at T 1 over a 151,936-token vocabulary, measured
per-sample means of 0.015-0.032 (hidden 128, 2 layers), 0.027-0.049 (hidden 256, 4 layers) and 0.040-0.064
(the Qwen2.5-0.5B shape): the error grows with depth and width, so bfloat16 gets room above the 0.5B figure;
float32 and float16 round 2^16 and 2^3 times finer."""


def check_sampling(
    tokens: Sequence[int],
    logprobs: Sequence[float],
    logits: torch.Tensor | np.ndarray,
    temperature: float,
    top_p: float,
    tolerance: SamplingTolerance = SamplingTolerance(),
    dtype: str = "bfloat16",
) -> CheckVerdict:
    """Nucleus membership and logprob agreement of a completion under the validator's `logits` [n, vocab].

    Nucleus: vLLM keeps a token when the probability of the tokens ranked above it is below top_p. With
    the tempered logits z = logits / temperature known to within d = logit_tolerance / temperature, the
    least that mass can be is A e^-d / (A e^-d + (1 - A) e^d), where A is the mass of the tokens whose z
    exceeds the token's by more than 2d (closer ones could rank below it); the token passes if that is
    below top_p. Logprobs must be vLLM's `processed_logprobs` (log-softmax of z over the nucleus); they are
    recomputed over the validator's nucleus plus the token itself (`_sampling_rows` says how, in float64).
    """
    return check_sampling_batch([(tokens, logprobs, logits)], temperature, top_p, tolerance, dtype)[0]


def check_sampling_batch(
    completions: Sequence[tuple[Sequence[int], Sequence[float], torch.Tensor | np.ndarray]],
    temperature: float,
    top_p: float,
    tolerance: SamplingTolerance = SamplingTolerance(),
    dtype: str = "bfloat16",
) -> list[CheckVerdict]:
    """`check_sampling` of several (tokens, logprobs, logits) completions, one verdict each: the rows of all
    well-formed ones go through the float64 work together, so its per-call costs are paid once. `dtype`: the
    worker's, which sets the mean logprob bound when `tolerance` leaves it unset."""
    if not temperature > 0 or not 0 < top_p <= 1:
        raise ValueError(f"temperature must be > 0 and top_p in (0, 1], got {temperature} and {top_p}")
    if tolerance.mean_logprob_diff is None:
        tolerance = replace(tolerance, mean_logprob_diff=MEAN_LOGPROB_DIFF.get(dtype, MEAN_LOGPROB_DIFF["bfloat16"]))
    if tolerance.max_logprob_diff is None:
        tolerance = replace(tolerance, max_logprob_diff=MAX_LOGPROB_DIFF.get(dtype, MAX_LOGPROB_DIFF["bfloat16"]))
    verdicts: list[CheckVerdict | None] = []
    rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for tokens, logprobs, logits in completions:
        tokens, stored, logits = (
            np.asarray(tokens, dtype=np.int64),
            np.asarray(logprobs, dtype=np.float64),
            _as_float32(logits),
        )
        problem = _malformed(tokens, stored, logits)
        verdicts.append(CheckVerdict("sampling", False, (problem,)) if problem else None)
        if not problem:
            rows.append((tokens, stored, logits))
    if rows:
        least_above, recomputed = _sampling_rows(
            np.concatenate([r[0] for r in rows]),
            np.concatenate([r[2] for r in rows]) if len(rows) > 1 else rows[0][2],
            temperature,
            top_p,
            tolerance.logit_tolerance / temperature,
        )
        ends = np.cumsum([len(r[0]) for r in rows])
        parts = iter(zip(rows, np.split(least_above, ends[:-1]), np.split(recomputed, ends[:-1])))
        for i, verdict in enumerate(verdicts):
            if verdict is None:
                (_, stored, _), above, again = next(parts)
                verdicts[i] = _sampling_verdict(stored, above, again, temperature, top_p, tolerance)
    return verdicts


def _as_float32(logits: torch.Tensor | np.ndarray) -> np.ndarray:
    """Logits as a float32 numpy array (a CPU torch tensor is viewed, not copied, when already float32)."""
    if isinstance(logits, np.ndarray):
        return logits.astype(np.float32, copy=False)
    return logits.detach().float().cpu().numpy()


def _malformed(tokens: np.ndarray, stored: np.ndarray, logits: np.ndarray) -> str | None:
    """Why a completion cannot be checked for sampling (a reason), or None."""
    if logits.ndim != 2 or logits.shape[0] == 0:
        return "empty completion"
    n, vocab = logits.shape
    if len(tokens) != n or len(stored) != n:
        return f"{len(tokens)} tokens and {len(stored)} logprobs for {n} positions"
    if np.any((tokens < 0) | (tokens >= vocab)):
        return (
            f"token ids {tokens[(tokens < 0) | (tokens >= vocab)][:_SHOWN].tolist()} lie outside the vocab "
            f"(0..{vocab - 1})"
        )
    if not np.all(np.isfinite(stored)) or np.any(stored > 1e-3):
        return "stored logprobs must be finite and <= 0"
    return None


def _sampling_verdict(
    stored: np.ndarray,
    least_above: np.ndarray,
    recomputed: np.ndarray,
    temperature: float,
    top_p: float,
    tolerance: SamplingTolerance,
) -> CheckVerdict:
    """The sampling verdict of one completion from its rows' least mass above and recomputed logprobs."""
    n = len(stored)
    diff = np.abs(stored - recomputed)
    outside = np.flatnonzero(least_above >= top_p)
    numbers = {
        "tokens": n,
        "tokens_outside_nucleus": len(outside),
        "max_least_mass_above": float(least_above.max()),
        "max_logprob_diff": float(diff.max()),
        "mean_logprob_diff": float(diff.mean()),
        "mean_signed_logprob_diff": float((stored - recomputed).mean()),
    }
    reasons = []
    if len(outside):
        reasons.append(
            f"{len(outside)} tokens outside the top-p {top_p} nucleus at temperature {temperature} "
            f"(positions {outside[:_SHOWN].tolist()}: at least "
            f"{[round(float(least_above[i]), 4) for i in outside[:_SHOWN]]} of the mass ranks above them)"
        )
    scale = 1.0 / temperature  # the bounds are stated at T = 1
    max_diff, mean_diff = tolerance.max_logprob_diff * scale, tolerance.mean_logprob_diff * scale
    max_diff -= math.log(top_p)  # a token where the two nuclei differ: kept masses within [top_p, 1]
    allowance = tolerance.logprob_diff_allowance * scale
    if diff.max() > max_diff:
        worst = int(diff.argmax())
        reasons.append(
            f"logprob of token {worst}: stored {stored[worst]:.4f}, recomputed {recomputed[worst]:.4f} "
            f"(max difference {max_diff:.3g} at temperature {temperature}, top-p {top_p})"
        )
    # The two mean bounds are about the sample's other tokens: its largest difference is set aside (bounded
    # alone by max_diff above). Honest rounding errors are about independent and centred, so their sum over n
    # tokens spreads like sqrt(n) and the linear bounds hold them with room; but one token where the engines'
    # nuclei differ (a boundary token) moves its logprob by up to log(1 / top_p) plus rounding, one way, and
    # in a sample of 1 or 2 tokens that token is the mean (an honest 2-token bfloat16 sample failed the signed
    # bound so). A forger gains one token per sample, within max_diff (docs/verifiable-sampling.md).
    largest = float(diff.max())
    if diff.sum() - largest > mean_diff * n + allowance:
        reasons.append(
            f"stored logprobs differ from the recomputed ones by {diff.mean():.4f} on average "
            f"(max {mean_diff:.3g} + ({allowance:.3g} + the largest, {largest:.3g}) / {n} tokens at temperature "
            f"{temperature})"
        )
    signed, signed_max = float((stored - recomputed).sum()), tolerance.mean_signed_logprob_diff * scale
    if abs(signed) - largest > signed_max * n + allowance:
        reasons.append(
            f"stored logprobs differ from the recomputed ones by {signed / n:+.4f} on average in one "
            f"direction (max {signed_max:.3g} + ({allowance:.3g} + the largest, {largest:.3g}) / {n} tokens at "
            f"temperature {temperature})"
        )
    return CheckVerdict("sampling", not reasons, tuple(reasons), numbers)


def _sampling_rows(
    tokens: np.ndarray,
    logits: np.ndarray,
    temperature: float,
    top_p: float,
    slack: float,
    block_elements: int = 1 << 18,
) -> tuple[np.ndarray, np.ndarray]:
    """Per row of `logits` [N, vocab] (float32) and its token: the least mass that can rank above the token
    (`check_sampling`'s nucleus test) and the token's logprob over the nucleus plus the token.

    All in float64 numpy, `block_elements` logits at a time (cache-sized blocks; numpy runs on one thread,
    so a busy machine costs no thread wake-ups). A and 1 - A are both summed: 1 - A taken from A keeps
    only A's rounding error when A is near 1, and weighing it by e^d against A e^-d multiplies that error
    by e^2d (e^50 at temperature 0.01 and the default tolerance: deep-tail tokens came out inside, with a
    negative mass above them). The nucleus is vLLM's: in descending probability, a token is kept when the
    mass ranked before it is below top_p, so the nucleus is the first prefix whose mass S reaches top_p
    (`_nucleus` finds it without a full sort). The logprob is z_token - logsumexp(z) - log S, with p_token
    added to S when the token lies below the nucleus's least probability; a token tied with that least
    probability counts as inside (where a sort may have put it).
    """
    least_above, recomputed = np.empty(len(tokens)), np.empty(len(tokens))
    step = max(1, block_elements // logits.shape[1])
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for start in range(0, len(tokens), step):
            rows = slice(start, start + step)
            z = logits[rows].astype(np.float64)
            z /= temperature
            chosen = z[np.arange(len(z)), tokens[rows]]
            top = z.max(axis=1)
            probs = np.exp(z - top[:, None])
            total = probs.sum(axis=1)
            probs /= total[:, None]
            above = z > (chosen + 2 * slack)[:, None]
            low = np.sum(probs, axis=1, where=above) * math.exp(-slack)  # A e^-d
            rest = np.sum(probs, axis=1, where=~above)  # 1 - A, summed: 1 - A would cancel when A is near 1
            least_above[rows] = low / (low + rest * math.exp(slack))
            logsumexp = top + np.log(total)
            if top_p < 1:
                kept_mass, least_kept = _nucleus(probs, top_p)
                token_prob = probs[np.arange(len(z)), tokens[rows]]
                kept_mass = np.where(token_prob >= least_kept, kept_mass, kept_mass + token_prob)
                logsumexp += np.log(kept_mass)
            recomputed[rows] = chosen - logsumexp
    return least_above, recomputed


def _nucleus(probs: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """Per row of `probs` [B, vocab] (float64, summing to 1): the mass S of the top-p nucleus and its least
    probability (0 when the whole row is kept, NaN for a row of NaNs).

    A sort would find the first prefix of the descending probabilities whose mass reaches top_p. Instead,
    each probability goes to a bucket by the top bits of its float64 pattern (monotone in the value: an
    octave split into 2**sub buckets; below 2**-64 one last bucket), a weighted count gives each bucket's
    mass, their running sum names the bucket where the prefix reaches top_p, and only that bucket's entries
    are sorted to find the exact boundary. Sums are ordered differently from a sort's running sum, so a
    prefix mass within float64 rounding (~1e-15) of top_p may end on the other side.
    """
    b, vocab = probs.shape
    sub = min(6, max(0, vocab.bit_length() - 10))  # 2**sub buckets per octave, more for larger vocabs
    count = (64 << sub) + 1
    top = 1023 << sub  # the bucket key of 1.0
    bucket = top - (probs.view(np.int64) >> (52 - sub))
    np.clip(bucket, 0, count - 1, out=bucket)  # NaN patterns land in 0, tiny and zero ones in the last
    bucket += (np.arange(b, dtype=np.int64) * count)[:, None]
    running = np.cumsum(
        np.bincount(bucket.ravel(), weights=probs.ravel(), minlength=b * count).reshape(b, count), axis=1
    )
    reached = (running < top_p).sum(axis=1)  # buckets before the one where the prefix reaches top_p
    whole = reached == count  # rounding left the total below top_p: every token is kept
    reached = np.minimum(reached, count - 1)
    ids = np.arange(b)
    before = np.where(reached > 0, running[ids, reached - 1], 0.0)
    rows, cols = np.nonzero(bucket == (ids * count + reached)[:, None])
    sizes = np.bincount(rows, minlength=b)
    width = int(sizes.max()) if len(rows) else 0
    ranked = np.full((b, max(width, 1)), np.inf)
    ranked[rows, np.arange(len(rows)) - (np.cumsum(sizes) - sizes)[rows]] = -probs[rows, cols]
    ranked.sort(axis=1)
    ranked = np.where(np.isfinite(ranked), -ranked, 0.0)  # the boundary bucket, descending, zero-padded
    inclusive = before[:, None] + np.cumsum(ranked, axis=1)
    kept = ((inclusive - ranked) < top_p) & (np.arange(ranked.shape[1]) < sizes[:, None])
    last = kept.sum(axis=1) - 1
    mass = np.where(last >= 0, inclusive[ids, last], np.nan)
    least = np.where(last >= 0, ranked[ids, last], np.nan)
    return np.where(whole, running[:, -1], mass), np.where(whole, 0.0, least)
