"""The validator's checks on a rollout batch: one function per check, each returning a `CheckVerdict` with reasons.

- `check_computation`: the TOPLOC proofs against the validator's prefill hidden states (every chunk).
- `check_sampling`: every completion token lies in the top-p nucleus at the declared temperature under the
  validator's logits, and the stored logprobs are the ones those logits give.
- `check_termination`: the finish code agrees with the tokens (stop token last and nowhere before; or
  exactly max_tokens and no stop token).
- `check_fixed_data`: task ids, prompt grouping and seeds are those of the deterministic assignment
  (`bridge.assignment`), and each prompt is the task's prompt.
- `check_reward`: the reward recomputed by the reward function equals the claimed one.

`validate_batch` runs them all on a batch (samples from `samples_from_arrays`, the docs/design.md section 6 arrays)
with a `gpu_workers.prefill.Prefill` and aggregates the sample verdicts into a `BatchVerdict`; it runs the
computation and sampling checks on each prefill group at once (`check_computation_batch`,
`check_sampling_batch`: the same verdicts, per-call costs paid once). A sample or batch that is malformed
in any way is rejected with a reason, never an exception. No prefill runs for a batch that a cheaper check
has already rejected (fixed data failed, or every sample failed termination): its computation and sampling
verdicts say "not run" and are not counted as failed checks.

Sampling tolerances (`SamplingTolerance`) exist because the validator's logits differ from the worker's by
rounding (bf16 across engines), and the probability mass ranked above a token moves with every logit: on
the tiny test models an honest token was seen just outside the nucleus by 0.4% of mass, and logprobs
differ by ~0.01 on average, up to ~0.25 for one token whose nucleus differed.

The sampling check lives in `gpu_workers.sampling_checks`, the replay check in `gpu_workers.replay_checks`, the
verdict types and tolerances in `gpu_workers.verdicts`; all are importable from here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bridge.assignment import assigned_sample_seeds, assigned_task_ids
from bridge.rollouts import FINISH_LENGTH, FINISH_STOP
from gpu_workers.replay_checks import (
    REPLAY_LOGIT_TOLERANCE,
    _top_p_kept,
    check_near_tie_budget,
    check_replay_batch,
    near_tie_costs,
)
from gpu_workers.sampling_checks import MAX_LOGPROB_DIFF, MEAN_LOGPROB_DIFF, check_sampling, check_sampling_batch
from gpu_workers.tasks.prompt import length_target
from gpu_workers.toploc import ChunkCheck, Thresholds, split_proofs, verify_proofs_batch
from gpu_workers.verdicts import _SHOWN, BatchVerdict, CheckVerdict, SampleVerdict, SamplingTolerance

if TYPE_CHECKING:
    import torch

    from gpu_workers.prefill import Prefill

__all__ = [
    "MAX_LOGPROB_DIFF",
    "MEAN_LOGPROB_DIFF",
    "REPLAY_LOGIT_TOLERANCE",
    "AssignedWork",
    "BatchVerdict",
    "CheckVerdict",
    "Declared",
    "Sample",
    "SampleVerdict",
    "SamplingTolerance",
    "_top_p_kept",
    "check_computation",
    "check_computation_batch",
    "check_fixed_data",
    "check_near_tie_budget",
    "check_replay_batch",
    "check_reward",
    "check_sampling",
    "check_sampling_batch",
    "check_termination",
    "near_tie_costs",
    "samples_from_arrays",
    "stop_token_ids",
    "validate_batch",
]


@dataclass(frozen=True)
class Sample:
    """One sample of a rollout batch (docs/design.md section 6), as the checks read it."""

    prompt_tokens: np.ndarray
    """int [P]"""
    completion_tokens: np.ndarray
    """int [n]"""
    logprobs: np.ndarray
    """float32 [n]: the worker's logprob of each completion token."""
    finish: int
    """0 = stop token, 1 = length limit."""
    proofs: bytes
    """The TOPLOC proofs of the completion's decode steps, concatenated."""
    seed: int = 0
    task_id: int = 0
    group_id: int = 0
    reward: float = 0.0
    target_len: int = 0
    sampled: np.ndarray | None = None
    """uint8 [n]: 1 where the model sampled completion token j, 0 where a multi-turn episode's environment wrote
    it (a schema-2 batch, docs/design.md section 6; None: every completion token was sampled)."""

    @classmethod
    def of(cls, completion: Any, **fields: Any) -> Sample:
        """The sample of an engine's `Completion` (`gpu_workers.capture`): its prompt, tokens, logprobs, finish and
        proofs (concatenated); `fields` gives the rest (seed, task_id, group_id, reward, target_len)."""
        return cls(
            prompt_tokens=completion.prompt_tokens,
            completion_tokens=completion.tokens,
            logprobs=completion.logprobs,
            finish=completion.finish,
            proofs=b"".join(completion.proofs),
            **fields,
        )

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_tokens", np.asarray(self.prompt_tokens, dtype=np.int64))
        object.__setattr__(self, "completion_tokens", np.asarray(self.completion_tokens, dtype=np.int64))
        object.__setattr__(self, "logprobs", np.asarray(self.logprobs, dtype=np.float32))


