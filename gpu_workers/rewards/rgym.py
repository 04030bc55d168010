"""reasoning-gym's own scoring (`gpu_workers.tasks.rgym`): the completion's answer goes with the task's entry to
the generator's `score_answer`, whose value in [0, 1] is the reward.

The answer is, in this order:
1. what the last `<answer>...</answer>` of the completion holds (reasoning-gym's `extract_answer`, the format
   its system prompts ask for);
2. when the reference answer is a number: the last number in the completion ("The letter "s" appears 4
   times." answers 4), written without thousands separators;
3. else the completion's last non-empty line (after an optional "Answer:").
The choice depends only on the completion and the task, so a worker and a validator extract the same answer.
"""

from __future__ import annotations

import re

from gpu_workers.rewards.base import RewardResult
from gpu_workers.rewards.exact import final_line

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_IS_NUMBER = re.compile(r"^-?\d+(?:\.\d+)?$")


def completion_answer(completion: str, reference: str | None) -> str | None:
    from reasoning_gym.utils import extract_answer

    tagged = extract_answer(completion)
    if tagged is not None:
        return tagged
    if reference is not None and _IS_NUMBER.match(reference.strip()):
        numbers = _NUMBER.findall(completion)
        return numbers[-1].replace(",", "").rstrip(".") if numbers else None
    return final_line(completion) or None


def reasoning_gym_reward(task, completion: str) -> RewardResult:
    from gpu_workers.tasks.rgym import scorer

    answer = completion_answer(completion, task.answer)
    if answer is None:
        return RewardResult(0.0, "no answer found in the completion")
    return RewardResult(float(scorer(task)(answer, task.meta["entry"])))
