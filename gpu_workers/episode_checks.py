"""The validator's checks on a batch of multi-turn episodes (a pool with `data.env`; docs/design.md section 6,
schema 2): `validate_episode_batch`, beside `gpu_workers.checks.validate_batch` for single-turn batches.

Per sample, in order:

- `episode`: the environment re-run on the sample's sampled turns (`gpu_workers.envs.episode.judge`, tools in
  the code sandbox): the first prompt, every environment token byte for byte, every model turn's termination
  and cap, the episode ending exactly where the protocol ends it, and `finish`. A token the worker labelled as
  the environment's but the model sampled, or the reverse, changes the turns the environment sees or the tokens
  it must have written, so it fails here or in the replay.
- `computation`: TOPLOC over the hidden states behind the sampled tokens only (one prefill of the whole
  sequence; row j is the state at position p_j - 1 of sampled token j, across turns, in chunks of 32 as for a
  single-turn completion).
- `sampling`: nucleus membership and logprob agreement of the sampled tokens.
- `replay`: every sampled token is the replayable sampler's choice for its turn's seed
  (`gpu_workers.envs.episode.turn_seed`) at its position within the turn; near ties priced as for single-turn
  samples, the per-sample and per-batch budgets counted over sampled tokens.
- `reward`: the claimed reward equals the environment's (recomputed by the re-run); the learner trains on the
  recomputed one.

Batch level: `fixed_data` (task ids, groups, seeds: as for single-turn batches; the first prompt is the
episode check's, since an environment's prompt may depend on the sample's seed) and the batch's near-tie budget.
No prefill runs for a sample whose episode check failed (its other verdicts say "not run"), nor for a batch that
fixed data or every sample's episode check already rejected.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from gpu_workers.checks import (
    AssignedWork,
    BatchVerdict,
    CheckVerdict,
    Declared,
    Sample,
    SampleVerdict,
    _full_logprobs,
    check_computation_batch,
    check_fixed_data,
    check_near_tie_budget,
    check_replay_batch,
    check_sampling_batch,
)
from gpu_workers.envs.episode import Judgement, model_turns, turn_seed

if TYPE_CHECKING:
    from gpu_workers.prefill import Prefill


def sampled_positions(sample: Sample) -> np.ndarray:
    """Positions (in prompt + completion) of the sample's sampled tokens."""
    mask = np.ones(len(sample.completion_tokens), np.uint8) if sample.sampled is None else sample.sampled
    return len(sample.prompt_tokens) + np.flatnonzero(mask)


def turn_seeds(sample: Sample) -> tuple[list[int], list[int]]:
    """(seed, position within its turn) of each sampled token of the sample, in order."""
    mask = np.ones(len(sample.completion_tokens), np.uint8) if sample.sampled is None else sample.sampled
    seeds, positions = [], []
    for k, (a, b) in enumerate(model_turns(np.concatenate([np.zeros(1, np.uint8), mask]), 1)):
        seeds += [turn_seed(sample.seed, k)] * (b - a)
        positions += list(range(b - a))
    return seeds, positions