@dataclass(frozen=True)
class Declared:
    """What the worker declared (batch metadata) and what the validator holds it to."""

    temperature: float
    top_p: float
    max_tokens: int
    stop_token_ids: frozenset[int]
    max_model_len: int | None = None
    """A completion cut by the model's context (prompt + completion == this) counts as finish = length."""
    thresholds: Thresholds = Thresholds()
    tolerance: SamplingTolerance = SamplingTolerance()
    chunk: int = 32
    topk: int = 128
    sampler: str = "replayable"
    """"replayable": every token must be the seed's Gumbel-max choice (`check_replay_batch`); "vllm": vLLM's
    own random sampler (a trusted pool: tokens are only checked to lie in the nucleus)."""
    dtype: str = "bfloat16"
    """The dtype the worker generated in (it sets the replay check's default logit tolerance)."""


@dataclass(frozen=True)
class AssignedWork:
    """The assignment a batch answers: it fixes the task ids and seeds (`bridge.assignment`)."""

    node_key: str
    version: int
    k: int
    num_tasks: int
    samples_per_prompt: int
    prompt_tokens_of: Callable[[int, int], Sequence[int]] | None = None
    """The tokenized prompt of (task id, length target) (None: prompts are not compared)."""
    length_targets: tuple[int, ...] = ()
    """The pool's thinking-length targets; a group's target is drawn from its first sample's seed
    (`gpu_workers.tasks.length_target`). Empty: every target_len must be 0."""
    num_samples: int | None = None
    """The assignment's sample count (prompts x samples_per_prompt; None: any multiple of samples_per_prompt)."""
    salt: str | None = None
    """The orchestrator's salt of the assignment's draws (None: the unsalted protocol-1 draws)."""
    level: int = 0
    """The assignment's curriculum level: its prompts come from that slice of the task list (bridge.curriculum)."""
    levels: int = 1
    """Curriculum levels of the pool (equal slices of the task list; 1: no curriculum)."""


