"""Length targets from task to reward: the target drawn for a group, stated in its prompt, carried in the batch,
priced by INTELLECT-2's length reward on the worker and again by the validator's checks, and measured per
target by the held-out evaluation. The engine is a stand-in that writes the sort answer on a seed-chosen number
of lines (the format of configs/length_targets.toml); everything else is the real code."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from gpu_workers.rewards import length_reward, sample_reward
from gpu_workers.tasks import Task, synthetic_tasks

TARGETS = (6, 12, 18)
PENALTY = 0.05


def reference_reward(right: bool, n: int, target: int, alpha: float, mode: str, delta: float = 0.5) -> float:
    """INTELLECT-2's length reward written out from the paper's definitions (not from gpu_workers)."""
    r = 1.0 if right else 0.0
    if target == 0:
        return r
    return {
        "exact": r - alpha * abs(target - n),
        "max": r - alpha * np.maximum(n - target, 0),
        "clip": r * np.clip(alpha * (target - n) + delta, 0.0, 1.0),
    }[mode]


@pytest.mark.parametrize("mode", ["exact", "max", "clip"])
def test_sample_reward_is_the_task_reward_shaped_by_the_length_formula(mode):
    task = Task(prompt="Sort the digits in ascending order: 3 1 2", reward="exact", answer="1 2 3")
    rng = np.random.default_rng(35)
    for _ in range(200):
        right, n, target = bool(rng.integers(2)), int(rng.integers(1, 60)), int(rng.choice([0, 6, 12, 18, 40]))
        alpha = float(rng.choice([0.0, 0.01, 0.05, 0.3]))
        text = "3 1 2\n1 2 3" if right else "1 2 3\n3 2 1"  # the last line decides
        got = sample_reward(task, text, n, target, alpha, mode).value
        want = reference_reward(right, n, target, alpha, mode) if alpha else float(right)
        assert got == pytest.approx(want, abs=1e-12), (right, n, target, alpha)
        assert length_reward(float(right), n, target, alpha, mode) == pytest.approx(want, abs=1e-12)


class LinesEngine:
    """Answers every prompt with the sort answer on 1-4 lines (chosen by the seed); every 5th seed is wrong."""

    def __init__(self, tokenizer, tasks, stop_id: int):
        self.tok, self.stop_id = tokenizer, stop_id
        self.answers = {tuple(self._prompt_digits(t)): t.answer for t in tasks}
        self.prompts: list[list[int]] = []

    @staticmethod
    def _prompt_digits(task) -> list[str]:
        return task.prompt.split(": ")[1].split()

    def generate(self, prompts, seeds, *, temperature=1.0, top_p=1.0, max_tokens=24, **_):
        outs = []
        for prompt, seed in zip(prompts, seeds):
            self.prompts.append(list(prompt))
            text = self.tok.decode(prompt, skip_special_tokens=True)
            digits = text.split("ascending order: ")[1].split("\n")[0].split()
            answer = self.answers[tuple(digits)]
            line = answer if seed % 5 else answer[:-1] + str((int(answer[-1]) + 1) % 10)
            tokens = self.tok.encode("\n".join([line] * (1 + seed % 4)))[: max_tokens - 1] + [self.stop_id]
            outs.append(
                SimpleNamespace(
                    prompt_tokens=list(prompt),
                    tokens=tokens,
                    logprobs=np.full(len(tokens), -0.5, np.float32),
                    finish=0,
                    proofs=[b""],
                    full_logprobs=None,
                )
            )
        return outs


def test_a_groups_target_reaches_prompt_batch_reward_and_the_validators_checks(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    from bridge.assignment import assigned_sample_seeds, assigned_task_ids
    from bridge.protocol.messages import Assignment
    from bridge.shardcast.config import ShardcastConfig
    from gpu_workers.checks import AssignedWork, check_fixed_data, check_reward, samples_from_arrays
    from gpu_workers.config import DataConfig, WorkerConfig
    from gpu_workers.tasks import prompt_tokens
    from gpu_workers.worker import Worker

    tok = AutoTokenizer.from_pretrained(tiny_model(family="qwen2"))
    tasks = synthetic_tasks("sort", 50, digits=3)
    data = DataConfig(
        task="sort",
        digits=3,
        samples_per_prompt=4,
        max_new_tokens=24,
        length_targets=list(TARGETS),
        length_penalty=PENALTY,
    )
    worker = Worker(
        WorkerConfig(max_tokens=24),
        data,
        ShardcastConfig(),
        tasks,
        key_path=tmp_path / "worker.key",
        weights_dir=tmp_path / "weights",
        outbox=tmp_path / "outbox",
    )
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    worker.engine, worker.tokenizer = LinesEngine(tok, tasks, stop), tok
    seeds = assigned_sample_seeds(worker.node_key, 3, 1, 6 * 4)
    a = Assignment(
        id=1, version=3, k=1, prompts=6, samples_per_prompt=4, task_ids=None, sample_seeds=seeds, issued_at=0.0
    )
    batch = worker.build(a)
    arrays = batch.arrays()

    task_ids = assigned_task_ids(worker.node_key, 3, 1, len(tasks), 6)
    drawn = [TARGETS[seeds[g * 4] % len(TARGETS)] for g in range(6)]  # each group's draw, from its first seed
    assert len(set(drawn)) > 1, "the seeds should give the groups different targets"
    np.testing.assert_array_equal(arrays["target_lens"], np.repeat(drawn, 4))
    for i, prompt in enumerate(worker.engine.prompts):
        text = tok.decode(prompt)
        assert f"Think for {drawn[i // 4]} tokens before giving a response.<|im_end|>" in text
        assert text.startswith(f"<|im_start|>user\n{tasks[task_ids[i // 4]].prompt}\n\n")
    lengths = np.diff(arrays["offsets"]) - arrays["prompt_lens"]
    for i, (n, seed) in enumerate(zip(lengths, seeds)):
        assert n == 6 * (1 + seed % 4)  # 3 digits, 2 spaces and a newline or the stop token per line
        want = reference_reward(seed % 5 != 0, int(n), drawn[i // 4], PENALTY, "exact")
        assert arrays["rewards"][i] == pytest.approx(want, abs=1e-6)

    samples = samples_from_arrays(arrays)
    assigned = AssignedWork(
        node_key=worker.node_key,
        version=3,
        k=1,
        num_tasks=len(tasks),
        samples_per_prompt=4,
        prompt_tokens_of=lambda tid, target: prompt_tokens(tasks[tid], tok, target),
        length_targets=TARGETS,
        num_samples=24,
    )
    assert check_fixed_data(samples, assigned).passed

    def validator_reward(s):  # what the validator recomputes (gpu_workers/validator.py)
        text = tok.decode(s.completion_tokens.tolist(), skip_special_tokens=True)
        return sample_reward(tasks[s.task_id], text, len(s.completion_tokens), s.target_len, PENALTY).value

    assert all(check_reward(s, validator_reward).passed for s in samples)
    cheat = samples[0].__class__(**{**samples[0].__dict__, "reward": float(samples[0].reward) + 0.3})
    assert not check_reward(cheat, validator_reward).passed  # a reward that ignores its length is caught


def test_evaluation_measures_each_target_on_every_task(tiny_model):
    from transformers import AutoTokenizer

    from gpu_workers.evaluate import evaluate

    tok = AutoTokenizer.from_pretrained(tiny_model(family="qwen2"))
    tasks = synthetic_tasks("sort", 7, digits=3, seed=4)
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    engine = LinesEngine(tok, tasks, stop)
    result = evaluate(engine, tasks, tok, max_tokens=24, stop_token_ids=[stop], length_targets=[12, 6, 12, 18])
    assert list(result.by_target) == [12, 6, 18]  # each distinct target once, in the configured order
    # generation j of the evaluation has seed j: task i, target position p -> seed 3 i + p
    for p, target in enumerate([12, 6, 18]):
        seeds = [3 * i + p for i in range(len(tasks))]
        lengths = np.array([6 * (1 + s % 4) for s in seeds])
        m = result.by_target[target]
        assert m["abs_err"] == pytest.approx(np.abs(lengths - target).mean())
        assert m["mean_len"] == pytest.approx(lengths.mean())
        assert m["accuracy"] == pytest.approx(np.mean([s % 5 != 0 for s in seeds]))
        prompts = engine.prompts[p::3]
        assert all(f"Think for {target} tokens" in tok.decode(q) for q in prompts)
    summary = result.summary()
    assert summary["length_abs_err"] == pytest.approx(np.mean([m["abs_err"] for m in result.by_target.values()]))
    assert {k for k in summary if "/" in k} == {
        f"{name}/{t}" for name, t in itertools.product(("length_abs_err", "length_mean", "accuracy"), (6, 12, 18))
    }
    plain = evaluate(engine, tasks, tok, max_tokens=24, stop_token_ids=[stop])
    assert plain.by_target == {} and "length_abs_err" not in plain.summary() and plain.correct.shape == (7, 1)
