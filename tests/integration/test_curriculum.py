"""The difficulty curriculum through the orchestrator (the in-process service on a fake clock, the Pool of
test_orchestrator_state): a version's level moves with the validators' solve rates, every assignment carries
its level, the worker's, the validator's and the orchestrator's draws agree, the levels survive a restart, and a
worker that answers another level's prompts (its own easier choice) is rejected by the fixed-data check."""

from __future__ import annotations

import pytest
from test_orchestrator_state import Pool

from bridge.assignment import assigned_sample_seeds, assigned_task_ids
from bridge.protocol import Verdict
from bridge.rollouts import FINISH_STOP
from gpu_workers.checks import AssignedWork, Sample, check_fixed_data

pytest.importorskip("reasoning_gym")

PER_LEVEL = 40
SETTINGS = {
    "data.task": "reasoning_gym",
    "data.generator": "chain_sum",
    "data.generator_config": "{min_terms = 2, max_terms = 2, min_digits = 2, max_digits = 2}",
    "data.curriculum": "[{max_digits = 1, min_digits = 1}, {max_digits = 2}, {max_terms = 3}]",
    "data.curriculum_window": 2,
    "data.curriculum_promote": 0.5,
    "data.curriculum_demote": 0.2,
    "data.num_tasks": PER_LEVEL,
    "orchestrator.num_tasks": 3 * PER_LEVEL,  # the service lists each assignment's task ids
    "data.prompts_per_step": 64,  # room in the async window for every batch here (nothing consumes them)
    "trainer.batch_size": 128,
}


def _judge(pool, worker, validator, name: str, rewards: list[float], accept: bool = True):
    [a] = worker.heartbeat().assignments
    pool.submit(worker, a, name)
    claimed = validator.claim().batch
    assert claimed.batch_id == name and claimed.assignment_level == a.level  # the validator learns the level
    if accept:
        verdict = Verdict(accepted=True, rewards=rewards, num_tokens=40)
    else:
        verdict = Verdict(accepted=False, failed_checks=["reward"], reason="wrong rewards", num_tokens=40)
    validator.verdict(name, verdict)
    return a


def _check_draws(a, key: str) -> None:
    """The orchestrator's listed task ids are the worker's own draw at the level, inside the level's slice."""
    mine = assigned_task_ids(key, a.version, a.k, 3 * PER_LEVEL, a.prompts, a.salt, a.level, 3)
    assert a.task_ids == mine
    assert all(a.level * PER_LEVEL <= t < (a.level + 1) * PER_LEVEL for t in mine)


def test_levels_move_with_the_validators_solve_rates_and_every_role_draws_the_same_prompts(tmp_path):
    pool = Pool(tmp_path, **SETTINGS)
    worker, validator = pool.node("worker"), pool.node("validator")
    n = 4  # samples per batch: 2 prompts x 2
    pool.admin.announce_policy(1)
    a = _judge(pool, worker, validator, "l0-a", [1.0, 1.0, 0.0, 1.0])
    assert a.level == 0
    _check_draws(a, worker.node_key)
    _judge(pool, worker, validator, "l0-rejected", [1.0] * n, accept=False)  # a rejection measures nothing
    pool.admin.announce_policy(2)  # one accepted batch of level 0: the window (2) is not full
    a = _judge(pool, worker, validator, "l0-b", [0.0, 1.0, 0.0, 0.0])
    assert a.level == 0
    pool.admin.announce_policy(3)  # level 0's last two: solve rates 0.75 and 0.25, mean 0.5 >= 0.5: up
    a = _judge(pool, worker, validator, "l1-a", [0.0] * n)
    assert a.level == 1 and a.version == 3
    _check_draws(a, worker.node_key)
    pool.admin.announce_policy(4)  # level 1 has one batch since it began (level 0's do not count)
    a = _judge(pool, worker, validator, "l1-b", [1.0, 0.0, 0.0, 0.0])
    assert a.level == 1
    pool.admin.announce_policy(5)  # solve rates 0 and 0.25: mean 0.125 < 0.2: down
    [a] = worker.heartbeat().assignments
    assert a.level == 0 and a.version == 5
    _check_draws(a, worker.node_key)
    pool.svc.close()

    again = Pool(tmp_path, **SETTINGS)  # the levels are the service's records: a restart keeps them
    assert again.svc.scheduler.levels == {1: 0, 2: 0, 3: 1, 4: 1, 5: 0}
    [same] = again.client(worker.key).heartbeat().assignments
    assert (same.id, same.level, same.task_ids) == (a.id, 0, a.task_ids)


