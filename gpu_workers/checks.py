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
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bridge.assignment import assigned_sample_seeds, assigned_task_ids
from bridge.rollouts import FINISH_LENGTH, FINISH_STOP
from gpu_workers.tasks.prompt import length_target
from gpu_workers.toploc import ChunkCheck, Thresholds, split_proofs, verify_proofs_batch

if TYPE_CHECKING:
    import torch

    from gpu_workers.prefill import Prefill

_SHOWN = 3  # offending positions quoted per reason


@dataclass(frozen=True)
class CheckVerdict:
    """The outcome of one check: passed or not, why not, and the numbers it measured."""

    check: str
    passed: bool
    reasons: tuple[str, ...] = ()
    numbers: Mapping[str, float] = field(default_factory=dict)
    ran: bool = True
    """False: the check was not run (`reasons` says why: the batch had failed a cheaper one); such a verdict
    does not pass, and is not counted among the failed checks."""


@dataclass(frozen=True)
class SampleVerdict:
    """Every per-sample check of one sample."""

    index: int
    verdicts: tuple[CheckVerdict, ...]

    @property
    def accepted(self) -> bool:
        return all(v.passed for v in self.verdicts)

    @property
    def failed(self) -> list[str]:
        return [v.check for v in self.verdicts if not v.passed and v.ran]

    def numbers(self, check: str) -> Mapping[str, float]:
        """The numbers of the named check (empty if it did not run)."""
        return next((v.numbers for v in self.verdicts if v.check == check), {})


