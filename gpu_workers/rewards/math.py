"""Math answers checked with `math-verify`: the completion's final answer (a boxed expression, or the last
number or expression it can parse) is compared symbolically with the reference, so 1/2, 0.5 and
\\frac{1}{2} agree. A reference answer without `$` or `\\boxed` (GSM8K's N, the content of a MATH
solution's box such as `\\sqrt{2}`) is read as inline math.

math-verify bounds each parse and comparison by a wall-clock alarm (5 s), so a starved process can time out where
an idle one does not, and a worker and its validator then disagree on an honest sample (seen: a multi-turn
`retry` episode whose feedback said the reference "does not parse" on a worker at load 15). The reference answer
comes from the pool's task file, not from a worker: it is parsed without a time limit, once per answer. The
completion, which an attacker writes, keeps the limits (a string built to make sympy spin would otherwise stall
every validator)."""

from __future__ import annotations

import functools

from gpu_workers.rewards.base import RewardResult


@functools.lru_cache(maxsize=4096)
def _reference(answer: str) -> tuple:
    """The reference answer parsed without math-verify's wall-clock limit (trusted input; module docstring)."""
    from math_verify import parse

    return tuple(parse(answer if "$" in answer or "\\boxed" in answer else f"${answer}$", parsing_timeout=None))


def math_reward(task, completion: str) -> RewardResult:
    from math_verify import parse, verify

    if task.answer is None:
        return RewardResult(0.0, "task has no reference answer")
    gold = list(_reference(task.answer))
    if not gold:
        return RewardResult(0.0, f"reference answer {task.answer!r} does not parse")
    answer = parse(completion)
    if not answer:
        return RewardResult(0.0, "no answer found in the completion")
    return RewardResult(1.0 if verify(gold, answer) else 0.0)
