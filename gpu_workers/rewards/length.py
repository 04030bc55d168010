"""INTELLECT-2's length reward: stay near the thinking-length target given in the prompt.

With task reward r, completion length n tokens, target T and coefficient alpha:

- `exact`: r - alpha * |T - n|          (hit the budget from either side)
- `max`:   r - alpha * max(0, n - T)     (only going over the budget costs)
- `clip`:  r * clip(alpha * (T - n) + delta, 0, 1)   (L1-Max: a correct answer is worth less the further it
                                                       runs over budget, nothing once far over)

A sample without a target (T = 0) keeps r.
"""

from __future__ import annotations

from typing import Literal

LengthMode = Literal["exact", "max", "clip"]


def length_reward(
    r: float, length: int, target: int, alpha: float, mode: LengthMode = "exact", delta: float = 0.5
) -> float:
    if target <= 0 or alpha == 0:
        return r
    if mode == "exact":
        return r - alpha * abs(target - length)
    if mode == "max":
        return r - alpha * max(0, length - target)
    if mode == "clip":
        return r * min(max(alpha * (target - length) + delta, 0.0), 1.0)
    raise ValueError(f"length reward mode {mode!r} is not one of exact, max, clip")
