"""The validator's checks on multi-turn episodes (`gpu_workers.episode_checks.validate_episode_batch`) with a tiny
random model: honest episodes pass every check (float32 and bfloat16); the attacks that keep the environment's
side consistent (a re-tokenized turn, a model token swapped, a token's label flipped, a forged environment turn,
a claimed reward) are each rejected by a check that owns them (the environment's side by `episode`, the model's
tokens by `replay` or `sampling`, the reward by `reward`).

The honest "worker" here samples turn by turn with the replayable sampler (`gpu_workers.replay.noisy_max` at
each turn's seed and in-turn position) on the model's logits, appending token ids to the sequence, and proves the
hidden states behind its sampled tokens; it is written from the documented protocol, not from the worker's code.
"""

from __future__ import annotations

import math
import types

import numpy as np
import pytest

from bridge.rollouts import FINISH_LENGTH, FINISH_STOP
from gpu_workers.checks import Declared, Sample
from gpu_workers.envs import EnvTurn, EpisodeLimits, get_environment
from gpu_workers.envs.episode import Protocol, judge, model_turns, play
from gpu_workers.episode_checks import validate_episode_batch
from gpu_workers.tasks.dataset import Task

TEMPERATURE = 1.0


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def protocol_for(tokenizer) -> Protocol:
    """The guess environment; a quarter of the vocabulary stops a turn, so a random model's turns are short."""
    stops = [int(tokenizer.convert_tokens_to_ids("<|im_end|>"))] + list(range(400, 512))
    limits = EpisodeLimits(max_turns=3, max_turn_tokens=8, max_env_tokens=64, max_total_tokens=160)
    return Protocol.for_tokenizer(get_environment("guess", {"high": 8}), tokenizer, limits, stops)


def honest_worker(prefill, protocol: Protocol):
    """`generate` for `play`: the replayable sampler on the model's logits (full prefill per token)."""
    import torch

    from gpu_workers.replay import noisy_max

    def generate(prompts, seeds, caps):
        outs = []
        for prompt, seed, cap in zip(prompts, seeds, caps):
            seq, tokens, logprobs = list(prompt), [], []
            for pos in range(cap):
                logits = prefill.run_positions([(seq + [0], [len(seq)])])[0].logits[0].float()
                z = logits / TEMPERATURE
                choice, _ = noisy_max(z[None], [int(seed)], [pos])
                t = int(choice[0])
                logprobs.append(float(torch.log_softmax(z, -1)[t]))
                seq.append(t)
                tokens.append(t)
                if t in protocol.stop_token_ids:
                    break
            finish = FINISH_STOP if tokens[-1] in protocol.stop_token_ids else FINISH_LENGTH
            outs.append(
                types.SimpleNamespace(tokens=tokens, logprobs=logprobs, full_logprobs=None, finish=finish, hidden=None)
            )
        return outs

    return generate


def to_sample(prefill, rollout, seed: int, task_id: int) -> Sample:
    """The batch sample of a played episode, with TOPLOC proofs of the states behind its sampled tokens."""
    import torch

    from gpu_workers.toploc import build_proofs

    positions = np.flatnonzero(np.array(rollout.sampled))
    hidden = prefill.run_positions([(rollout.tokens, positions)])[0].hidden
    p = rollout.prompt_len
    return Sample(
        prompt_tokens=np.array(rollout.tokens[:p]),
        completion_tokens=np.array(rollout.tokens[p:]),
        logprobs=np.array(rollout.logprobs[p:], np.float32),
        finish=rollout.finish,
        proofs=b"".join(build_proofs(hidden.to(torch.bfloat16))),
        seed=seed,
        task_id=task_id,
        reward=rollout.reward,
        sampled=np.array(rollout.sampled[p:], np.uint8),
    )


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def played(request, model_dir, tokenizer):
    from gpu_workers.prefill import Prefill

    prefill = Prefill(model_dir, dtype=request.param)
    protocol = protocol_for(tokenizer)
    tasks = [Task(prompt=p, reward="exact") for p in "abcdefgh"]
    seeds = [1000 + 17 * i for i in range(len(tasks))]
    rollouts = play(protocol, tasks, seeds, honest_worker(prefill, protocol))
    samples = [to_sample(prefill, r, s, i) for i, (r, s) in enumerate(zip(rollouts, seeds))]
    declared = Declared(
        temperature=TEMPERATURE, top_p=1.0, max_tokens=8, stop_token_ids=protocol.stop_token_ids, dtype=request.param
    )
    return types.SimpleNamespace(
        prefill=prefill, protocol=protocol, tasks=tasks, rollouts=rollouts, samples=samples, declared=declared
    )


def validate(played, samples):
    def rerun(s: Sample):
        tokens = np.concatenate([s.prompt_tokens, s.completion_tokens])
        mask = np.concatenate([np.zeros(len(s.prompt_tokens), np.uint8), s.sampled])
        return judge(played.protocol, played.tasks[s.task_id], s.seed, tokens, mask, len(s.prompt_tokens), s.finish)

    return validate_episode_batch(samples, played.prefill, played.declared, None, rerun)


def failed(verdict, i: int) -> set[str]:
    """The checks that ran on sample i and failed it."""
    return {c.check for c in verdict.samples[i].verdicts if not c.passed and c.ran}


