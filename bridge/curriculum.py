"""A difficulty curriculum, the rule every role agrees on (docs/design.md section 8).

The training task list is `levels` slices of equal size, easiest first (a reasoning-gym generator at each
level's settings). Every assignment draws its prompts from the slice of its level (`bridge.assignment`). The
orchestrator decides a version's level when the learner announces it, from the rewards validators gave the
accepted batches at the current level, and records it with each assignment it issues; a worker learns the level
with its assignment, a validator with the batch it claims, so both draw the same prompts and no worker chooses.

`next_level`: once the current level has `window` accepted batches, their mean solve rate (the share of
samples with reward >= 1) at or above `promote` moves the next version one level up, below `demote` one down;
otherwise the level stays. A level's batches count from the first version at that level, so a move starts a
fresh window.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Curriculum:
    levels: int
    promote: float
    demote: float
    window: int

    def __post_init__(self):
        if self.levels < 1 or self.window < 1 or not 0 <= self.demote < self.promote <= 1:
            raise ValueError(
                f"curriculum: levels ({self.levels}) and window ({self.window}) must be >= 1 and "
                f"0 <= demote ({self.demote}) < promote ({self.promote}) <= 1"
            )

    def next_level(self, level: int, solve_rates: Sequence[float]) -> int:
        """The level of the next version, from the solve rates of the current level's accepted batches (oldest
        first, since the level began)."""
        if not 0 <= level < self.levels:
            raise ValueError(f"curriculum: level {level} is not one of 0..{self.levels - 1}")
        if len(solve_rates) < self.window:
            return level
        rate = float(np.mean(solve_rates[-self.window :]))
        if rate >= self.promote and level + 1 < self.levels:
            return level + 1
        if rate < self.demote and level > 0:
            return level - 1
        return level


def solve_rate(rewards: Sequence[float]) -> float:
    """The share of a batch's samples whose reward is at least 1 (a solved task)."""
    rewards = np.asarray(rewards, np.float64)
    return float((rewards >= 1.0).mean()) if rewards.size else 0.0