def stop_token_ids(model_dir: str | Path) -> frozenset[int]:
    """The ids vLLM stops on by default: `eos_token_id` of config.json and generation_config.json."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids.update([eos] if isinstance(eos, int) else (eos or []))
    return frozenset(ids)


def samples_from_arrays(arrays: Mapping[str, np.ndarray]) -> list[Sample]:
    """Split a batch's flat arrays (docs/design.md section 6 names) into samples; ValueError names a bad field."""
    required = (
        "tokens",
        "offsets",
        "prompt_lens",
        "logprobs",
        "task_ids",
        "group_ids",
        "seeds",
        "finish",
        "rewards",
        "proofs",
        "proof_offsets",
    )
    missing = [name for name in required if name not in arrays]
    if missing:
        raise ValueError(f"batch arrays: missing {', '.join(missing)}")
    a = {name: np.asarray(arrays[name]) for name in (*required, "target_lens") if name in arrays}
    offsets, proof_offsets = a["offsets"].astype(np.int64), a["proof_offsets"].astype(np.int64)
    n = len(offsets) - 1
    if n < 0 or offsets[0] != 0 or offsets[-1] != len(a["tokens"]) or np.any(np.diff(offsets) < 0):
        raise ValueError(f"offsets: must rise from 0 to len(tokens) = {len(a['tokens'])}, got {offsets[:5]}...")
    if (
        len(proof_offsets) != n + 1
        or proof_offsets[0] != 0
        or proof_offsets[-1] != len(a["proofs"])
        or np.any(np.diff(proof_offsets) < 0)
    ):
        raise ValueError(f"proof_offsets: must hold {n + 1} offsets rising from 0 to len(proofs) = {len(a['proofs'])}")
    if len(a["logprobs"]) != len(a["tokens"]):
        raise ValueError(f"logprobs: {len(a['logprobs'])} entries for {len(a['tokens'])} tokens")
    target_lens = a.get("target_lens", np.zeros(n, dtype=np.int32))
    sampled = np.asarray(arrays["sampled"]) if "sampled" in arrays else None
    if sampled is not None and len(sampled) != len(a["tokens"]):
        raise ValueError(f"sampled: {len(sampled)} entries for {len(a['tokens'])} tokens")
    for name, values in (
        ("prompt_lens", a["prompt_lens"]),
        ("task_ids", a["task_ids"]),
        ("group_ids", a["group_ids"]),
        ("seeds", a["seeds"]),
        ("finish", a["finish"]),
        ("rewards", a["rewards"]),
        ("target_lens", target_lens),
    ):
        if values.shape != (n,):
            raise ValueError(f"{name}: expected shape ({n},) for {n} samples, got {values.shape}")
    lengths = np.diff(offsets)
    if np.any(a["prompt_lens"] < 1) or np.any(a["prompt_lens"] > lengths):
        bad = int(np.flatnonzero((a["prompt_lens"] < 1) | (a["prompt_lens"] > lengths))[0])
        raise ValueError(
            f"prompt_lens: sample {bad} has prompt length {a['prompt_lens'][bad]} of {lengths[bad]} tokens"
        )
    proofs = a["proofs"].astype(np.uint8).tobytes()
    samples = []
    for i in range(n):
        start, cut, end = int(offsets[i]), int(offsets[i] + a["prompt_lens"][i]), int(offsets[i + 1])
        samples.append(
            Sample(
                prompt_tokens=a["tokens"][start:cut],
                completion_tokens=a["tokens"][cut:end],
                logprobs=a["logprobs"][cut:end].astype(np.float32),
                finish=int(a["finish"][i]),
                proofs=proofs[proof_offsets[i] : proof_offsets[i + 1]],
                seed=int(a["seeds"][i]),
                task_id=int(a["task_ids"][i]),
                group_id=int(a["group_ids"][i]),
                reward=float(a["rewards"][i]),
                target_len=int(target_lens[i]),
                sampled=None if sampled is None else sampled[cut:end].astype(np.uint8),
            )
        )
    return samples


def check_computation(
    proofs: bytes, hidden: torch.Tensor, thresholds: Thresholds = Thresholds(), chunk: int = 32, topk: int = 128
) -> CheckVerdict:
    """TOPLOC: the sample's concatenated `proofs` against the validator's `hidden` [n, H] (any float dtype;
    compared in bf16), every chunk within `thresholds`."""
    return check_computation_batch([(proofs, hidden)], thresholds, chunk, topk)[0]


def check_computation_batch(
    samples: Sequence[tuple[bytes, torch.Tensor]],
    thresholds: Thresholds = Thresholds(),
    chunk: int = 32,
    topk: int = 128,
) -> list[CheckVerdict]:
    """`check_computation` of several (proofs, hidden) samples, one verdict each; the proofs of all of them
    are evaluated as one batch (`verify_proofs_batch`)."""
    import torch

    verdicts: list[CheckVerdict | None] = []
    hiddens, chunked = [], []
    for proofs, hidden in samples:
        hidden = hidden.to(torch.bfloat16)
        try:
            rows, width = hidden.shape
            chunked.append(split_proofs(proofs, rows, width, chunk, topk))
        except ValueError as err:
            verdicts.append(CheckVerdict("computation", False, (str(err),)))
            continue
        hiddens.append(hidden)
        verdicts.append(None)
    checked = iter(verify_proofs_batch(hiddens, chunked, chunk, topk))
    return [verdict or _computation_verdict(next(checked), thresholds) for verdict in verdicts]


