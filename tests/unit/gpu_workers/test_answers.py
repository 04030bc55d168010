"""What an evaluation reports beside pass@1: the answer format rule per reward, the best constant answer of a
task set, and both in `gpu_workers.evaluate`'s result."""

from __future__ import annotations

import collections
from types import SimpleNamespace

import numpy as np
import pytest

from gpu_workers.rewards.answers import answer_in_format, best_constant
from gpu_workers.tasks import Task

rg = pytest.importorskip("reasoning_gym")

from gpu_workers.tasks.rgym import reasoning_gym_tasks  # noqa: E402


def test_the_format_rule_of_each_reward():
    syllogism = next(t for t in reasoning_gym_tasks("syllogism", 5, seed=0))
    assert answer_in_format(syllogism, "Yes") and answer_in_format(syllogism, "No.")
    assert answer_in_format(syllogism, "Let me think.\n\nAnswer: Yes")
    assert answer_in_format(syllogism, "I reason a lot. <answer>It does not follow</answer>")  # a tag is the format
    assert not answer_in_format(syllogism, "The conclusion follows from statement 2.")
    assert not answer_in_format(syllogism, "")

    counting = next(t for t in reasoning_gym_tasks("letter_counting", 5, seed=0))
    assert answer_in_format(counting, 'The letter "s" appears 3 times.')
    assert not answer_in_format(counting, "I cannot count letters.")

    exact = Task("Reverse: abc", "exact", answer="cba")
    assert answer_in_format(exact, "cba") and answer_in_format(exact, "Answer: zzz")
    assert not answer_in_format(exact, "The reverse is cba")
    number = Task("2 + 2 = ?", "exact", answer="4")
    assert answer_in_format(number, "5") and not answer_in_format(number, "four")

    math = Task("What is 6 x 7?", "math", answer="42")
    assert answer_in_format(math, "The answer is $\\boxed{41}$.")
    assert not answer_in_format(math, "I do not know.")

    assert answer_in_format(Task("write code", "code", tests=[{"input": "", "output": "1"}]), "print(1)") is None
    assert answer_in_format(Task("?", "exact", answer=None), "x") is None


def test_the_best_constant_answer_is_the_most_frequent_reference_scored_by_the_tasks_rewards():
    tasks = reasoning_gym_tasks("syllogism", 120, seed=3)
    counts = collections.Counter(t.answer for t in tasks)
    top, n = counts.most_common(1)[0]
    constant = best_constant(tasks)
    assert constant.answer == top
    assert constant.frequency == pytest.approx(n / len(tasks))
    # syllogism's scorer gives 1 to the reference only, so the constant scores exactly its frequency
    assert constant.accuracy == pytest.approx(n / len(tasks))
    assert 0.5 < constant.accuracy < 1.0

    numbers = reasoning_gym_tasks("letter_counting", 60, seed=5)
    counted = collections.Counter(t.answer for t in numbers)
    constant = best_constant(numbers)
    assert constant.accuracy == pytest.approx(max(counted.values()) / len(numbers))


def test_candidates_are_scored_by_the_reward_not_counted():
    # math-verify reads 1/2, 0.5 and \\frac{1}{2} as one number: "3" is the most frequent reference (3 tasks),
    # but each way of writing a half, answered as a constant, is right on all 4 tasks that want a half
    tasks = [Task(f"q{i}", "math", answer="3") for i in range(3)]
    tasks += [Task(f"r{i}", "math", answer=a) for i, a in enumerate(["1/2", "1/2", "0.5", "\\frac{1}{2}"])]
    constant = best_constant(tasks)
    assert constant.answer == "1/2" and constant.frequency == pytest.approx(2 / 7)
    assert constant.accuracy == pytest.approx(4 / 7)
    assert best_constant([Task("p", "code", tests=[])]) is None
    assert best_constant([]) is None


class _Scripted:
    """An engine that answers task i with the i-th scripted completion."""

    def __init__(self, tok, completions):
        self.tok, self.completions = tok, completions

    def generate(self, prompts, seeds, **_):
        return [
            SimpleNamespace(tokens=self.tok.encode(self.completions[i]) if self.completions[i] else [])
            for i in range(len(prompts))
        ]


def test_evaluation_reports_format_and_constant_beside_accuracy(tiny_model):
    from transformers import AutoTokenizer

    from gpu_workers.evaluate import evaluate

    tok = AutoTokenizer.from_pretrained(tiny_model(family="qwen2"))
    tasks = list(reasoning_gym_tasks("syllogism", 8, seed=1))
    flip = {"Yes": "No", "No": "Yes"}
    completions = [
        tasks[0].answer,  # right, in format
        flip[tasks[1].answer],  # wrong, in format
        f"{tasks[2].answer}.",  # right, in format
        "It depends on the statements.",  # out of format (wrong)
        "",  # nothing
        f"<answer>{tasks[5].answer}</answer>",  # right, tagged
        "Hmm, let me see what follows from these",  # out of format
        flip[tasks[7].answer],  # wrong, in format
    ]
    result = evaluate(_Scripted(tok, completions), tasks, tok, max_tokens=16, stop_token_ids=[0])
    formatted = np.array([1, 1, 1, 0, 0, 1, 0, 1], bool)
    correct = np.array([1, 0, 1, 0, 0, 1, 0, 0], bool)
    np.testing.assert_array_equal(result.correct[:, 0], correct)
    np.testing.assert_array_equal(result.formatted[:, 0], formatted)
    summary = result.summary()
    assert summary["format_rate"] == pytest.approx(5 / 8)
    assert summary["accuracy_in_format"] == pytest.approx(3 / 5)
    refs = collections.Counter(t.answer for t in tasks)
    assert summary["best_constant_accuracy"] == pytest.approx(max(refs.values()) / 8)
    assert summary["best_constant_answer"] == max(sorted(refs), key=lambda a: refs[a])
