"""The replay check's logit tolerance measured for one model: honest cross-engine errors between competing tokens.

The replay check (`gpu_workers.checks.check_replay_batch`) accepts a token whose noisy score z_t + g_t is within
2 d / T of the best noisy score, d being `[validator] replay_logit_tolerance`. The validator's gap between the
submitted token t and the best token b is off from the worker's by (e_b - e_t) / T, e being each raw logit's
difference between the two engines (validator - worker). What the margin must hold is |e_b - e_t| for tokens
that compete: those whose noisy scores come near the best, for they are the only ones a rounding error can put
on top. A token far below the best never needs the margin, and its error, larger where logits are large and
negative, says nothing about the replay.

`competing_spreads` measures that per position from the worker's listed logprobs (its top tokens and the
sampled one; at temperature 1 and top-p 1 logprob differences are raw logit differences) against the
validator's logits and the sample's seed; `replay_tolerance` turns the largest into a tolerance with a safety
factor. `benchmarks/replay_margin.py` runs both for a pool's model and prints the setting.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

COMPETING_WINDOW = 3.0
"""Tokens whose noisy score is within this many logits (at temperature 1) of the best compete at a position:
twice the bfloat16 default margin (1.5), so every token any configured margin could accept is among them."""


def competing_spreads(
    listed: Sequence[Mapping[int, float]],
    validator_logits,
    seed: int,
    window: float = COMPETING_WINDOW,
) -> tuple[np.ndarray, np.ndarray]:
    """Per position of one honest completion (temperature 1, top-p 1): the spread max(e) - min(e), e = worker
    logprob - validator logprob, over (a) the listed tokens whose noisy score under the validator's logits and
    the seed's noise is within `window` of the best listed one, and (b) all listed tokens. `listed[j]` maps
    token -> the worker's logprob at completion position j; `validator_logits` is [n, vocab]."""
    import torch

    from gpu_workers.replay import noise_at

    lp = torch.log_softmax(torch.as_tensor(validator_logits).float(), dim=-1)
    competing, every = np.zeros(len(listed)), np.zeros(len(listed))
    for j, entries in enumerate(listed):
        ids = np.fromiter(entries, dtype=np.int64, count=len(entries))
        worker = np.fromiter(entries.values(), dtype=np.float64, count=len(entries))
        ok = np.isfinite(worker)
        ids, worker = ids[ok], worker[ok]
        if len(ids) < 2:
            continue
        mine = lp[j, torch.as_tensor(ids)].double().numpy()
        err = worker - mine
        every[j] = float(err.max() - err.min())
        noisy = mine + noise_at([int(seed)] * len(ids), [j] * len(ids), torch.as_tensor(ids)).double().numpy()
        near = noisy >= noisy.max() - window
        competing[j] = float(err[near].max() - err[near].min()) if near.sum() > 1 else 0.0
    return competing, every


def replay_tolerance(largest_spread: float, safety: float = 2.0) -> float:
    """The `replay_logit_tolerance` d whose margin 2 d holds `safety` x the largest competing spread (rounded up
    to 0.01, at least 0.01)."""
    if not 0 <= largest_spread < math.inf or not 1 <= safety < math.inf:
        raise ValueError(f"spread must be finite and >= 0, safety finite and >= 1; got {largest_spread} and {safety}")
    return max(0.01, math.ceil(100 * safety * largest_spread / 2 - 1e-9) / 100)


def near_tie_gaps(tokens: Sequence[int], validator_logits, seed: int, temperature: float = 1.0) -> np.ndarray:
    """The raw-logit gaps of one honest completion's near ties (top-p 1): at every position where its token is not
    the validator's replayed choice, the best noisy score minus the token's, times the temperature. The replay
    check prices a near tie by this gap (`SamplingTolerance.tie_logit_tolerance`); an honest worker's gaps are
    the engines' rounding, which flips a choice only where two noisy scores almost touch."""
    import torch

    from gpu_workers.replay import noise_at, noisy_max

    ids = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
    z = torch.as_tensor(validator_logits).float() / temperature
    n = len(ids)
    if z.ndim != 2 or z.shape[0] != n:
        raise ValueError(f"{n} tokens for logits of shape {tuple(z.shape)}")
    seeds, positions = [int(seed)] * n, list(range(n))
    choice, best = noisy_max(z, seeds, positions)
    score = z[torch.arange(n), ids] + noise_at(seeds, positions, ids)
    off = choice != ids
    return ((best - score)[off] * temperature).double().numpy()


