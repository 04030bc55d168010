"""The validator's checks on synthetic data: nucleus and logprobs against vLLM's own sampler functions,
termination against vLLM's stop rule, fixed data against `bridge.assignment`, and malformed input."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from bridge.assignment import assigned_sample_seeds, assigned_task_ids
from bridge.rollouts import FINISH_LENGTH, FINISH_STOP
from gpu_workers.checks import (
    AssignedWork,
    BatchVerdict,
    CheckVerdict,
    Sample,
    SampleVerdict,
    SamplingTolerance,
    check_computation,
    check_computation_batch,
    check_fixed_data,
    check_replay_batch,
    check_reward,
    check_sampling,
    check_sampling_batch,
    check_termination,
    samples_from_arrays,
)
from gpu_workers.replay import gumbel_noise
from gpu_workers.toploc import build_proofs, proof_sizes, split_proofs

EXACT = SamplingTolerance(logit_tolerance=0.0)
KEY = "0f" * 32


def _vllm_processed(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """vLLM's processed logprobs, by vLLM's own top-p function (the reference for the sampling check)."""
    sampler = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    masked = sampler.apply_top_k_top_p_pytorch(logits.float() / temperature, None, torch.full((len(logits),), top_p))
    return masked.log_softmax(dim=-1)


def _logits(n: int = 40, vocab: int = 300, seed: int = 0, spread: float = 3.0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((n, vocab)) * spread).float()


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (0.6, 0.5), (1.3, 0.95)])
def test_sampling_accepts_what_vllm_samples_and_matches_its_logprobs(temperature, top_p):
    logits = _logits(seed=int(temperature * 10 + top_p * 100))
    processed = _vllm_processed(logits, temperature, top_p)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.multinomial(processed.exp(), 1, generator=generator)[:, 0]
    stored = processed.gather(1, tokens[:, None])[:, 0].numpy()
    verdict = check_sampling(tokens.tolist(), stored, logits, temperature, top_p, EXACT)
    assert verdict.passed, verdict.reasons
    assert verdict.numbers["max_logprob_diff"] < 1e-5


@pytest.mark.parametrize("temperature,top_p", [(0.7, 0.9), (1.0, 0.5)])
def test_nucleus_with_zero_tolerance_is_exactly_vllms_mask(temperature, top_p):
    """Every token of every row: inside for the check iff vLLM's top-p leaves its logit finite."""
    logits = _logits(n=12, vocab=200, seed=3)
    kept = torch.isfinite(_vllm_processed(logits, temperature, top_p))
    for token in range(logits.shape[1]):
        column = torch.full((len(logits),), token)
        verdict = check_sampling(
            column.tolist(),
            np.full(len(logits), -1.0),
            logits,
            temperature,
            top_p,
            SamplingTolerance(logit_tolerance=0.0, max_logprob_diff=math.inf, mean_logprob_diff=math.inf),
        )
        outside = verdict.numbers["tokens_outside_nucleus"]
        assert outside == int((~kept[:, token]).sum()), token


def test_tolerance_covers_any_logit_change_within_it():
    """A token inside vLLM's nucleus of logits changed by at most the tolerance passes on the unchanged ones."""
    tolerance = SamplingTolerance(logit_tolerance=0.1, max_logprob_diff=math.inf, mean_logprob_diff=math.inf)
    rng = np.random.default_rng(5)
    logits = _logits(n=60, vocab=50, seed=5, spread=2.0)
    for trial in range(20):
        changed = logits + torch.from_numpy(rng.uniform(-0.1, 0.1, logits.shape)).float()
        kept = torch.isfinite(_vllm_processed(changed, 0.8, 0.7))
        rows, tokens = torch.nonzero(kept, as_tuple=True)
        verdict = check_sampling(tokens.tolist(), np.full(len(rows), -1.0), logits[rows], 0.8, 0.7, tolerance)
        assert verdict.numbers["tokens_outside_nucleus"] == 0, trial
    far = check_sampling([int(logits[0].argmin())], [-1.0], logits[:1], 0.8, 0.7, tolerance)
    assert far.numbers["tokens_outside_nucleus"] == 1  # a tail token is still caught