def test_honest_episodes_pass_every_check(played):
    assert max(r.turns for r in played.rollouts) >= 2  # multi-turn episodes, with environment tokens
    assert sum(len(r.tokens) - sum(r.sampled) - r.prompt_len for r in played.rollouts) > 20
    verdict = validate(played, played.samples)
    for i in range(len(played.samples)):
        assert failed(verdict, i) == set(), [c for c in verdict.samples[i].verdicts if not c.passed]
        names = {c.check for c in verdict.samples[i].verdicts}
        assert names == {"episode", "computation", "sampling", "replay", "reward"}
    # the logprobs the validator writes beside an accepted batch (bridge.validator_logprobs): one per completion
    # token, 0 at the environment's, and at the model's close to what the worker's engine reported
    assert verdict.accepted and len(verdict.logprobs) == len(played.samples)
    for s, values in zip(played.samples, verdict.logprobs):
        sampled = s.sampled.astype(bool)
        assert values.shape == (len(s.completion_tokens),) and np.all(values[~sampled] == 0)
        assert np.all(values[sampled] <= 0) and np.max(np.abs(values[sampled] - s.logprobs[sampled])) < 0.5


def _target(played, tokenizer) -> tuple[int, int, int]:
    """(sample, start, end in its completion) of a first model turn followed by an environment turn, whose text
    holds no digit (the guess environment answers any such turn alike) and no special token."""
    for i, r in enumerate(played.rollouts):
        s = played.samples[i]
        turns = [(a - 1, b - 1) for a, b in model_turns(np.r_[0, s.sampled], 1)]
        if len(turns) < 2:
            continue
        a, b = turns[0]
        body = [int(t) for t in s.completion_tokens[a : b - 1]]
        if body and not any(ch.isdigit() for ch in tokenizer.decode(body)) and min(body) > 2:
            return i, a, b
    pytest.fail("no multi-turn episode with a digit-free first turn: change the seeds")


def _edit(sample: Sample, completion, sampled, logprobs, **changes) -> Sample:
    return Sample(
        prompt_tokens=sample.prompt_tokens,
        completion_tokens=np.array(completion),
        logprobs=np.array(logprobs, np.float32),
        finish=changes.get("finish", sample.finish),
        proofs=sample.proofs,
        seed=sample.seed,
        task_id=sample.task_id,
        reward=changes.get("reward", sample.reward),
        sampled=np.array(sampled, np.uint8),
    )


def test_attacks_are_rejected_by_the_check_that_owns_them(played, tokenizer):
    i, a, b = _target(played, tokenizer)
    s = played.samples[i]
    comp, mask, lp = [int(t) for t in s.completion_tokens], list(s.sampled), list(s.logprobs)
    stops = played.protocol.stop_token_ids
    end = next(j for j in range(b, len(mask)) if mask[j] == 1)  # the environment turn is comp[b:end]
    attacks = {}

    # a model token swapped for another that keeps the turn digit-free: the environment's side stays right
    swapped = list(comp)
    swapped[a] = next(
        t
        for t in range(3, 400)
        if t != comp[a] and t not in stops and not any(c.isdigit() for c in tokenizer.decode([t]))
    )
    attacks["model token swapped"] = (_edit(s, swapped, mask, lp), {"replay", "sampling"})

    # the turn re-tokenized: the same text, other token ids (what a worker re-rendering earlier turns trains on)
    body = comp[a : b - 1]
    text = tokenizer.decode(body)
    again = [int(t) for ch in text for t in tokenizer.encode(ch, add_special_tokens=False)]
    if again != body and tokenizer.decode(again) == text and len(again) + 1 <= played.protocol.limits.max_turn_tokens:
        new = comp[:a] + again + comp[b - 1 :]
        new_mask = mask[:a] + [1] * len(again) + mask[b - 1 :]
        new_lp = lp[:a] + [-1.0] * len(again) + lp[b - 1 :]
        attacks["turn re-tokenized"] = (_edit(s, new, new_mask, new_lp), {"replay", "sampling"})

    # labels flipped: the turn's stop token claimed by the environment; the environment's last token claimed
    hidden, hidden_lp = list(mask), list(lp)
    hidden[b - 1], hidden_lp[b - 1] = 0, 0.0
    attacks["sampled token labelled environment"] = (_edit(s, comp, hidden, hidden_lp), {"episode"})
    claimed, claimed_lp = list(mask), list(lp)
    claimed[end - 1], claimed_lp[end - 1] = 1, -2.0
    attacks["environment token labelled sampled"] = (_edit(s, comp, claimed, claimed_lp), {"episode"})

    # a forged environment turn: the environment "said" something else
    forged = played.protocol.renderer.env_tokens([EnvTurn("Too low. The answer is 3.")], comp[b - 1])
    attacks["forged environment turn"] = (
        _edit(
            s,
            comp[:b] + forged + comp[end:],
            mask[:b] + [0] * len(forged) + mask[end:],
            lp[:b] + [0.0] * len(forged) + lp[end:],
        ),
        {"episode"},
    )
    attacks["reward claimed"] = (_edit(s, comp, mask, lp, reward=s.reward + 1.0), {"reward"})

    for name, (evil, owners) in attacks.items():
        batch = list(played.samples)
        batch[i] = evil
        verdict = validate(played, batch)
        got = failed(verdict, i)
        assert got & owners, (name, got, [c.reasons for c in verdict.samples[i].verdicts if not c.passed])
        assert got <= owners | {"computation", "sampling"}, (name, got)
        assert all(not failed(verdict, j) for j in range(len(batch)) if j != i), name  # the honest ones still pass
    assert math.isfinite(s.reward)
