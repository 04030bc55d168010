"""Issue 49: a near-tie choice trains nothing.

The attack: in bfloat16 the validator must accept, at each position, a token whose seeded noisy score is within
the engines' rounding of the seed's choice (a near tie), for an honest worker's engine may have rounded it on
top. A worker that sees the validator's logits picks, among such near ties, the token that serves it (on a
real model in bfloat16 that bought +0.09 reward per sample on syllogisms, every batch accepted, no ledger
strike: benchmarks/RESULTS.md). Here it takes, in one wrong sample of each group, the runner-up at its closest
near tie and decodes on with the seed, and claims that sample right (reward 1).

The defence: the validator's verdict names every sample whose replay took a near tie (`near_tie_samples`), and
the learner trains none of them (`[loss] near_tie_samples = "drop"`, the default). The check: the cheater's
batch is accepted and names exactly the chosen samples, and one step on it gives, bit for bit, the weights of
one step on the honest batch without those samples; with "train" the chosen samples move the step.

The batches: a tiny Qwen2 policy, an honest worker made of the validator's own bfloat16 prefill (each token the
assigned seed's Gumbel-max choice, `gpu_workers.replay`), judged by `validate_batch` as `intellect validator`
judges them; the learner's step is `GRPOTrainer`'s, fed by `RolloutPipeline` from the store.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from test_logprob_shift import GROUP, MAX_TOKENS, PROMPTS, _decode, _Listing, store_judged
from transformers import AutoTokenizer

from bridge.protocol import Verdict
from bridge.rollouts import RolloutStore
from gpu_workers.checks import Declared, Sample, stop_token_ids, validate_batch
from gpu_workers.prefill import Prefill
from gpu_workers.replay import noise_at, noisy_max
from gpu_workers.tasks import prompt_tokens, synthetic_tasks
from gpu_workers.toploc import build_proofs
from jax_trainer.config import LossConfig, OptimConfig, TrainerConfig
from jax_trainer.data import AcceptedBatch, RolloutPipeline
from jax_trainer.models import load_hf
from jax_trainer.sharding import make_mesh
from jax_trainer.train_step import GRPOTrainer

HONEST_REWARDS = [1.0, 0.0, 0.0, 0.0] * PROMPTS


def _noisy(logits: torch.Tensor, seed: int, position: int) -> torch.Tensor:
    """Every token's noisy score at `position` (T 1, top-p 1): what the replayable sampler maximises."""
    ids = torch.arange(logits.shape[-1])
    return logits.float() + noise_at([seed] * len(ids), [position] * len(ids), ids).float()


def _near_tie_choice(prefill, prompt, tokens, seed, stops) -> tuple[list[int], float]:
    """The completion that takes the runner-up at the position where it is closest to the seed's choice (by the
    validator's logits, as a worker that sees them finds it) and decodes on with the seed; and that gap."""
    (result,) = prefill.run([(prompt, tokens)])
    gaps = []
    for j in range(len(tokens)):
        top2 = torch.topk(_noisy(result.logits[j], seed, j), 2)
        gaps.append((float(top2.values[0] - top2.values[1]), j, int(top2.indices[1])))
    gap, j, runner_up = min(gaps)
    chosen = list(tokens[:j]) + [runner_up]
    while chosen[-1] not in stops and len(chosen) < MAX_TOKENS:
        (row,) = prefill.run([(prompt, chosen + [0])])
        chosen.append(int(noisy_max(row.logits[-1:].float(), [seed], [len(chosen)])[0][0]))
    return chosen, gap


