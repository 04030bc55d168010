"""What an evaluation reports beside the reward: whether a completion states its answer in the task's expected
format, and the best constant answer of a task set (the score a policy gets by ignoring the question).

An answer is in the expected format when the task's reward finds one of the reference's shape:
- `reasoning_gym`: an `<answer>` tag, or else (the reward's own fallbacks) a number where the reference is a
  number, or a last line of as many words as the reference ("Yes" for "No"; "olleh" for "hello");
- `exact`: a last line of the reference's shape (the same rule);
- `math`: an expression math-verify can read (a box, or the last number or expression).
Other rewards (code, environments, registered ones) have no format rule: `answer_in_format` returns None.

The best constant answer is, of the `candidates` most frequent reference answers, the one that the tasks' own
rewards score right on the most tasks (ties go to the more frequent); its score is the share of tasks it gets
right (reward >= 1, as `gpu_workers.evaluate` counts a right answer).
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Sequence

from gpu_workers.rewards.exact import final_line

_IS_NUMBER = re.compile(r"^-?\d[\d,]*(?:\.\d+)?$")
_FORMAT_RULES = ("reasoning_gym", "exact", "math")


def _same_shape(answer: str, reference: str) -> bool:
    """A number for a number; as many words as the reference otherwise."""
    reference = reference.strip()
    if _IS_NUMBER.match(reference):
        return bool(_IS_NUMBER.match(answer.strip()))
    return len(answer.split()) == len(reference.split())


def answer_in_format(task, completion: str) -> bool | None:
    """Whether `completion` states an answer of the expected format for `task` (module docstring); None where
    the task's reward has no format rule or the task has no reference answer."""
    if task.reward not in _FORMAT_RULES or task.answer is None:
        return None
    if task.reward == "math":
        from math_verify import parse

        try:
            return bool(parse(completion))
        except Exception:  # math-verify's own time limit or a parser error: no readable answer
            return False
    if task.reward == "reasoning_gym":
        from reasoning_gym.utils import extract_answer

        from gpu_workers.rewards.rgym import completion_answer

        if extract_answer(completion) is not None:
            return True
        answer = completion_answer(completion, task.answer)
        return answer is not None and _same_shape(answer, task.answer)
    answer = final_line(completion)
    return bool(answer) and _same_shape(answer, task.answer)


@dataclasses.dataclass(frozen=True)
class ConstantAnswer:
    answer: str
    accuracy: float  # share of the tasks this one answer gets right
    frequency: float  # share of the tasks whose reference it is


def best_constant(tasks: Sequence, candidates: int = 8) -> ConstantAnswer | None:
    """The best constant answer of `tasks` (module docstring); None when a task has no reference answer or its
    reward has no format rule (code, environments: a constant answer means nothing there)."""
    from gpu_workers.rewards import score

    if not tasks or any(t.answer is None or t.reward not in _FORMAT_RULES for t in tasks):
        return None
    counts = collections.Counter(t.answer.strip() for t in tasks)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:candidates]
    best = None
    for answer, count in ranked:
        right = sum(score(task, answer).value >= 1.0 for task in tasks)
        if best is None or right > best[1]:
            best = (answer, right, count)
    answer, right, count = best
    return ConstantAnswer(answer, right / len(tasks), count / len(tasks))