def tie_tolerance(largest_gap: float) -> float:
    """The `tie_logit_tolerance` t whose tie margin 2 t holds the largest honest near-tie gap measured (rounded up
    to 0.01, at least 0.01): honest near ties then cost under 1, a choice beyond every honest gap costs 1."""
    if not 0 <= largest_gap < math.inf:
        raise ValueError(f"gap must be finite and >= 0, got {largest_gap}")
    return max(0.01, math.ceil(100 * largest_gap / 2 - 1e-9) / 100)


def near_tie_rate(cost_per_token: float, safety: float = 2.0) -> float:
    """The `[orchestrator] near_tie_rate` that gives `safety` x an honest worker's measured near-tie cost per
    completion token (rounded up to 1e-4, at least 1e-4)."""
    if not 0 <= cost_per_token < math.inf or not 1 <= safety < math.inf:
        raise ValueError(f"cost must be finite and >= 0, safety finite and >= 1; got {cost_per_token} and {safety}")
    return max(1e-4, math.ceil(1e4 * safety * cost_per_token - 1e-9) / 1e4)


FREEDOM_WARNING = 0.03
"""Near-tie choices per sample beyond which `intellect calibrate` warns that the pool's replay leaves a cheater
room to buy reward: the reward per sample issue 49 holds a near-tie cheater to."""


def near_tie_freedom(near_tie_rate: float, honest_cost_per_token: float, mean_tokens: float) -> dict[str, float]:
    """What the worker's near-tie ledger at `near_tie_rate` leaves a cheater per sample of `mean_tokens` completion
    tokens, in the long run: its own engines' rounding already spends `honest_cost_per_token`, and what the rate
    allows beyond it is cost it may spend on near ties of its choosing. Returned: that cost per sample (`cost`) and
    the near-tie choices it buys, from one per unit (choices at the tie margin or beyond cost 1) to
    1 / `near_tie_floor` per unit (choices within the tie margin cost the floor) (`choices_low`, `choices_high`).
    On a task whose reward one token decides (a yes/no answer), a choice is worth up to the reward's whole range:
    SmolLM2-135M-Instruct in bfloat16 on syllogisms left 0.098 cost per sample, and the near-tie cheater bought
    0.097 choices and +0.09 reward per sample (benchmarks/RESULTS.md). float32 replay leaves no honest near tie
    (`needs_calibration`), so no ledger and no freedom."""
    from gpu_workers.verdicts import SamplingTolerance

    values = (near_tie_rate, honest_cost_per_token, mean_tokens)
    if not all(0 <= v < math.inf for v in values):
        raise ValueError(f"rate, honest cost per token and mean tokens must be finite and >= 0; got {values}")
    cost = max(0.0, near_tie_rate - honest_cost_per_token) * mean_tokens
    return {"cost": cost, "choices_low": cost, "choices_high": cost / SamplingTolerance.near_tie_floor}


def freedom_warning(freedom: Mapping[str, float], dtype: str) -> str | None:
    """What `intellect calibrate` says when the ledger leaves more than FREEDOM_WARNING near-tie choices per sample
    (`near_tie_freedom`'s upper figure); None otherwise."""
    high = freedom["choices_high"]
    if high <= FREEDOM_WARNING:
        return None
    return (
        f"this {dtype} pool's ledger leaves a worker {freedom['choices_low']:.3f}-{high:.3f} near-tie choices per "
        "sample beyond its engines' rounding, undetected; on a task whose reward one token decides (a yes/no "
        "answer) that is up to as much reward per sample, above the "
        f"{FREEDOM_WARNING:g} a pool should allow. Sample and validate in float32 ([worker] dtype and [validator] "
        'dtype), which leaves no near tie to choose (docs/verifiable-sampling.md, "Calibrating a pool")'
    )