@pytest.fixture(scope="module")
def judged(tiny_model):
    """(the model dir, the store, the chosen samples, {name: (verdict, record)}) for the honest and the cheater's
    batch (one step each: same prompts and seeds)."""
    model = tiny_model("qwen2")
    tokenizer = AutoTokenizer.from_pretrained(model)
    prefill = Prefill(model, dtype="bfloat16")
    stops = stop_token_ids(model)
    tasks = synthetic_tasks("sort", PROMPTS, seed=3, digits=3)
    prompts = [prompt_tokens(tasks[i // GROUP], tokenizer) for i in range(PROMPTS * GROUP)]
    seeds = [2000 + i for i in range(len(prompts))]
    honest = _decode(prefill, prompts, seeds, stops)
    # in each group, the wrong sample whose closest near tie is the cheapest to take (priced by its gap)
    chosen_of = {}
    for g in range(PROMPTS):
        options = []
        for i in range(g * GROUP, (g + 1) * GROUP):
            if HONEST_REWARDS[i] == 0.0:
                tokens, gap = _near_tie_choice(prefill, prompts[i], honest[i], seeds[i], stops)
                if tokens != honest[i]:
                    options.append((gap, i, tokens))
        gap, i, tokens = min(options)
        assert gap < 0.5, gap  # a near tie: far inside the bfloat16 replay margin (1.5 logits at T 1)
        chosen_of[i] = tokens
    cheat = [chosen_of.get(i, t) for i, t in enumerate(honest)]
    cheat_rewards = [1.0 if i in chosen_of else r for i, r in enumerate(HONEST_REWARDS)]  # it claims them right
    declared = Declared(temperature=1.0, top_p=1.0, max_tokens=MAX_TOKENS, stop_token_ids=stops, dtype="bfloat16")
    store = RolloutStore.open("memory://")
    out = {}
    for name, completions, rewards in (("honest", honest, HONEST_REWARDS), ("cheat", cheat, cheat_rewards)):
        results = prefill.run(list(zip(prompts, completions)))
        samples = []
        for prompt, tokens, result, seed, reward in zip(prompts, completions, results, seeds, rewards):
            lp = torch.log_softmax(result.logits.float(), -1)[torch.arange(len(tokens)), torch.tensor(tokens)]
            samples.append(
                Sample(
                    prompt_tokens=prompt,
                    completion_tokens=tokens,
                    logprobs=lp.numpy(),
                    finish=0 if tokens[-1] in stops else 1,
                    proofs=b"".join(build_proofs(result.hidden.to(torch.bfloat16))),
                    seed=seed,
                    reward=reward,
                )
            )
        verdict = validate_batch(samples, prefill, declared)
        sha, logprobs_sha = store_judged(store, name, samples, seeds, rewards, verdict)
        # what the orchestrator keeps and lists to the learner: the verdict as the validator posts it
        posted = Verdict(
            accepted=verdict.accepted,
            rewards=rewards,
            num_tokens=sum(len(x.prompt_tokens) + len(x.completion_tokens) for x in samples),
            near_tie_samples=verdict.near_tie_samples(),
            logprobs_sha256=logprobs_sha,
        )
        record = AcceptedBatch(
            name,
            0,
            np.asarray(rewards, np.float32),
            sha,
            logprobs_sha256=logprobs_sha,
            near_tie_samples=tuple(posted.near_tie_samples),
        )
        out[name] = (verdict, record)
    return model, store, sorted(chosen_of), out


def test_the_cheater_s_batch_is_accepted_and_its_verdict_names_the_chosen_samples(judged):
    _, _, chosen, out = judged
    honest, cheat = out["honest"][0], out["cheat"][0]
    assert honest.accepted and cheat.accepted, (honest.reasons(), cheat.reasons())  # the choice is within rounding
    assert honest.near_tie_samples() == []  # the honest worker is the validator's own prefill: no near tie
    assert cheat.near_tie_samples() == chosen
    for i in chosen:
        assert 0 < cheat.samples[i].numbers("replay")["near_tie_cost"] < 1


def test_hostile_near_tie_samples_in_a_verdict_are_refused():
    with pytest.raises(ValueError, match="increasing"):
        Verdict(accepted=True, rewards=[1.0] * 4, num_tokens=4, near_tie_samples=[2, 1])
    with pytest.raises(ValueError, match="increasing"):
        Verdict(accepted=True, rewards=[1.0] * 4, num_tokens=4, near_tie_samples=[1, 1])
    with pytest.raises(ValueError, match="index 4 for 4"):
        Verdict(accepted=True, rewards=[1.0] * 4, num_tokens=4, near_tie_samples=[0, 4])
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        Verdict(accepted=True, rewards=[1.0] * 4, num_tokens=4, near_tie_samples=[-1])


def test_a_near_tie_choice_trains_nothing_unless_the_pool_trains_near_tie_samples(judged):
    model_dir, store, chosen, out = judged
    mesh = make_mesh(fsdp=1, devices=jax.devices()[:1])
    model = load_hf(model_dir, mesh=mesh, param_dtype="float32", compute_dtype="float32")
    params = nnx.split(model)[1]
    trainer = GRPOTrainer(
        model,
        mesh,
        LossConfig(logprob_source="validator", temperature=1.0),
        OptimConfig(lr=1e-2, warmup_steps=0, grad_clip=1e3),
        TrainerConfig(),
    )

    def train(record: AcceptedBatch, near_tie_samples: str):
        with RolloutPipeline(
            store,
            _Listing(record),
            samples_per_step=PROMPTS * GROUP,
            rows=8,
            seq_len=64,
            engine_logprobs="validator",
            near_tie_samples=near_tie_samples,
        ) as pipe:
            step = pipe.next(0, timeout=30)
        state = trainer.init_state(jax.tree.map(lambda x: x.copy(), params))  # the step donates its state
        state, _ = trainer.step(state, trainer.device_batch(step.packed))
        return step.stats, [np.asarray(x) for x in jax.tree.leaves(state.params)]

    cheat = out["cheat"][1]
    # the reference: the honest batch with the same samples left out (what the cheater's batch holds besides them)
    honest_without = dataclasses.replace(out["honest"][1], near_tie_samples=tuple(chosen))
    stats, dropped = train(cheat, "drop")
    assert stats["near_tie_samples_dropped"] == len(chosen) and stats["samples"] == PROMPTS * GROUP - len(chosen)
    _, reference = train(honest_without, "drop")
    assert all(np.array_equal(a, b) for a, b in zip(dropped, reference))  # bit for bit: the choice trained nothing
    _, trained = train(cheat, "train")
    assert not all(np.array_equal(a, b) for a, b in zip(trained, reference))  # trained, the choice moves the step