def test_sampling_rejects_fabricated_logprobs_and_tokens_outside_the_nucleus():
    logits = _logits(seed=7)
    processed = _vllm_processed(logits, 0.7, 0.8)
    greedy = logits.argmax(-1)
    honest = processed.gather(1, greedy[:, None])[:, 0].numpy()
    assert check_sampling(greedy.tolist(), honest, logits, 0.7, 0.8).passed
    for fabricated in (np.zeros_like(honest), honest - 0.2, honest[::-1].copy()):
        verdict = check_sampling(greedy.tolist(), fabricated, logits, 0.7, 0.8)
        assert not verdict.passed and "logprobs differ" in " ".join(verdict.reasons)
    # a bfloat16 pool (the default) bounds the mean |difference| at 0.15 (honest rounding of larger models),
    # float32 at 0.05; a shift of every logprob one way is bounded at 0.05 for both (honest errors cancel)
    at_t1 = _vllm_processed(logits, 1.0, 0.8).gather(1, greedy[:, None])[:, 0].numpy()
    rows = np.flatnonzero(at_t1 < -0.1)
    rows = rows[: len(rows) // 2 * 2]
    assert len(rows) >= 8
    noisy = at_t1[rows] + np.tile([0.08, -0.08], len(rows) // 2)  # mean |difference| 0.08, no drift
    assert check_sampling(greedy[rows].tolist(), noisy, logits[rows], 1.0, 0.8).passed
    assert not check_sampling(greedy[rows].tolist(), noisy, logits[rows], 1.0, 0.8, dtype="float32").passed
    verdict = check_sampling(greedy[rows].tolist(), at_t1[rows] - 0.1, logits[rows], 1.0, 0.8)  # 0.1 < 0.15
    assert not verdict.passed and "in one direction" in " ".join(verdict.reasons), verdict.reasons
    tail = logits.argsort(-1)[:, 0]  # the least likely token of each row
    verdict = check_sampling(tail.tolist(), honest, logits, 0.7, 0.8)
    assert not verdict.passed and verdict.numbers["tokens_outside_nucleus"] == len(logits)
    assert "outside the top-p 0.8 nucleus" in verdict.reasons[0]


@pytest.mark.parametrize(
    "tokens,logprobs,why",
    [
        ([1, 2], [-1.0], "2 tokens and 1 logprobs"),
        ([1, 999], [-1.0, -1.0], "outside the vocab"),
        ([1, -1], [-1.0, -1.0], "outside the vocab"),
        ([1, 2], [-1.0, math.nan], "finite"),
        ([1, 2], [-1.0, 0.5], "<= 0"),
    ],
)
def test_sampling_malformed_input_is_a_reason_not_an_exception(tokens, logprobs, why):
    verdict = check_sampling(tokens, logprobs, _logits(n=2), 1.0, 1.0)
    assert not verdict.passed and why in verdict.reasons[0]


def test_sampling_refuses_meaningless_parameters():
    with pytest.raises(ValueError, match="temperature"):
        check_sampling([1], [-1.0], _logits(n=1), 0.0, 0.9)
    with pytest.raises(ValueError, match="top_p"):
        check_sampling([1], [-1.0], _logits(n=1), 1.0, 1.5)


STOPS = frozenset({0, 2})


@pytest.mark.parametrize(
    "tokens,finish,max_tokens,accepted",
    [
        ([5, 6, 0], FINISH_STOP, 8, True),  # ends with a stop token
        ([2], FINISH_STOP, 8, True),  # stops after one token
        ([5, 6, 7], FINISH_STOP, 8, False),  # cut short, no stop token
        ([5, 0, 7, 2], FINISH_STOP, 8, False),  # a stop token earlier: generation would have ended there
        ([5, 6, 7, 8], FINISH_LENGTH, 4, True),  # exactly max_tokens
        ([5, 6, 7], FINISH_LENGTH, 4, False),  # cut short and claimed as length
        ([5, 6, 7, 0], FINISH_LENGTH, 4, False),  # vLLM checks stop before length: that is finish = stop
        ([5, 6, 7, 8, 9], FINISH_LENGTH, 4, False),  # longer than max_tokens
        ([5, 6, 0], 2, 8, False),  # unknown finish code
        ([], FINISH_STOP, 8, False),
    ],
)
def test_termination(tokens, finish, max_tokens, accepted):
    verdict = check_termination(tokens, finish, STOPS, max_tokens)
    assert verdict.passed == accepted, verdict.reasons
    assert accepted or verdict.reasons


def test_termination_at_the_context_limit_counts_as_length():
    assert check_termination([5, 6], FINISH_LENGTH, STOPS, 8, prompt_len=30, max_model_len=32).passed
    assert not check_termination([5, 6], FINISH_LENGTH, STOPS, 8, prompt_len=29, max_model_len=32).passed


def _assigned_samples(version=3, k=1, num_tasks=50, prompts=3, group=4, prompt_of=lambda t: [1, t, 7]):
    tasks = assigned_task_ids(KEY, version, k, num_tasks, prompts)
    seeds = assigned_sample_seeds(KEY, version, k, prompts * group)
    return [
        Sample(
            prompt_tokens=prompt_of(tasks[i // group]),
            completion_tokens=[4],
            logprobs=[-1.0],
            finish=FINISH_STOP,
            proofs=b"",
            seed=seeds[i],
            task_id=tasks[i // group],
            group_id=10 + i // group,
        )
        for i in range(prompts * group)
    ]


def test_fixed_data_accepts_the_assignment_and_names_each_departure():
    assignment = AssignedWork(
        KEY, version=3, k=1, num_tasks=50, samples_per_prompt=4, prompt_tokens_of=lambda t, _target: [1, t, 7]
    )
    samples = _assigned_samples()
    assert check_fixed_data(samples, assignment).passed

    def replaced(i, **changes):
        fields = {name: getattr(samples[i], name) for name in Sample.__dataclass_fields__}
        return samples[:i] + [Sample(**{**fields, **changes})] + samples[i + 1 :]

    other_task = next(t for t in range(50) if t not in {s.task_id for s in samples})
    cases = {
        "task ids": replaced(5, task_id=other_task, prompt_tokens=[1, other_task, 7]),
        "seeds": replaced(2, seed=samples[2].seed + 1),
        "group ids": replaced(3, group_id=11),
        "prompts differ": replaced(0, prompt_tokens=[1, samples[0].task_id, 8]),
        "positive multiple": samples[:-1],
        "another assignment": _assigned_samples(k=2),
    }
    for why, batch in cases.items():
        verdict = check_fixed_data(batch, assignment)
        assert not verdict.passed and verdict.reasons, why
        expected = "task ids" if why == "another assignment" else why
        assert expected in " ".join(verdict.reasons), (why, verdict.reasons)


def test_reward_recomputed_compared_and_reported():
    sample = _assigned_samples()[0]
    fields = {name: getattr(sample, name) for name in Sample.__dataclass_fields__}
    honest = Sample(**{**fields, "reward": 0.5})
    assert check_reward(honest, lambda s: 0.5).passed
    assert check_reward(honest, lambda s: 0.5).numbers["recomputed"] == 0.5
    inflated = check_reward(Sample(**{**fields, "reward": 1.0}), lambda s: 0.5)
    assert not inflated.passed and inflated.numbers["recomputed"] == 0.5
    assert not check_reward(Sample(**{**fields, "reward": math.nan}), lambda s: 0.5).passed
    raised = check_reward(honest, lambda s: 1 / 0)
    assert not raised.passed and "ZeroDivisionError" in raised.reasons[0]


def _bits(rows: int, hidden: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((rows, hidden), dtype=np.float32)).to(
        torch.bfloat16
    )


def test_computation_splits_the_stored_proofs_and_rejects_bad_lengths():
    hidden = _bits(40, 64)
    proofs = build_proofs(hidden)
    assert proof_sizes(40, 64) == [258, 2 + 2 * 128] == [len(p) for p in proofs]
    assert split_proofs(b"".join(proofs), 40, 64) == proofs
    assert check_computation(b"".join(proofs), hidden).passed
    assert check_computation(b"".join(proofs), hidden.float()).passed  # compared in bf16 whatever it came as
    for blob in (b"", b"".join(proofs)[:-1], b"".join(proofs) + b"\0"):
        verdict = check_computation(blob, hidden)
        assert not verdict.passed and "decode steps of hidden size 64 need 516" in verdict.reasons[0]
    other = check_computation(b"".join(build_proofs(_bits(40, 64, seed=1))), hidden)
    assert not other.passed and other.reasons[0].startswith("TOPLOC chunk 0")
    assert other.numbers["max_exp_mismatches"] > 38


def _pack(samples: list[Sample]) -> dict[str, np.ndarray]:
    """The docs/design.md section 6 arrays of `samples` (prompt logprobs 0)."""
    lengths = [len(s.prompt_tokens) + len(s.completion_tokens) for s in samples]
    return {
        "tokens": np.concatenate([np.r_[s.prompt_tokens, s.completion_tokens] for s in samples]).astype(np.int32),
        "offsets": np.r_[0, np.cumsum(lengths)].astype(np.int64),
        "prompt_lens": np.array([len(s.prompt_tokens) for s in samples], np.int32),
        "logprobs": np.concatenate([np.r_[np.zeros(len(s.prompt_tokens)), s.logprobs] for s in samples]).astype(
            np.float32
        ),
        "task_ids": np.array([s.task_id for s in samples], np.int64),
        "group_ids": np.array([s.group_id for s in samples], np.int32),
        "target_lens": np.array([s.target_len for s in samples], np.int32),
        "seeds": np.array([s.seed for s in samples], np.uint64),
        "finish": np.array([s.finish for s in samples], np.uint8),
        "rewards": np.array([s.reward for s in samples], np.float32),
        "proofs": np.frombuffer(b"".join(s.proofs for s in samples), np.uint8),
        "proof_offsets": np.r_[0, np.cumsum([len(s.proofs) for s in samples])].astype(np.int64),
    }


def test_samples_from_arrays_round_trip_and_bad_fields():
    rng = np.random.default_rng(0)
    samples = [
        Sample(
            prompt_tokens=rng.integers(0, 99, 3 + i),
            completion_tokens=rng.integers(0, 99, 1 + 2 * i),
            logprobs=-rng.random(1 + 2 * i).astype(np.float32),
            finish=i % 2,
            proofs=bytes([i]) * (3 * i),
            seed=2**63 + i,
            task_id=i,
            group_id=i // 2,
            reward=0.25 * i,
            target_len=i,
        )
        for i in range(5)
    ]
    back = samples_from_arrays(_pack(samples))
    for a, b in zip(samples, back):
        for name in Sample.__dataclass_fields__:
            assert np.array_equal(getattr(a, name), getattr(b, name)), name
    arrays = _pack(samples)
    broken = {
        "missing rewards": ({k: v for k, v in arrays.items() if k != "rewards"}, "missing rewards"),
        "offsets": ({**arrays, "offsets": arrays["offsets"][::-1]}, "offsets"),
        "proof_offsets": ({**arrays, "proof_offsets": arrays["proof_offsets"][:-1]}, "proof_offsets"),
        "logprobs": ({**arrays, "logprobs": arrays["logprobs"][:-1]}, "logprobs"),
        "seeds": ({**arrays, "seeds": arrays["seeds"][:2]}, "seeds"),
        "prompt_lens": ({**arrays, "prompt_lens": arrays["prompt_lens"] + 100}, "prompt_lens: sample 0"),
    }
    for name, (bad, message) in broken.items():
        with pytest.raises(ValueError, match=message):
            samples_from_arrays(bad)


def test_batch_verdict_aggregates_samples_and_batch_checks():
    ok, bad = CheckVerdict("sampling", True), CheckVerdict("computation", False, ("TOPLOC chunk 0: ...",))
    reward = CheckVerdict("reward", True, numbers={"recomputed": 0.75})
    samples = (SampleVerdict(0, (ok, reward)), SampleVerdict(1, (ok, bad)), SampleVerdict(2, (bad, bad)))
    verdict = BatchVerdict(samples, (CheckVerdict("fixed_data", False, ("task ids",)),))
    assert not verdict.accepted
    assert verdict.failed_checks() == {"fixed_data": 1, "computation": 3}
    assert verdict.reasons(limit=2) == ["batch: task ids", "sample 1: TOPLOC chunk 0: ..."]
    assert verdict.rewards() == [0.75, None, None]
    assert BatchVerdict(samples[:1]).accepted
    assert not BatchVerdict(()).accepted  # an empty batch is no batch


def test_fixed_data_checks_the_length_target_drawn_from_each_groups_first_seed():
    targets = (16, 32, 64)
    seeds = assigned_sample_seeds(KEY, 3, 1, 12)
    expected = [targets[seeds[g * 4] % 3] for g in range(3)]  # the draw, written out independently
    prompted = lambda t, target: [1, t, 7, target]  # noqa: E731  (the target is part of the prompt)
    assignment = AssignedWork(
        KEY, version=3, k=1, num_tasks=50, samples_per_prompt=4, prompt_tokens_of=prompted, length_targets=targets
    )
    tasks = assigned_task_ids(KEY, 3, 1, 50, 3)
    honest = [
        Sample(
            prompt_tokens=prompted(tasks[i // 4], expected[i // 4]),
            completion_tokens=[4],
            logprobs=[-1.0],
            finish=FINISH_STOP,
            proofs=b"",
            seed=seeds[i],
            task_id=tasks[i // 4],
            group_id=i // 4,
            target_len=expected[i // 4],
        )
        for i in range(12)
    ]
    assert check_fixed_data(honest, assignment).passed
    easier = min(t for t in targets if t != expected[1])  # a worker picking its own (easier) budget for group 1
    fields = {name: getattr(honest[5], name) for name in Sample.__dataclass_fields__}
    cheat = (
        honest[:5]
        + [Sample(**{**fields, "target_len": easier, "prompt_tokens": prompted(tasks[1], easier)})]
        + honest[6:]
    )
    verdict = check_fixed_data(cheat, assignment)
    assert not verdict.passed and "length target" in " ".join(verdict.reasons)
    assert not check_fixed_data(honest, dataclasses.replace(assignment, length_targets=())).passed


def _reference_sampling(tokens, logits: torch.Tensor, temperature: float, top_p: float, logit_tolerance: float):
    """The sampling check's original algorithm, row by row in float64 with a full sort: the least mass above
    each token and its logprob over the nucleus plus itself. Two departures from the code it was, both
    where that left the answer to chance: ties are ordered explicitly (the token first among equal
    probabilities, then by index) where torch's unstable sort leaves their order open, and the mass not
    above the token is summed rather than taken as 1 - A (at temperature 0.01 the original's 1 - A,
    amplified by e^25, gave masses like -8.7e-7 for tokens 170 nats down the tail)."""
    slack = logit_tolerance / temperature
    least_above, recomputed = [], []
    for row, token in zip(logits.double() / temperature, tokens):
        probs = torch.softmax(row, dim=-1)
        chosen = row[token]
        above = row > chosen + 2 * slack
        low = float(probs[above].sum()) * math.exp(-slack)
        least_above.append(low / (low + float(probs[~above].sum()) * math.exp(slack)))
        kept = torch.ones_like(row, dtype=torch.bool)
        if top_p < 1:
            others = np.arange(len(row)) != token
            order = torch.from_numpy(np.lexsort((np.arange(len(row)), others, -probs.numpy())))
            ordered = probs[order]
            kept[order] = (ordered.cumsum(0) - ordered) < top_p
            kept[token] = True
        recomputed.append(float(chosen - torch.logsumexp(row[kept], dim=0)))
    return np.array(least_above), np.array(recomputed)


def _reference_verdict_numbers(reference, stored, temperature, top_p, tolerance):
    """The reference's verdict numbers and acceptance, or None for acceptance where some token's least mass
    above lies within float64 rounding (1e-12) of top_p: there either side is right, and the two codes sum
    that mass in different orders (e.g. a token of logit -inf at top_p 1: the reference's mass above it is 1
    or 1 - 1e-16 as rounding falls)."""
    least_above, recomputed = reference
    diff = np.abs(np.asarray(stored, np.float64) - recomputed)
    borderline = np.abs(least_above - top_p) < 1e-12
    outside = least_above >= top_p
    numbers = {
        "tokens": len(stored),
        "tokens_outside_nucleus": (int((outside & ~borderline).sum()), int((outside | borderline).sum())),
        "max_least_mass_above": least_above.max(),
        "max_logprob_diff": diff.max(),
        "mean_logprob_diff": diff.mean(),
    }
    signed = abs(float((np.asarray(stored, np.float64) - recomputed).sum()))
    # the documented bounds: stated at T = 1 and divided by T (bfloat16 defaults where unset), the per-token one
    # plus log(1 / top_p); the mean ones over the tokens but the one of largest difference, plus the allowance
    worst, n = diff.max(), len(stored)
    per_token = (0.75 if tolerance.max_logprob_diff is None else tolerance.max_logprob_diff) / temperature
    mean = (0.15 if tolerance.mean_logprob_diff is None else tolerance.mean_logprob_diff) / temperature
    allowance = tolerance.logprob_diff_allowance / temperature
    accepted = bool(
        not outside.any()
        and worst <= per_token + math.log(1 / top_p)
        and diff.sum() - worst <= mean * n + allowance
        and signed - worst <= tolerance.mean_signed_logprob_diff / temperature * n + allowance
    )
    return numbers, None if borderline.any() else accepted


def _edge_case_logits(rng: np.random.Generator, vocab: int) -> tuple[torch.Tensor, np.ndarray]:
    """Rows that stress the nucleus: ties (many equal logits, ties at the boundary), -inf logits, one
    dominant token, flat rows, wide spreads; tokens drawn from the whole row (inside, boundary, tail)."""
    rows = []
    rows.append(rng.integers(-2, 3, vocab).astype(np.float32))  # five values only: ties everywhere
    flat = np.zeros(vocab, np.float32)
    rows.append(flat)  # all tied
    masked = (rng.standard_normal(vocab) * 2).astype(np.float32)
    masked[rng.random(vocab) < 0.5] = -np.inf
    rows.append(masked)
    peaked = (rng.standard_normal(vocab) * 0.1).astype(np.float32)
    peaked[3] = 30.0
    rows.append(peaked)  # one token holds ~all mass
    rows.append((rng.standard_normal(vocab) * 20).astype(np.float32))  # wide spread
    rows.append((rng.standard_normal(vocab) * 0.01).astype(np.float32))  # nearly flat
    quarters = np.full(vocab, -np.inf, np.float32)
    quarters[:4] = 0.0  # four tokens of exactly 1/4: prefix masses 0.25, 0.5, 0.75 hit top_p exactly
    rows.append(quarters)
    logits = np.stack(rows)
    tokens = np.concatenate([[int(rng.integers(0, vocab))] for _ in rows])
    tokens[6] = int(rng.integers(0, 4))
    return torch.from_numpy(logits), tokens


@pytest.mark.parametrize("vocab", [37, 512, 3000])
@pytest.mark.parametrize(
    "temperature,top_p", [(1.0, 1.0), (1.0, 0.95), (0.7, 0.5), (0.01, 0.9), (50.0, 0.75), (1.0, 0.25)]
)
def test_sampling_equals_the_sorting_reference(vocab, temperature, top_p):
    """check_sampling (bucketed nucleus, rows batched) against the original full-sort algorithm: the same
    verdict and numbers on random logits at several spreads and on edge-case rows, for every token of a
    row (inside, at the boundary, in the tail), with and without logit tolerance."""
    rng = np.random.default_rng(vocab + int(temperature * 100) + int(top_p * 1000))
    random_rows = torch.from_numpy(
        (rng.standard_normal((24, vocab)) * rng.choice([0.3, 2.0, 6.0], (24, 1))).astype(np.float32)
    )
    edge_rows, edge_tokens = _edge_case_logits(rng, vocab)
    logits = torch.cat([random_rows, edge_rows])
    tokens = np.concatenate([rng.integers(0, vocab, len(random_rows)), edge_tokens])
    tolerances = (
        EXACT,
        SamplingTolerance(),
        SamplingTolerance(logit_tolerance=0.05, max_logprob_diff=0.3, mean_logprob_diff=0.01),
    )
    for tolerance in tolerances:
        reference = _reference_sampling(tokens, logits, temperature, top_p, tolerance.logit_tolerance)
        finite = np.where(np.isfinite(reference[1]), reference[1], -50.0)
        # stored logprobs: the reference's own, off by noise, or far off
        for noise in (0.0, 0.02, 0.5):
            stored = np.minimum(finite + rng.normal(0, noise, len(finite)), 0.0)
            expected, accepted = _reference_verdict_numbers(reference, stored, temperature, top_p, tolerance)
            verdict = check_sampling(tokens, stored, logits, temperature, top_p, tolerance)
            assert accepted is None or verdict.passed == accepted, (tolerance, noise, verdict.reasons)
            fewest, most = expected.pop("tokens_outside_nucleus")
            assert fewest <= verdict.numbers["tokens_outside_nucleus"] <= most, (tolerance, noise)
            for key, value in expected.items():
                assert verdict.numbers[key] == pytest.approx(value, rel=1e-9, abs=1e-12), (key, tolerance, noise)
    # every token of a few rows: inside, at the boundary and in the tail of the nucleus
    for row in (0, len(random_rows), len(random_rows) + 2, len(random_rows) + 6) if vocab <= 512 else ():
        column = np.arange(vocab)
        repeated = logits[row : row + 1].expand(vocab, vocab)
        least, again = _reference_sampling(column, repeated, temperature, top_p, 0.1)
        stored = np.full(vocab, -1.0)
        verdict = check_sampling(
            column,
            stored,
            repeated,
            temperature,
            top_p,
            SamplingTolerance(logit_tolerance=0.1, max_logprob_diff=math.inf, mean_logprob_diff=math.inf),
        )
        borderline = np.abs(least - top_p) < 1e-12
        assert (
            int(((least >= top_p) & ~borderline).sum())
            <= verdict.numbers["tokens_outside_nucleus"]
            <= int(((least >= top_p) | borderline).sum())
        ), row
        diff = np.abs(stored - again)
        assert verdict.numbers["max_logprob_diff"] == pytest.approx(diff.max(), rel=1e-9), row
        assert verdict.numbers["mean_logprob_diff"] == pytest.approx(diff.mean(), rel=1e-9), row


def test_token_of_probability_zero_is_outside_even_at_top_p_1():
    """A token whose logit is -inf cannot have been sampled: outside at every top_p, whatever the rounding
    of the mass above it (which the original code summed to 1 or to 1 - 1e-16 as it fell)."""
    logits = _logits(n=6, vocab=300, seed=11)
    logits[:, 7] = -math.inf
    for top_p in (1.0, 0.999999, 0.5):
        verdict = check_sampling([7] * 6, [-1.0] * 6, logits, 1.0, top_p)
        assert verdict.numbers["tokens_outside_nucleus"] == 6, top_p


def test_batched_checks_give_each_samples_own_verdict():
    """check_sampling_batch and check_computation_batch, on samples of different lengths with malformed and
    tampered ones among them, give exactly the verdicts of one call per sample (whose results the tests
    above hold against vLLM's sampler, the sorting reference and the TOPLOC reference vectors)."""
    completions, proofs = [], []
    for i, n in enumerate([5, 40, 1, 33, 70, 8]):
        logits = _logits(n=n, vocab=300, seed=20 + i)
        processed = _vllm_processed(logits, 0.8, 0.9)
        tokens = torch.multinomial(processed.exp(), 1, generator=torch.Generator().manual_seed(i))[:, 0]
        stored = processed.gather(1, tokens[:, None])[:, 0].numpy()
        hidden = _bits(n, 48, seed=i)
        blob = b"".join(build_proofs(hidden))
        if i == 1:
            stored = stored - 0.3  # fabricated logprobs
            blob = b"".join(build_proofs(_bits(n, 48, seed=99)))  # proofs of other states
        if i == 3:
            tokens = tokens.clone()
            tokens[4] = int(logits[4].argmin())  # one token from the tail
            blob = blob[:-2]  # a truncated proof
        if i == 4:
            stored = stored[:-1]  # one logprob missing
        completions.append((tokens.numpy(), stored, logits))
        proofs.append((blob, hidden.float() if i == 2 else hidden))
    for tolerance in (SamplingTolerance(), EXACT):
        batched = check_sampling_batch(completions, 0.8, 0.9, tolerance)
        assert batched == [check_sampling(*c, 0.8, 0.9, tolerance) for c in completions]
    assert [v.passed for v in batched] == [True, False, True, False, False, True]
    computed = check_computation_batch(proofs)
    assert computed == [check_computation(*p) for p in proofs]
    assert [v.passed for v in computed] == [True, False, True, False, True, True]


def _boundary_row(vocab: int = 8) -> torch.Tensor:
    """Validator logits where token 2 is the last of the top-p 0.7 nucleus by 0.01 of mass (0.69 ranks above it)."""
    probs = np.array([0.37, 0.32, 0.25] + [0.06 / (vocab - 3)] * (vocab - 3))
    return torch.from_numpy(np.log(probs)).float()


def test_honest_one_and_two_token_bfloat16_samples_pass_the_mean_logprob_bounds():
    """A bfloat16 worker whose logit of token 1 is 0.15 higher than the validator's (rounding) leaves token 2
    out of its top-p nucleus: its logprob of token 0, renormalised over a smaller nucleus, is ~0.24 above the
    validator's. In a 1- or 2-token sample that boundary token was the whole signed mean and failed the bound
    (0.05 x n + 0.1 at T 1), rejecting the honest batch; the stored logprobs are vLLM's own processed ones."""
    top_p, rng = 0.7, np.random.default_rng(4)
    boundary = _boundary_row()
    plain = torch.from_numpy(rng.standard_normal(8) * 2).float()
    validator = torch.stack([boundary, plain])
    worker = validator.clone()
    worker[0, 1] += 0.15
    worker[1] += torch.from_numpy(rng.uniform(-0.05, 0.05, 8)).float()
    stored_all = _vllm_processed(worker, 1.0, top_p)
    assert not torch.isfinite(stored_all[0, 2]) and torch.isfinite(_vllm_processed(validator, 1.0, top_p)[0, 2])
    tokens = [0, int(torch.argmax(stored_all[1]))]
    stored = stored_all[[0, 1], tokens].numpy()
    for n in (1, 2):
        recomputed = _vllm_processed(validator[:n], 1.0, top_p)[range(n), tokens[:n]].numpy()
        signed = float((stored[:n] - recomputed).sum())
        assert abs(signed) > 0.05 * n + 0.1, f"{n} tokens: drift {signed:.3f}, not the case meant"
        verdict = check_sampling(tokens[:n], stored[:n], validator[:n], 1.0, top_p, dtype="bfloat16")
        assert verdict.passed, (n, verdict.reasons)
        assert verdict.numbers["mean_signed_logprob_diff"] == pytest.approx(signed / n, rel=1e-5)


def test_a_forged_two_token_sample_with_true_logprobs_is_still_rejected_by_the_replay():
    """Short samples keep every other check: two tokens the seed does not give, with the true logprobs (so the
    sampling check passes), fail the replay."""
    logits, seed = _logits(n=2, vocab=50, seed=12, spread=1.0), 40
    noisy = logits + gumbel_noise([seed, seed], [0, 1], 50)
    tokens = noisy.argmin(-1)  # the seed's least likely choice at each position
    stored = _vllm_processed(logits, 1.0, 1.0).gather(1, tokens[:, None])[:, 0].numpy()
    assert check_sampling(tokens.tolist(), stored, logits, 1.0, 1.0).passed
    (replayed,) = check_replay_batch([(tokens, logits, seed)], 1.0, 1.0)
    assert not replayed.passed and replayed.numbers["off_seed_tokens"] == 2, replayed.numbers


@pytest.mark.parametrize("dtype,rounding,temperature", [("float32", 1e-4, 1.0), ("float32", 1e-4, 0.6)])
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_a_logprob_moved_by_half_a_nat_is_rejected(dtype, rounding, temperature, top_p):
    """Lowering one token's reported logprob per 8-token sample by 0.5 nats (the denominator of the learner's
    importance ratio with engine logprobs) passed within the former 1.0 per-token bound; float32's bound
    rejects it, while the same samples reported honestly (vLLM's processed logprobs of the worker's logits,
    off the validator's by `rounding`) pass. (An honest bfloat16 token reached 0.45: a residual.)"""
    rng = np.random.default_rng(int(temperature * 10 + top_p * 100))
    for trial in range(6):
        validator = _logits(n=8, vocab=300, seed=100 + trial, spread=2.0)
        worker = validator + torch.from_numpy(rng.uniform(-rounding, rounding, validator.shape)).float()
        processed = _vllm_processed(worker, temperature, top_p)
        tokens = torch.multinomial(processed.exp(), 1, generator=torch.Generator().manual_seed(trial))[:, 0]
        honest = processed.gather(1, tokens[:, None])[:, 0].numpy()
        verdict = check_sampling(tokens.tolist(), honest, validator, temperature, top_p, dtype=dtype)
        assert verdict.passed, (trial, verdict.reasons)
        moved = honest.copy()
        moved[trial] -= 0.5
        verdict = check_sampling(tokens.tolist(), moved, validator, temperature, top_p, dtype=dtype)
        assert not verdict.passed and f"logprob of token {trial}" in verdict.reasons[0], (trial, verdict.reasons)