def logprob_tolerance(largest_diff: float, safety: float = 2.0) -> float:
    """The `max_logprob_diff` (at temperature 1) that holds `safety` x the largest honest |stored - recomputed|
    logprob measured (rounded up to 0.01, at least 0.01)."""
    if not 0 <= largest_diff < math.inf or not 1 <= safety < math.inf:
        raise ValueError(f"difference must be finite and >= 0, safety finite and >= 1; got {largest_diff} and {safety}")
    return max(0.01, math.ceil(100 * safety * largest_diff - 1e-9) / 100)


def near_tie_budgets(
    sample_costs: Sequence[float],
    sample_tokens: Sequence[int],
    batch_of: Sequence[int],
    safety: float = 2.0,
    rate_safety: float = 2.0,
) -> dict[str, float]:
    """The validator's near-tie budgets that hold honest samples' and batches' measured near-tie costs.

    A sample may spend `near_ties_per_sample` (1) + `near_ties_per_token` x its tokens, a batch
    `near_ties_per_batch_token` x its tokens (`gpu_workers.replay_checks`). Returned: the largest honest cost
    beyond 1 per token of its sample (`excess`) and cost per token of a batch (`batch_rate`), and the budgets:
    `safety` x excess and `rate_safety` x batch_rate, rounded up, never below the defaults (`SamplingTolerance`).
    """
    from gpu_workers.verdicts import SamplingTolerance

    defaults = SamplingTolerance()
    if not len(sample_costs) == len(sample_tokens) == len(batch_of):
        raise ValueError("one cost, token count and batch index per sample")
    excess = max([0.0, *((c - defaults.near_ties_per_sample) / max(n, 1) for c, n in zip(sample_costs, sample_tokens))])
    index = np.asarray(batch_of, dtype=np.int64)
    cost_of = np.bincount(index, weights=np.asarray(sample_costs, dtype=float)) if len(index) else np.zeros(1)
    tokens_of = np.bincount(index, weights=np.asarray(sample_tokens, dtype=float)) if len(index) else np.ones(1)
    batch_rate = float((cost_of / np.maximum(tokens_of, 1)).max())
    return {
        "excess": excess,
        "batch_rate": batch_rate,
        "near_ties_per_token": max(defaults.near_ties_per_token, math.ceil(100 * safety * excess - 1e-9) / 100),
        "near_ties_per_batch_token": max(
            defaults.near_ties_per_batch_token, math.ceil(1000 * rate_safety * batch_rate - 1e-9) / 1000
        ),
    }


def logprob_mean_bounds(errors: Sequence[np.ndarray], dtype: str, safety: float = 2.0) -> dict[str, float]:
    """The sampling check's two mean logprob bounds that hold honest samples' measured logprob errors.

    `errors`: per honest sample, stored - recomputed logprob of each token, in T = 1 units (x the temperature).
    A sample's |sum| and sum of |error|, less its largest |error|, may reach a per-token room x its tokens plus
    `logprob_diff_allowance` (`gpu_workers.sampling_checks`). Honest rounding errors are about centred, so their
    sum grows like sqrt(tokens): what a sample of few tokens needs beyond the per-token room is a constant, and
    room per token is what a shift of every token buys (a worker raising every claim of a 32-token sample by 0.07
    nats moves its ratio x e^2.2). So the per-token rooms follow the honest mean: `mean_signed_logprob_diff` =
    `safety` x |the mean error over every token| (a bias of the engines), `mean_logprob_diff` = `safety` x the
    mean |error|; the allowance is `safety` x the largest need of one sample beyond them. Each rounded up to 0.01
    (`logprob_tolerance`), never below the defaults (`SamplingTolerance`, `MEAN_LOGPROB_DIFF` of the dtype).
    Returned with the measured `signed_bias`, `abs_mean` and `excess`."""
    from gpu_workers.sampling_checks import MEAN_LOGPROB_DIFF
    from gpu_workers.verdicts import SamplingTolerance

    defaults = SamplingTolerance()
    samples = [np.asarray(e, dtype=float).ravel() for e in errors if len(e)]
    every = np.concatenate(samples) if samples else np.zeros(0)
    if not np.all(np.isfinite(every)) or not 1 <= safety < math.inf:
        raise ValueError(f"logprob errors must be finite and safety finite and >= 1 (safety {safety})")

    bias = abs(float(every.sum())) / max(len(every), 1)
    abs_mean = float(np.abs(every).mean()) if len(every) else 0.0
    signed = max(defaults.mean_signed_logprob_diff, logprob_tolerance(bias, safety))
    mean = max(MEAN_LOGPROB_DIFF.get(dtype, MEAN_LOGPROB_DIFF["bfloat16"]), logprob_tolerance(abs_mean, safety))
    excess = 0.0
    for e in samples:
        largest = float(np.abs(e).max())
        need = max(abs(float(e.sum())) - signed * len(e), float(np.abs(e).sum()) - mean * len(e)) - largest
        excess = max(excess, need)
    return {
        "signed_bias": bias,
        "abs_mean": abs_mean,
        "excess": excess,
        "mean_signed_logprob_diff": signed,
        "mean_logprob_diff": mean,
        "logprob_diff_allowance": max(defaults.logprob_diff_allowance, logprob_tolerance(excess, safety)),
    }


