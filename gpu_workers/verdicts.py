"""What the validator's checks return (`CheckVerdict` per check, `SampleVerdict`, `BatchVerdict`) and the
tolerances of the sampling and replay checks (`SamplingTolerance`); `gpu_workers.checks` runs them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

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

    def near_tie_samples(self) -> list[int]:
        """Indices of the samples whose replay took a near tie (`near_ties` > 0: a token within the engines'
        rounding of the seed's choice by the validator's logits, but not it, or a pass-over of the nucleus): where a
        worker could have chosen among tokens unseen, and what the learner leaves out (`[loss] near_tie_samples`)."""
        return [s.index for s in self.samples if s.numbers("replay").get("near_ties", 0) > 0]

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
