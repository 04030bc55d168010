"""Exact string answers (synthetic tasks): the completion's last non-empty line, stripped of surrounding space
and a trailing period, after an optional "Answer:" prefix, must equal the reference."""

from __future__ import annotations

from gpu_workers.rewards.base import RewardResult


def final_line(completion: str) -> str:
    lines = [line.strip() for line in completion.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    last = lines[-1]
    if last.lower().startswith("answer:"):
        last = last[len("answer:") :].strip()
    return last.rstrip(".").strip()


def exact_reward(task, completion: str) -> RewardResult:
    if task.answer is None:
        return RewardResult(0.0, "task has no reference answer")
    return RewardResult(1.0 if final_line(completion) == task.answer.strip() else 0.0)