class CalibrationError(ValueError):
    """A bfloat16/float16 replay pool without a calibration of its model; the message says what to run."""


def needs_calibration(worker) -> bool:
    """Whether a pool with this `[worker]` section needs a calibration: the replayable sampler in bfloat16 or
    float16, whose engines round enough to leave near ties a cheater may choose among (float32 engines agree to
    2e-4 logits: none was seen in 8,192 honest tokens, and the dtype's margin is 0.04 / T)."""
    return worker.sampler == "replayable" and worker.dtype != "float32"


def calibration_problem(validator, worker, model_dir, near_tie_rate: float | None = 0.0) -> str | None:
    """Why a validator of this pool may not start (None: it may): a bfloat16/float16 replay pool needs
    `[validator] calibrated_model` (what `intellect calibrate` writes) to name the model at `model_dir`,
    `calibrated_dtype` its workers' dtype and (where the caller knows the recipe's `[orchestrator]
    near_tie_rate`, not the default 0.0) the worker's near-tie ledger on, unless `[validator]
    allow_uncalibrated` says otherwise."""
    if not needs_calibration(worker) or validator.allow_uncalibrated:
        return None
    how = (
        "run `intellect calibrate CONFIG` on the pool's model (a few minutes for a small model on a CPU) and "
        'include what it writes in the recipe (include = ["CALIBRATION.toml"] at its top), or set '
        "[validator] allow_uncalibrated = true (the dtype's defaults: a near-tie cheater gained +20 points on "
        "the demo's policy with them, docs/verifiable-sampling.md)"
    )
    if validator.calibrated_model is None:
        return f"a {worker.dtype} replay pool's validator needs a calibration of its model: {how}"
    if near_tie_rate is None:
        return (
            "the recipe's [orchestrator] near_tie_rate is unset, so the orchestrator keeps no near-tie ledger of its "
            "workers and each batch's own budget is all a near-tie cheater meets: include the whole calibration "
            f"(its [orchestrator] part too); {how}"
        )
    if validator.calibrated_dtype != worker.dtype:
        return (
            f"the calibration measured a {validator.calibrated_dtype} worker, the pool's run in {worker.dtype}: {how}"
        )
    from bridge.weights import WeightsError, model_digest

    if model_dir is None:
        return "the calibration names a model, and no model directory (model.path) was given to check it against"
    try:
        digest = model_digest(model_dir)
    except (OSError, WeightsError) as err:
        return (
            f"the calibration names model {validator.calibrated_model[:16]}..., and model.path ({model_dir}) is not "
            f"a model directory whose digest could be taken ({err}): point model.path at the pool's base model"
        )
    if digest != validator.calibrated_model:
        return (
            f"the calibration was measured on model {validator.calibrated_model[:16]}..., model.path ({model_dir}) is "
            f"{digest[:16]}...: {how}"
        )
    return None
