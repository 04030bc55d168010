"""The task sets every role derives from `[data]`: held-out prompts never seen in training, file splits, errors."""

import json

import pytest

from intellect.config import ConfigError, DataConfig
from intellect.tasks_setup import heldout_tasks, training_tasks


def test_synthetic_heldout_tasks_are_disjoint_from_training_and_deterministic():
    data = DataConfig(task="sort", digits=4, num_tasks=300, eval_tasks=50)
    train, held = training_tasks(data), heldout_tasks(data)
    assert len(train) == 300 and len(held) == 50
    assert not {t.prompt for t in train} & {t.prompt for t in held}
    assert len({t.prompt for t in held}) == 50
    assert [t.prompt for t in heldout_tasks(data)] == [t.prompt for t in held]
    for t in held:  # answers are right, checked independently of the generator
        digits = t.prompt.split(":")[1].split()
        assert t.answer == " ".join(sorted(digits))


def test_a_task_space_too_small_for_a_heldout_set_is_a_clear_error():
    with pytest.raises(ConfigError, match="data.eval_tasks"):
        heldout_tasks(DataConfig(task="sort", digits=1, num_tasks=100, eval_tasks=20))  # only 10 prompts exist


def test_unknown_task_without_a_file_names_the_families():
    with pytest.raises(ConfigError, match="arithmetic, reverse, sort"):
        training_tasks(DataConfig(task="gsm8k"))


def test_file_tasks_hold_out_their_last_rows_and_apply_the_solve_rate_filter(tmp_path):
    path = tmp_path / "tasks.jsonl"
    rows = [{"prompt": f"q{i}", "answer": str(i), "solve_rate": 0.05 if i == 3 else 0.5} for i in range(10)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    data = DataConfig(task="math", path=str(path), eval_tasks=2)
    assert [t.prompt for t in training_tasks(data)] == ["q0", "q1", "q2", "q4", "q5", "q6", "q7"]
    assert [t.prompt for t in heldout_tasks(data)] == ["q8", "q9"]
    with pytest.raises(ConfigError, match="eval_tasks"):
        training_tasks(DataConfig(task="math", path=str(path), eval_tasks=9))


def test_a_curriculums_training_list_is_its_levels_in_order_and_held_out_tasks_are_the_target_difficulty():
    pytest.importorskip("reasoning_gym")
    import reasoning_gym

    base = {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2}
    levels = [{"min_digits": 1, "max_digits": 1}, {}, {"max_terms": 3}]
    data = DataConfig(
        task="reasoning_gym",
        generator="chain_sum",
        generator_config=base,
        curriculum=levels,
        num_tasks=30,
        eval_tasks=20,
    )
    tasks = training_tasks(data)
    assert len(tasks) == 90
    for i, level in enumerate(levels):  # slice i: reasoning-gym's own entries at the level's settings
        config = {**base, **level}
        entries = reasoning_gym.create_dataset("chain_sum", size=30, seed=data.task_seed + i * 7_919, **config)
        assert [t.prompt for t in tasks[30 * i : 30 * (i + 1)]] == [e["question"] for e in entries]
        assert [t.answer for t in tasks[30 * i : 30 * (i + 1)]] == [e["answer"] for e in entries]
    assert all(t.meta["entry"]["metadata"]["num_digits"] == 1 for t in tasks[:30])
    assert any(t.meta["entry"]["metadata"]["num_terms"] == 3 for t in tasks[60:])
    held = heldout_tasks(data)
    assert not {t.prompt for t in held} & {t.prompt for t in tasks}
    assert all(t.meta["entry"]["metadata"]["num_digits"] == 2 for t in held)  # data.generator_config's
    with pytest.raises(ValueError, match=r"data.curriculum\[1\]"):
        DataConfig(task="reasoning_gym", generator="chain_sum", curriculum=[{}, {"no_such_field": 1}])
    with pytest.raises(ValueError, match="data.curriculum sets levels"):
        DataConfig(task="sort", curriculum=[{}, {}])