def _samples(key, version, k, salt, level, prompts=2, group=2):
    tasks = assigned_task_ids(key, version, k, 3 * PER_LEVEL, prompts, salt, level, 3)
    seeds = assigned_sample_seeds(key, version, k, prompts * group, salt)
    return [
        Sample(
            prompt_tokens=[1, tasks[i // group], 7],
            completion_tokens=[4],
            logprobs=[-1.0],
            finish=FINISH_STOP,
            proofs=b"",
            seed=seeds[i],
            task_id=tasks[i // group],
            group_id=i // group,
        )
        for i in range(prompts * group)
    ]


def test_a_worker_that_answers_another_levels_prompts_is_rejected():
    key, salt = "0f" * 32, "cd" * 32
    assignment = AssignedWork(
        key,
        version=7,
        k=0,
        num_tasks=3 * PER_LEVEL,
        samples_per_prompt=2,
        prompt_tokens_of=lambda t, _target: [1, t, 7],
        num_samples=4,
        salt=salt,
        level=2,
        levels=3,
    )
    assert check_fixed_data(_samples(key, 7, 0, salt, level=2), assignment).passed
    # the same assignment answered on the easiest level's prompts (the draw a worker would pick if it chose)
    easy = check_fixed_data(_samples(key, 7, 0, salt, level=0), assignment)
    assert not easy.passed and "task ids the assignment does not give" in " ".join(easy.reasons)
    # a level this pool does not have (a record from another pool's service) is refused, never drawn from
    for level in (3, 70_000):
        wrong = check_fixed_data(
            _samples(key, 7, 0, salt, level=2), AssignedWork(**{**vars(assignment), "level": level})
        )
        assert not wrong.passed and "curriculum level" in wrong.reasons[0]


def test_a_schema_9_database_gains_the_levels_and_what_it_held_is_level_0(tmp_path):
    import sqlite3

    from orchestrator.db import SCHEMA_VERSION

    pool = Pool(tmp_path, **SETTINGS)
    worker, validator = pool.node("worker"), pool.node("validator")
    pool.admin.announce_policy(1)
    _judge(pool, worker, validator, "before", [1.0] * 4)
    pool.svc.close()
    conn = sqlite3.connect(tmp_path / "orchestrator.db")  # as schema 9 left it
    conn.execute("ALTER TABLE assignments DROP COLUMN level")
    conn.execute("ALTER TABLE policy DROP COLUMN curriculum_level")
    conn.execute("UPDATE schema_info SET version = 9")
    conn.commit()
    conn.close()
    again = Pool(tmp_path, **SETTINGS)
    with sqlite3.connect(tmp_path / "orchestrator.db") as conn:
        assert conn.execute("SELECT version FROM schema_info").fetchone() == (SCHEMA_VERSION,)
    assert again.svc.scheduler.levels == {1: 0}
    [before] = again.admin.all_batches("accepted")[0]
    assert before.batch_id == "before" and before.assignment_level == 0


class _Answer:
    """An engine that answers every prompt with "7" and the stop token."""

    def __init__(self, tok, stop_id: int):
        self.tok, self.stop_id = tok, stop_id

    def generate(self, prompts, seeds, *, max_tokens=16, **_):
        from types import SimpleNamespace

        import numpy as np

        tokens = self.tok.encode("7") + [self.stop_id]
        return [
            SimpleNamespace(
                prompt_tokens=list(p),
                tokens=tokens,
                logprobs=np.full(len(tokens), -0.5, np.float32),
                finish=0,
                proofs=[b""],
                full_logprobs=None,
            )
            for p in prompts
        ]


def test_a_worker_answers_its_assignments_level_and_refuses_a_level_its_pool_lacks(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    from bridge.protocol.messages import Assignment
    from bridge.shardcast.config import ShardcastConfig
    from gpu_workers.config import DataConfig, WorkerConfig
    from gpu_workers.worker import Worker
    from intellect.tasks_setup import training_tasks

    tok = AutoTokenizer.from_pretrained(tiny_model(family="qwen2"))
    data = DataConfig(
        task="reasoning_gym",
        generator="chain_sum",
        generator_config={"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2},
        curriculum=[{"min_digits": 1, "max_digits": 1}, {"min_digits": 1}, {}],
        num_tasks=PER_LEVEL,
        samples_per_prompt=2,
        max_new_tokens=16,
    )
    tasks = training_tasks(data)
    worker = Worker(
        WorkerConfig(max_tokens=16),
        data,
        ShardcastConfig(),
        tasks,
        key_path=tmp_path / "worker.key",
        weights_dir=tmp_path / "weights",
        outbox=tmp_path / "outbox",
    )
    worker.engine, worker.tokenizer = _Answer(tok, tok.convert_tokens_to_ids("<|im_end|>")), tok
    salt = "ef" * 32
    seeds = assigned_sample_seeds(worker.node_key, 4, 0, 6, salt)

    def assignment(level: int) -> Assignment:
        return Assignment(
            id=1,
            version=4,
            k=0,
            prompts=3,
            samples_per_prompt=2,
            task_ids=None,
            sample_seeds=seeds,
            salt=salt,
            level=level,
            issued_at=0.0,
        )

    arrays = worker.build(assignment(1)).arrays()
    want = assigned_task_ids(worker.node_key, 4, 0, 3 * PER_LEVEL, 3, salt, 1, 3)
    assert arrays["task_ids"].tolist() == [t for t in want for _ in range(2)]
    assert all(PER_LEVEL <= t < 2 * PER_LEVEL for t in want)  # level 1's slice: 1-2 digit sums
    with pytest.raises(RuntimeError, match="curriculum level 3 but this worker's \\[data\\] has 3 level"):
        worker.build(assignment(3))
    with pytest.raises(ValueError):  # the message itself bounds a level
        assignment(1 << 20)
