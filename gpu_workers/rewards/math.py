"""Math answers checked with `math-verify`: the completion's final answer (a boxed expression, or the last
number or expression it can parse) is compared symbolically with the reference, so 1/2, 0.5 and
\\frac{1}{2} agree. A reference answer without `$` or `\\boxed` (GSM8K's N, the content of a MATH
solution's box such as `\\sqrt{2}`) is read as inline math."""

from __future__ import annotations

from gpu_workers.rewards.base import RewardResult


def math_reward(task, completion: str) -> RewardResult:
    from math_verify import parse, verify

    if task.answer is None:
        return RewardResult(0.0, "task has no reference answer")
    gold = parse(task.answer if "$" in task.answer or "\\boxed" in task.answer else f"${task.answer}$")
    if not gold:
        return RewardResult(0.0, f"reference answer {task.answer!r} does not parse")
    answer = parse(completion)
    if not answer:
        return RewardResult(0.0, "no answer found in the completion")
    return RewardResult(1.0 if verify(gold, answer) else 0.0)
