"""Rewards by name: a task names its verifier, workers and validators look it up here and run the same code.

Every registered reward is guarded: an exception inside a verifier gives reward 0 with the reason logged.
"""

from __future__ import annotations

from gpu_workers.rewards.base import RewardFn, RewardResult, guarded
from gpu_workers.rewards.code import Limits, code_reward
from gpu_workers.rewards.exact import exact_reward
from gpu_workers.rewards.length import LengthMode, length_reward
from gpu_workers.rewards.math import math_reward
from gpu_workers.rewards.rgym import reasoning_gym_reward

REGISTRY: dict[str, RewardFn] = {}


def register(name: str, fn: RewardFn) -> None:
    REGISTRY[name] = guarded(name, fn)


def get_reward(name: str) -> RewardFn:
    if name not in REGISTRY:
        raise KeyError(f"unknown reward {name!r}; registered: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def score(task, completion: str) -> RewardResult:
    """The task's own reward for a completion."""
    return get_reward(task.reward)(task, completion)


def sample_reward(
    task, completion: str, length: int, target: int, penalty: float = 0.0, mode: LengthMode = "exact"
) -> RewardResult:
    """What a worker claims and a validator recomputes for one sample: the task's reward, then the length
    reward of INTELLECT-2 against the sample's thinking-length target (`length` completion tokens)."""
    task_result = score(task, completion)
    return RewardResult(length_reward(task_result.value, length, target, penalty, mode), task_result.reason)


register("math", math_reward)
register("exact", exact_reward)
register("code", code_reward)
register("reasoning_gym", reasoning_gym_reward)

__all__ = [
    "Limits",
    "REGISTRY",
    "RewardFn",
    "RewardResult",
    "get_reward",
    "length_reward",
    "register",
    "sample_reward",
    "score",
]