def validate_episode_batch(
    samples: Sequence[Sample],
    prefill: Prefill,
    declared: Declared,
    assignment: AssignedWork | None,
    judge: Callable[[Sample], Judgement],
    prefill_samples: int = 32,
) -> BatchVerdict:
    """Every check of the module docstring on a batch of episodes; `judge(sample)` re-runs its environment
    (`gpu_workers.envs.episode.judge` with the pool's protocol and the sample's task)."""
    batch_checks = (check_fixed_data(samples, assignment),) if assignment is not None else ()
    verdicts: list[list[CheckVerdict]] = []
    judged: list[Judgement | None] = []
    for s in samples:
        try:
            j = judge(s)
        except Exception as err:  # the content of a batch never crashes the validator
            j = Judgement((f"the environment's re-run raised {type(err).__name__}: {err}",), None, 0, 0)
        judged.append(j)
        numbers = {"turns": j.turns, "env_tokens": j.env_tokens}
        verdicts.append([CheckVerdict("episode", j.passed, j.reasons, numbers)])
    failed = next((v.check for v in batch_checks if not v.passed), None)
    if failed is None and verdicts and not any(v[0].passed for v in verdicts):
        failed = "episode"
    runnable = []
    for i, s in enumerate(samples):
        problem = _unscorable(s, prefill.vocab_size)
        if failed or not verdicts[i][0].passed or problem:
            why = (
                (problem,) if problem else (f"not run: {'batch' if failed else 'sample'} failed {failed or 'episode'}",)
            )
            ran = problem is not None
            verdicts[i] += [CheckVerdict(name, False, why, ran=ran) for name in ("computation", "sampling", "replay")]
        else:
            runnable.append(i)
    full: list[np.ndarray | None] = [None] * len(samples)  # the validator's logprobs, 0 at environment tokens
    for start in range(0, len(runnable), prefill_samples):
        part = runnable[start : start + prefill_samples]
        positions = [sampled_positions(samples[i]) for i in part]
        results = prefill.run_positions(
            [
                (np.concatenate([samples[i].prompt_tokens, samples[i].completion_tokens]).tolist(), pos)
                for i, pos in zip(part, positions)
            ]
        )
        picked = [pos - len(samples[i].prompt_tokens) for i, pos in zip(part, positions)]
        tokens = [samples[i].completion_tokens[p] for i, p in zip(part, picked)]
        logprobs = [samples[i].logprobs[p] for i, p in zip(part, picked)]
        computation = check_computation_batch(
            [(samples[i].proofs, r.hidden) for i, r in zip(part, results)],
            declared.thresholds,
            declared.chunk,
            declared.topk,
        )
        sampling = check_sampling_batch(
            [(t, lp, r.logits) for t, lp, r in zip(tokens, logprobs, results)],
            declared.temperature,
            declared.top_p,
            declared.tolerance,
            declared.dtype,
        )
        replayed = check_replay_batch(
            [(t, r.logits, turn_seeds(samples[i])) for i, t, r in zip(part, tokens, results)],
            declared.temperature,
            declared.top_p,
            declared.tolerance,
            declared.dtype,
            device=getattr(prefill, "device", "cpu"),
        )
        for i, *checked in zip(part, computation, sampling, replayed):
            verdicts[i] += checked
        for i, p, t, r in zip(part, picked, tokens, results):
            values = _full_logprobs(r.logits, t, declared.temperature)
            if values is not None:
                full[i] = np.zeros(len(samples[i].completion_tokens), np.float32)
                full[i][p] = values
    batch_checks += (
        check_near_tie_budget([v for vs in verdicts for v in vs if v.check == "replay" and v.ran], declared.tolerance),
    )
    for i, (s, j) in enumerate(zip(samples, judged)):
        if j.reward is None:
            verdicts[i].append(CheckVerdict("reward", False, ("not run: the episode check failed",), ran=False))
            continue
        numbers = {"recomputed": float(j.reward), "claimed": float(s.reward)}
        ok = np.isfinite(s.reward) and abs(float(s.reward) - float(j.reward)) <= 1e-4
        reasons = () if ok else (f"claimed reward {s.reward} but the environment gives {j.reward}",)
        verdicts[i].append(CheckVerdict("reward", bool(ok), reasons, numbers))
    return BatchVerdict(tuple(SampleVerdict(i, tuple(v)) for i, v in enumerate(verdicts)), batch_checks, tuple(full))


def _unscorable(sample: Sample, vocab_size: int) -> str | None:
    """Why the sample cannot be prefilled (no sampled token, a token id outside the vocab, a mask of another
    length), or None."""
    if sample.sampled is not None and len(sample.sampled) != len(sample.completion_tokens):
        return f"cannot recompute: a mask of {len(sample.sampled)} for {len(sample.completion_tokens)} tokens"
    tokens = np.concatenate([sample.prompt_tokens, sample.completion_tokens])
    if len(sample.prompt_tokens) == 0 or len(sampled_positions(sample)) == 0:
        return "cannot recompute: no prompt or no sampled token"
    if np.any((tokens < 0) | (tokens >= vocab_size)):
        return f"cannot recompute: token ids outside the vocab (0..{vocab_size - 1})"
    return None