def _computation_verdict(checks: list[ChunkCheck], thresholds: Thresholds) -> CheckVerdict:
    """The computation verdict of one sample from its chunks' checks."""
    numbers = {
        "chunks": len(checks),
        "max_exp_mismatches": max(c.exp_mismatches for c in checks),
        "max_mant_err_mean": max(c.mant_err_mean for c in checks),
        "max_mant_err_median": max(c.mant_err_median for c in checks),
        "mean_exp_mismatches": float(np.mean([c.exp_mismatches for c in checks])),
        "mean_mant_err_mean": float(np.mean([c.mant_err_mean for c in checks])),
    }
    if thresholds.accepts(checks):
        return CheckVerdict("computation", True, numbers=numbers)
    bad = [(i, c) for i, c in enumerate(checks) if not thresholds.accepts([c])]
    reasons = tuple(
        f"TOPLOC chunk {i}: {c.exp_mismatches} exponent mismatches (max {thresholds.max_exp_mismatches}),"
        f" mantissa error mean {c.mant_err_mean:.3g} (max {thresholds.max_mant_err_mean}), median "
        f"{c.mant_err_median:.3g} (max {thresholds.max_mant_err_median})"
        for i, c in bad[:_SHOWN]
    )
    if len(bad) > _SHOWN:
        reasons += (f"TOPLOC: {len(bad)} of {len(checks)} chunks fail",)
    return CheckVerdict("computation", False, reasons, numbers)


def check_termination(
    tokens: Sequence[int],
    finish: int,
    stop_token_ids: frozenset[int],
    max_tokens: int,
    prompt_len: int = 0,
    max_model_len: int | None = None,
) -> CheckVerdict:
    """finish = stop: the last token is a stop token and none comes earlier; finish = length: exactly
    max_tokens tokens (or prompt + completion filling max_model_len) and no stop token at all."""
    tokens = np.asarray(tokens, dtype=np.int64)
    n = len(tokens)
    stops = np.flatnonzero(np.isin(tokens, np.fromiter(stop_token_ids, dtype=np.int64, count=len(stop_token_ids))))
    reasons = []
    if n == 0:
        reasons.append("empty completion")
    elif n > max_tokens:
        reasons.append(f"{n} tokens exceed max_tokens {max_tokens}")
    elif finish == FINISH_STOP:
        if tokens[-1] not in stop_token_ids:
            reasons.append(f"finish = stop but the last token ({tokens[-1]}) is not a stop token")
        if len(stops) and stops[0] < n - 1:
            reasons.append(f"stop token {tokens[stops[0]]} at position {stops[0]} before the end ({n} tokens)")
    elif finish == FINISH_LENGTH:
        full = n == max_tokens or (max_model_len is not None and prompt_len + n == max_model_len)
        if not full:
            reasons.append(f"finish = length after {n} tokens, not max_tokens {max_tokens}")
        if len(stops):
            reasons.append(f"finish = length but stop token {tokens[stops[0]]} at position {stops[0]}")
    else:
        reasons.append(f"finish code {finish} is neither 0 (stop) nor 1 (length)")
    return CheckVerdict("termination", not reasons, tuple(reasons), {"tokens": n})


