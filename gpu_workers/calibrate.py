"""The calibration of a bfloat16 (or float16) replay pool: what `intellect calibrate` measures on the pool's model.

The replay check's tolerances (`[validator] replay_logit_tolerance`, `tie_logit_tolerance`, `max_logprob_diff`)
and the worker's near-tie ledger (`[orchestrator] near_tie_rate`, `near_tie_slack`) must hold what honest
workers do on the pool's model, and every unit of room beyond it is freedom a near-tie cheater may spend
(docs/verifiable-sampling.md). `measure` runs the pool's engines on the model and returns what they did and the
settings that follow:

1. Spreads: a vLLM engine in the workers' dtype (`worker.dtype`) generates `samples` completions of the pool's
   task prompts at temperature 1 with its top `logprobs` logprobs per position (raw log-softmax: logprob
   differences are logit differences), each batch beside other requests; the validator's `Prefill`
   (`validator.dtype`) recomputes the logits of the same tokens. Per position, err = worker - validator logprob
   over the listed tokens whose noisy score, under the validator's logits and the seed's noise, comes within
   `calibration.COMPETING_WINDOW` of the best: the tokens that compete there (`competing_spreads`).
2. Near ties: a worker with the replayable sampler generates `tie_samples` completions with their seeds at the
   pool's temperature and top-p, in the pool's batches (`prompts_per_assignment` prompts x `samples_per_prompt`:
   a group's samples share a prompt, and one rounding error of a shared context can flip the choice in
   several), and the validator replays them: every token that is not its replayed choice is an honest near
   tie, its gap what the engines' rounding made of it (`near_tie_gaps`); the same completions give every
   token's |stored - recomputed| logprob.

The settings: `replay_logit_tolerance` = `safety` x the larger of the largest competing spread and the widest
honest near-tie gap, / 2; `tie_logit_tolerance` = the tie margin that holds the `tie_quantile` of the honest
gaps; `near_tie_rate` = `rate_safety` x the honest near-tie cost per completion token, `near_tie_slack` =
`rate_safety` x the costliest honest batch (at least 2); `max_logprob_diff` = `safety` x the largest honest
logprob difference (at T = 1, beyond the top-p term). The validator's per-sample and per-batch near-tie budgets
(`near_ties_per_token`, `near_ties_per_batch_token`) are their defaults unless honest work needs more: a sample may
spend 1 + `near_ties_per_token` x its tokens, so `near_ties_per_token` = `safety` x the largest honest cost beyond
1 per token of its sample; a batch `near_ties_per_batch_token` x its tokens, so that one is `rate_safety` x the
largest honest batch cost per token (a real model's bfloat16 engines tie far more often than the toy models the
defaults were set on: SmolLM2-135M-Instruct on 2.5% of its tokens). The sampling check's mean logprob bounds
(`mean_logprob_diff`, `mean_signed_logprob_diff`, `logprob_diff_allowance`) likewise stay at their defaults unless
honest work needs more (`calibration.logprob_mean_bounds`: the per-token rooms follow the honest mean error, the
per-sample allowance holds the samples of few tokens, whose errors do not average out: an honest 3-token SmolLM2
sample failed the default one-direction bound). Each is rounded up, never below what was measured.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gpu_workers.calibration import (
    competing_spreads,
    logprob_mean_bounds,
    logprob_tolerance,
    near_tie_budgets,
    near_tie_freedom,
    near_tie_gaps,
    near_tie_rate,
    replay_tolerance,
    tie_tolerance,
)

Progress = Callable[[str, int, int], None]
"""progress(phase, done, total): "spreads" or "near ties", samples measured so far of the phase's total."""


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What a calibration measured, and the settings it gives (`settings`)."""

    model: str
    worker_dtype: str
    validator_dtype: str
    temperature: float
    top_p: float
    samples: int
    positions: int
    spread_quantiles: dict[str, float]
    spread_max: float
    spread_max_all_listed: float
    tie_tokens: int
    honest_near_ties: int
    honest_gap_quantiles: dict[str, float]
    honest_gap_held: float
    """The `tie_quantile` quantile of the honest near-tie gaps: what the tie margin holds."""
    honest_near_tie_cost_per_token: float
    honest_batches: int
    honest_batch_cost_max: float
    honest_logprob_diff_max: float
    honest_sample_excess_per_token_max: float
    """The largest (near-tie cost - 1) / tokens of an honest sample: what its per-token budget must hold."""
    honest_batch_cost_per_token_max: float
    honest_logprob_bias: float
    """|The mean stored - recomputed logprob| over every token (T = 1): a one-way disagreement of the engines."""
    honest_logprob_abs_mean: float
    honest_logprob_sample_excess_max: float
    """The largest need of one honest sample beyond the per-token rooms of the mean logprob bounds (T = 1)."""
    safety: float
    tie_quantile: float
    rate_safety: float
    replay_logit_tolerance: float
    tie_logit_tolerance: float
    max_logprob_diff: float
    near_tie_rate: float
    near_tie_slack: float
    near_ties_per_token: float
    near_ties_per_batch_token: float
    mean_logprob_diff: float
    mean_signed_logprob_diff: float
    logprob_diff_allowance: float
    mean_completion_tokens: float
    honest_near_tie_sample_share: float
    """The share of honest samples with a near tie: what the learner leaves out of a pool's training
    (`[loss] near_tie_samples = "drop"`, the default)."""
    near_tie_freedom: dict[str, float]
    """What the written ledger leaves a cheater per sample beyond honest rounding
    (`gpu_workers.calibration.near_tie_freedom`: cost, choices_low, choices_high)."""
    seconds: float

    def settings(self) -> dict[str, dict[str, float]]:
        """The recipe keys this calibration sets, by section."""
        return {
            "validator": {
                "replay_logit_tolerance": self.replay_logit_tolerance,
                "tie_logit_tolerance": self.tie_logit_tolerance,
                "max_logprob_diff": self.max_logprob_diff,
                "near_ties_per_token": self.near_ties_per_token,
                "near_ties_per_batch_token": self.near_ties_per_batch_token,
                "mean_logprob_diff": self.mean_logprob_diff,
                "mean_signed_logprob_diff": self.mean_signed_logprob_diff,
                "logprob_diff_allowance": self.logprob_diff_allowance,
            },
            "orchestrator": {"near_tie_rate": self.near_tie_rate, "near_tie_slack": self.near_tie_slack},
        }

    def report(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def measure(
    model: str | Path,
    prompts: Sequence[Sequence[int]],
    *,
    worker_dtype: str,
    validator_dtype: str,
    temperature: float,
    top_p: float,
    group: int,
    per_batch: int,
    max_tokens: int,
    samples: int = 256,
    tie_samples: int = 1024,
    batch: int = 32,
    logprobs: int = 20,
    safety: float = 2.0,
    tie_quantile: float = 0.9,
    rate_safety: float = 2.0,
    progress: Progress | None = None,
) -> Calibration:
    """Calibrate on `model` (an HF directory) with the pool's prompts (token ids; `samples` of them are used,
    cycled): `group` samples per prompt, `per_batch` samples per batch (prompts_per_assignment x group)."""
    import time

    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from gpu_workers.checks import _top_p_kept, near_tie_costs, stop_token_ids
    from gpu_workers.config import WorkerConfig
    from gpu_workers.engine import Engine
    from gpu_workers.prefill import Prefill

    if not prompts or samples < 1 or tie_samples < 1 or batch < 1 or group < 1 or per_batch < group:
        raise ValueError(
            f"calibration: need prompts, samples ({samples}), tie_samples ({tie_samples}) and batch ({batch}) >= 1, "
            f"and a batch ({per_batch}) of at least one group ({group})"
        )
    report = progress or (lambda phase, done, total: None)
    started = time.monotonic()
    picks = [list(prompts[i % len(prompts)]) for i in range(max(samples, tie_samples))]
    longest = max(len(x) for x in picks) + max_tokens
    prefill = Prefill(model, dtype=validator_dtype)
    engine = Engine(
        model, 0, WorkerConfig(dtype=worker_dtype, sampler="vllm", verify_swaps=0), max_model_len=longest + 8
    )
    found: list[np.ndarray] = []
    found_all: list[np.ndarray] = []
    try:
        report("spreads", 0, samples)
        for start in range(0, samples, batch):
            part = picks[start : min(start + batch, samples)]
            others = [picks[(start + 7 * i) % len(picks)][: -1 - i % 3] for i in range(len(part) // 4 + 1)]
            params = [
                SamplingParams(n=1, seed=start + i, temperature=1.0, max_tokens=max_tokens, logprobs=logprobs)
                for i in range(len(part) + len(others))
            ]
            outs = engine.llm.generate(
                [TokensPrompt(prompt_token_ids=list(x)) for x in part + others], params, use_tqdm=False
            )[: len(part)]
            pairs = [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]
            for i, (o, result) in enumerate(zip(outs, prefill.run(pairs))):
                listed = [{t: e.logprob for t, e in entry.items()} for entry in o.outputs[0].logprobs]
                competing, every = competing_spreads(listed, result.logits, start + i)
                found.append(competing)
                found_all.append(every)
            report("spreads", start + len(part), samples)
    finally:
        engine.close()
    gaps: list[np.ndarray] = []
    tie_tokens, worst_logprob, batch_of, lengths, errors = 0, 0.0, [], [], []
    stops = sorted(stop_token_ids(model))
    engine = Engine(model, 0, WorkerConfig(dtype=worker_dtype, verify_swaps=0), max_model_len=longest + 8)
    try:
        report("near ties", 0, tie_samples)
        for start in range(0, tie_samples, per_batch):
            part = [picks[((start + i) // group) % len(picks)] for i in range(min(per_batch, tie_samples - start))]
            seeds = [(1 << 20) + start + i for i in range(len(part))]
            outs = engine.generate(
                part,
                seeds,
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_tokens,
                stop_token_ids=stops,
                proofs=False,
            )
            pairs = [(list(x), list(o.tokens)) for x, o in zip(part, outs)]
            for (_, tokens), result, seed, o in zip(pairs, prefill.run(pairs), seeds, outs):
                z = scored = result.logits.float()
                rows = (torch.arange(len(tokens)), torch.tensor(tokens, dtype=torch.long))
                if top_p < 1:  # the validator's nucleus (the replay's pass-overs are left aside here)
                    kept = _top_p_kept(z / temperature, top_p)
                    z = scored.masked_fill(~kept, -float("inf"))
                    kept[rows] = True  # the sampling check recomputes over the nucleus plus the token
                    scored = scored.masked_fill(~kept, -float("inf"))
                gaps.append(near_tie_gaps(tokens, z, seed, temperature))
                batch_of.append(start // per_batch)
                lengths.append(max(len(tokens), 1))
                tie_tokens += len(tokens)
                recomputed = torch.log_softmax(scored / temperature, dim=-1)[rows]
                error = np.asarray(o.logprobs, dtype=float) - recomputed.numpy()
                errors.append(error * temperature)  # at T = 1, as the sampling check states its bounds
                # and its one-token bound beyond the top-p boundary term
                diff = (np.abs(error) - math.log(1 / top_p)).clip(min=0) * temperature
                worst_logprob = max(worst_logprob, float(diff.max()))
            report("near ties", start + len(part), tie_samples)
    finally:
        engine.close()
    every = np.concatenate(found)
    largest = float(every.max())
    honest_gaps = np.concatenate(gaps) if gaps else np.zeros(0)
    widest = float(honest_gaps.max()) if len(honest_gaps) else 0.0
    # the margin holds the larger of the two with the safety factor: a flip's gap is a spread's share, but the
    # replayable engine's flips were seen beyond the listed tokens' spreads (another run, other batch neighbours)
    tolerance = replay_tolerance(max(largest, widest), safety)
    held = float(np.quantile(honest_gaps, tie_quantile)) if len(honest_gaps) else 0.0
    tie = min(tie_tolerance(held), tolerance)
    costs = [float(near_tie_costs(g, 2 * tie).sum()) for g in gaps]
    cost = sum(costs)
    by_batch = np.bincount(np.asarray(batch_of, dtype=np.int64), weights=costs) if costs else np.zeros(1)
    budgets = near_tie_budgets(costs, lengths, batch_of, safety, rate_safety)
    means = logprob_mean_bounds(errors, worker_dtype, safety)
    rate = near_tie_rate(cost / max(tie_tokens, 1), rate_safety)
    mean_tokens = tie_tokens / max(len(lengths), 1)
    freedom = near_tie_freedom(rate, cost / max(tie_tokens, 1), mean_tokens)

    def quantiles(values: np.ndarray, qs: Sequence[str]) -> dict[str, float]:
        return {q: round(float(np.quantile(values, float(q))), 4) if len(values) else 0.0 for q in qs}

    return Calibration(
        model=str(model),
        worker_dtype=worker_dtype,
        validator_dtype=validator_dtype,
        temperature=temperature,
        top_p=top_p,
        samples=samples,
        positions=int(len(every)),
        spread_quantiles=quantiles(every, ("0.5", "0.99", "0.999")),
        spread_max=round(largest, 4),
        spread_max_all_listed=round(float(np.concatenate(found_all).max()), 4),
        tie_tokens=tie_tokens,
        honest_near_ties=int(len(honest_gaps)),
        honest_gap_quantiles=quantiles(honest_gaps, ("0.5", "0.9", "1.0")),
        honest_gap_held=round(held, 4),
        honest_near_tie_cost_per_token=round(cost / max(tie_tokens, 1), 6),
        honest_batches=int(len(by_batch)),
        honest_batch_cost_max=round(float(by_batch.max()), 3),
        honest_logprob_diff_max=round(worst_logprob, 4),
        honest_sample_excess_per_token_max=round(budgets["excess"], 4),
        honest_batch_cost_per_token_max=round(budgets["batch_rate"], 5),
        honest_logprob_bias=round(means["signed_bias"], 4),
        honest_logprob_abs_mean=round(means["abs_mean"], 4),
        honest_logprob_sample_excess_max=round(means["excess"], 4),
        safety=safety,
        tie_quantile=tie_quantile,
        rate_safety=rate_safety,
        replay_logit_tolerance=tolerance,
        tie_logit_tolerance=tie,
        max_logprob_diff=logprob_tolerance(worst_logprob, safety),
        near_tie_rate=rate,
        # the ledger's slack holds the costliest honest batch seen, with the same room as the rate
        near_tie_slack=max(2.0, math.ceil(10 * rate_safety * float(by_batch.max())) / 10),
        near_ties_per_token=budgets["near_ties_per_token"],
        near_ties_per_batch_token=budgets["near_ties_per_batch_token"],
        mean_logprob_diff=means["mean_logprob_diff"],
        mean_signed_logprob_diff=means["mean_signed_logprob_diff"],
        logprob_diff_allowance=means["logprob_diff_allowance"],
        mean_completion_tokens=round(mean_tokens, 2),
        honest_near_tie_sample_share=round(sum(len(g) > 0 for g in gaps) / max(len(gaps), 1), 4),
        near_tie_freedom={k: round(v, 4) for k, v in freedom.items()},
        seconds=round(time.monotonic() - started, 1),
    )