@dataclass(frozen=True)
class BatchVerdict:
    """A batch is accepted when its batch-level checks pass and every sample is accepted."""

    samples: tuple[SampleVerdict, ...]
    batch_checks: tuple[CheckVerdict, ...] = ()
    logprobs: tuple[np.ndarray | None, ...] = ()
    """Per sample, the validator's logprob of each completion token on the full distribution at the declared
    temperature, from its prefill's logits (float32; None where no prefill ran): what the learner may take in
    place of the worker's claim (`bridge.validator_logprobs`)."""

    @property
    def accepted(self) -> bool:
        return bool(self.samples) and all(v.passed for v in self.batch_checks) and all(s.accepted for s in self.samples)

    def failed_checks(self) -> dict[str, int]:
        """Check name -> number of samples (or 1 for a batch-level check) that failed it."""
        counts: dict[str, int] = {}
        for verdict in self.batch_checks:
            if not verdict.passed:
                counts[verdict.check] = 1
        for sample in self.samples:
            for name in sample.failed:
                counts[name] = counts.get(name, 0) + 1
        return counts

    def reasons(self, limit: int = 20) -> list[str]:
        """Up to `limit` reasons, batch-level first, each prefixed with where it applies; those of checks that
        did not run come last, once per check."""
        out = [f"batch: {r}" for v in self.batch_checks for r in v.reasons]
        out += [f"sample {s.index}: {r}" for s in self.samples for v in s.verdicts if v.ran for r in v.reasons]
        out += dict.fromkeys(
            f"{v.check}: {r}" for s in self.samples for v in s.verdicts if not v.ran for r in v.reasons
        )
        return out[:limit]

    def summary(self) -> dict[str, Any]:
        """Counts, and the worst and the average of the computation and sampling numbers, for logs."""

        def values(check: str, key: str) -> list[float]:
            return [s.numbers(check)[key] for s in self.samples if key in s.numbers(check)]

        def worst(check: str, key: str) -> float | None:
            found = values(check, key)
            return round(max(found), 4) if found else None

        def average(check: str, key: str) -> float | None:
            found = values(check, key)
            return round(float(np.mean(found)), 4) if found else None

        return {
            "accepted": self.accepted,
            "samples": len(self.samples),
            "rejected": sum(not s.accepted for s in self.samples),
            "failed": self.failed_checks(),
            "worst": {
                "exp_mismatches": worst("computation", "max_exp_mismatches"),
                "mant_err_mean": worst("computation", "max_mant_err_mean"),
                "mant_err_median": worst("computation", "max_mant_err_median"),
                "logprob_diff_mean": worst("sampling", "mean_logprob_diff"),
                "logprob_diff_max": worst("sampling", "max_logprob_diff"),
            },
            "average": {
                "exp_mismatches": average("computation", "mean_exp_mismatches"),
                "mant_err_mean": average("computation", "mean_mant_err_mean"),
                "logprob_diff_mean": average("sampling", "mean_logprob_diff"),
            },
        }

    def rewards(self) -> list[float | None]:
        """The validator's recomputed reward per sample (None where the reward check did not run)."""
        return [s.numbers("reward").get("recomputed") for s in self.samples]


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
class SamplingTolerance:
    """How far the stored tokens and logprobs may stray from the validator's recomputation."""

    logit_tolerance: float = 0.25
    """Largest difference between the worker's and the validator's raw logits the nucleus check allows
    for: a token counts as inside if changing every logit by at most this much can put it inside."""
    max_logprob_diff: float | None = None
    """Largest |stored - recomputed| logprob for any one token from rounding (None: `MAX_LOGPROB_DIFF` of the
    pool's dtype); with top-p < 1, log(1 / top_p) is added (not divided by the temperature): a token at the
    nucleus boundary that is in one side's nucleus and not the other's moves that step's renormalisation by
    up to that much."""
    mean_logprob_diff: float | None = None
    """Largest mean |stored - recomputed| logprob over a sample's tokens (None: `MEAN_LOGPROB_DIFF` of the
    pool's dtype), ..."""
    mean_signed_logprob_diff: float = 0.05
    """Largest |mean (stored - recomputed)| over a sample's tokens (after the same allowance): logprobs
    shifted one way move the loss's importance ratios; honest rounding errors mostly cancel (an honest
    bfloat16 worker at the Qwen2.5-0.5B shape: at most 0.023 while its mean |difference| reached 0.064)."""
    logprob_diff_allowance: float = 0.1
    """... after this much total |stored - recomputed| is forgiven; both mean bounds also set aside the sample's
    largest difference (a token where the engines' nuclei differ moves by up to log(1 / top_p) plus rounding),
    which `max_logprob_diff` bounds alone, so they hold for 1- and 2-token samples.
    The three logprob bounds are stated at temperature 1 and divided by the temperature: a logit error d
    moves a tempered logprob by up to 2 d / T."""
    replay_logit_tolerance: float | None = None
    """Largest difference between the worker's and the validator's raw logits the replay check allows for
    (None: `REPLAY_LOGIT_TOLERANCE` of the pool's dtype). A token whose noisy score z_t + g_t falls short of
    the best noisy score by more than 2 x this / T is not the seed's choice."""
    tie_logit_tolerance: float | None = None
    """The logit scale near ties are priced on (None: the replay tolerance). A near tie whose noisy score is short
    of the best by g costs `near_tie_floor` + (1 - `near_tie_floor`) x g / (2 t / T), t this, and 1 from the tie
    margin 2 t / T on (the replay margin still bounds what passes). Engines' rounding flips a choice only where
    the two best noisy scores almost touch: on the demo's bfloat16 policy 90% of honest near ties had gaps under
    0.13 raw logits, while a cheater's choices fall anywhere in the margin. `benchmarks/replay_margin.py`
    measures a model's honest near ties and prints this."""
    near_tie_floor: float = 0.25
    """What a near tie (a token that passes the replay without being the validator's own choice) costs against
    the budgets below, at least: `near_tie_floor` + (1 - `near_tie_floor`) x its gap / the tie margin. Honest
    near ties have small gaps (an honest bfloat16 worker at the Qwen2.5-0.5B shape: 3.7-4.7% of its tokens
    were near ties, none with a gap over 0.21 of the default margin)."""
    near_ties_per_sample: float = 1.0
    """Near-tie cost allowed per sample ... (and the least a batch may spend: one near tie at the tie margin)"""
    near_ties_per_token: float = 0.05
    """... plus this much per completion token of the sample."""
    near_ties_per_batch_token: float = 0.02
    """Near-tie cost allowed across the whole batch, per completion token (at least `near_ties_per_sample`: a
    short batch is held to the same share of its tokens as a long one, not to a constant that dominates it)."""


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
    completions: one "replay" verdict per completion (`check_near_tie_budget` judges the batch's near ties).
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
        seeds, positions = [int(seed)] * n, list(range(n))
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
                choice[redo], best[redo] = noisy_max(masked[redo], [int(seed)] * int(redo.sum()), rows[redo].tolist())
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
                f"{len(off)} of {n} tokens are not what seed {int(seed)} samples (positions {shown}: "
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
    prompts = assigned_task_ids(key, version, k, assignment.num_tasks, n // group, salt)
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