def check_fixed_data(samples: Sequence[Sample], assignment: AssignedWork) -> CheckVerdict:
    """The batch holds the assignment's `num_samples` samples: its prompts in order, `samples_per_prompt`
    samples each (one group per prompt), with the assignment's seeds; with `prompt_tokens_of`, each prompt is
    its task's prompt. A task id outside the task list is named as such, and `prompt_tokens_of` is only asked
    for the assigned (task id, length target) pairs, never for values a batch chose."""
    group = assignment.samples_per_prompt
    n = len(samples)
    if assignment.num_samples is not None and n != assignment.num_samples:
        return CheckVerdict(
            "fixed_data",
            False,
            (
                f"{n} samples; the assignment has {assignment.num_samples} "
                f"({assignment.num_samples // max(group, 1)} prompts x {group})",
            ),
        )
    if n == 0 or n % group:
        return CheckVerdict("fixed_data", False, (f"{n} samples is not a positive multiple of {group} per prompt",))
    key, version, k, salt = assignment.node_key, assignment.version, assignment.k, assignment.salt
    level, levels = assignment.level, assignment.levels
    if not 0 <= level < levels or assignment.num_tasks % levels:
        return CheckVerdict(
            "fixed_data",
            False,
            (f"the assignment's curriculum level {level} is not one of this pool's {levels} (data.curriculum)",),
        )
    prompts = assigned_task_ids(key, version, k, assignment.num_tasks, n // group, salt, level, levels)
    expected_tasks = np.repeat(prompts, group)
    expected_seeds = assigned_sample_seeds(key, version, k, n, salt)
    ids = [s.task_id for s in samples]  # Python ints: a batch's values are compared, never used as indices
    tasks = np.array([t if 0 <= t < assignment.num_tasks else -1 for t in ids], dtype=np.int64)
    group_ids = [s.group_id for s in samples]
    relabel = {g: i for i, g in enumerate(dict.fromkeys(group_ids))}  # numbered in order of appearance
    reasons = []
    outside = np.flatnonzero(tasks < 0)
    if len(outside):
        reasons.append(
            f"{len(outside)} samples hold task ids outside the task list (0..{assignment.num_tasks - 1}; "
            f"sample {outside[0]}: {ids[outside[0]]})"
        )
    wrong = np.flatnonzero(tasks != expected_tasks)
    if len(wrong):
        reasons.append(
            f"{len(wrong)} samples hold task ids the assignment does not give (sample {wrong[0]}: "
            f"{ids[wrong[0]]}, assigned {expected_tasks[wrong[0]]})"
        )
    if [relabel[g] for g in group_ids] != np.repeat(np.arange(n // group), group).tolist():
        reasons.append(f"group ids do not form {n // group} consecutive groups of {group} samples")
    wrong = [i for i, s in enumerate(samples) if s.seed != expected_seeds[i]]
    if wrong:
        reasons.append(f"{len(wrong)} samples hold seeds the assignment does not give (sample {wrong[0]})")
    group_seeds = expected_seeds[::group]
    expected_targets = np.repeat([length_target(assignment.length_targets, int(x)) for x in group_seeds], group)
    wrong = [i for i, s in enumerate(samples) if s.target_len != expected_targets[i]]
    if wrong:
        reasons.append(
            f"{len(wrong)} samples state a length target the assignment does not give (sample "
            f"{wrong[0]}: {samples[wrong[0]].target_len}, assigned {expected_targets[wrong[0]]})"
        )
    if assignment.prompt_tokens_of is not None:
        assigned = [
            i
            for i, s in enumerate(samples)  # the others failed above
            if tasks[i] == expected_tasks[i] and s.target_len == expected_targets[i]
        ]
        changed = [
            i
            for i in assigned
            if samples[i].prompt_tokens.tolist()
            != list(assignment.prompt_tokens_of(int(expected_tasks[i]), int(expected_targets[i])))
        ]
        if changed:
            reasons.append(
                f"{len(changed)} samples' prompts differ from their task's prompt (samples {changed[:_SHOWN]})"
            )
    return CheckVerdict("fixed_data", not reasons, tuple(reasons))


def check_reward(sample: Sample, reward_fn: Callable[[Sample], float], atol: float = 1e-4) -> CheckVerdict:
    """The reward `reward_fn` gives the sample equals the claimed one within `atol`; the recomputed reward
    is in numbers["recomputed"] (the learner trains on it, not on the worker's claim)."""
    try:
        recomputed = float(reward_fn(sample))
    except Exception as err:  # a reward function failing on this sample is a reason, not a validator crash
        return CheckVerdict("reward", False, (f"reward function raised {type(err).__name__}: {err}",))
    numbers = {"recomputed": recomputed, "claimed": float(sample.reward)}
    if not math.isfinite(sample.reward) or abs(sample.reward - recomputed) > atol:
        return CheckVerdict("reward", False, (f"claimed reward {sample.reward} but recomputed {recomputed}",), numbers)
    return CheckVerdict("reward", True, numbers=numbers)


def validate_batch(
    samples: Sequence[Sample],
    prefill: Prefill,
    declared: Declared,
    assignment: AssignedWork | None = None,
    reward_fn: Callable[[Sample], Any] | None = None,
    prefill_samples: int = 32,
) -> BatchVerdict:
    """All checks on a batch: fixed data (with an assignment), then per sample termination, computation,
    sampling, replay (when the pool's sampler is replayable: every token the seed's choice, near ties within
    their budgets) and reward (with a reward function). Prefill runs `prefill_samples` samples at a time, so
    the logits held at once stay bounded."""
    batch_checks = (check_fixed_data(samples, assignment),) if assignment is not None else ()
    verdicts: list[list[CheckVerdict]] = [
        [
            check_termination(
                s.completion_tokens,
                s.finish,
                declared.stop_token_ids,
                declared.max_tokens,
                len(s.prompt_tokens),
                declared.max_model_len,
            )
        ]
        for s in samples
    ]
    failed = _failed_cheap_check(batch_checks, verdicts)  # the batch is rejected already: no prefill
    logprobs: list[np.ndarray | None] = [None] * len(samples)
    runnable = []
    for i, s in enumerate(samples):
        problem = None if failed else _unscorable(s, prefill.vocab_size)
        if failed:
            not_run = (f"not run: batch failed {failed}",)
            verdicts[i] += [
                CheckVerdict("computation", False, not_run, ran=False),
                CheckVerdict("sampling", False, not_run, ran=False),
            ]
        elif problem:
            verdicts[i] += [CheckVerdict("computation", False, (problem,)), CheckVerdict("sampling", False, (problem,))]
        else:
            runnable.append(i)
    for start in range(0, len(runnable), prefill_samples):
        part = runnable[start : start + prefill_samples]
        results = prefill.run(
            [(samples[i].prompt_tokens.tolist(), samples[i].completion_tokens.tolist()) for i in part]
        )
        computation = check_computation_batch(
            [(samples[i].proofs, result.hidden) for i, result in zip(part, results)],
            declared.thresholds,
            declared.chunk,
            declared.topk,
        )
        sampling = check_sampling_batch(
            [(samples[i].completion_tokens, samples[i].logprobs, result.logits) for i, result in zip(part, results)],
            declared.temperature,
            declared.top_p,
            declared.tolerance,
            declared.dtype,
        )
        for i, *checked in zip(part, computation, sampling):
            verdicts[i] += checked
        for i, result in zip(part, results):
            logprobs[i] = _full_logprobs(result.logits, samples[i].completion_tokens, declared.temperature)
        if declared.sampler == "replayable":
            replayed = check_replay_batch(
                [(samples[i].completion_tokens, result.logits, samples[i].seed) for i, result in zip(part, results)],
                declared.temperature,
                declared.top_p,
                declared.tolerance,
                declared.dtype,
                device=getattr(prefill, "device", "cpu"),  # where the prefill ran
            )
            for i, verdict in zip(part, replayed):
                verdicts[i].append(verdict)
    if declared.sampler == "replayable":
        batch_checks += (
            check_near_tie_budget([v for vs in verdicts for v in vs if v.check == "replay"], declared.tolerance),
        )
    if reward_fn is not None:
        for i, s in enumerate(samples):
            verdicts[i].append(check_reward(s, reward_fn))
    sample_verdicts = tuple(SampleVerdict(i, tuple(v)) for i, v in enumerate(verdicts))
    return BatchVerdict(sample_verdicts, batch_checks, tuple(logprobs))


def _full_logprobs(logits, tokens: np.ndarray, temperature: float) -> np.ndarray | None:
    """log softmax(logits / T) at each token (float32), or None for logits that do not fit the tokens (the
    checks have rejected such a sample already)."""
    import torch

    z = torch.as_tensor(logits).float()
    if z.ndim != 2 or z.shape[0] != len(tokens) or len(tokens) == 0:
        return None
    rows = torch.arange(len(tokens))
    return torch.log_softmax(z / temperature, dim=-1)[rows, torch.as_tensor(tokens)].numpy()


def _failed_cheap_check(batch_checks: Sequence[CheckVerdict], verdicts: Sequence[Sequence[CheckVerdict]]) -> str | None:
    """The name of a check that already rejects the whole batch before any prefill (a failed batch-level
    check, or termination failed by every sample), or None."""
    failed = next((v.check for v in batch_checks if not v.passed), None)
    if failed is None and verdicts and all(not v[0].passed for v in verdicts):
        failed = verdicts[0][0].check
    return failed


def _unscorable(sample: Sample, vocab_size: int) -> str | None:
    """Why the sample cannot be prefilled (empty prompt or completion, a token id outside the vocab)."""
    tokens = np.concatenate([sample.prompt_tokens, sample.completion_tokens])
    if len(sample.prompt_tokens) == 0 or len(sample.completion_tokens) == 0:
        return (
            f"cannot recompute: {len(sample.prompt_tokens)} prompt and {len(sample.completion_tokens)} "
            "completion tokens"
        )
    if np.any((tokens < 0) | (tokens >= vocab_size)):
        return f"cannot recompute: token ids outside the vocab (0..{vocab_size - 1})"
    return None
