"""Group-relative advantages (GRPO) and online filtering of groups that carry no signal.

Every prompt is sampled G times; a sample's advantage compares its reward with its group's:

- `std` (INTELLECT-2, DeepSeekMath GRPO): A = (r - mean) / (std + eps), std with ddof=1 (unbiased).
- `mean` (Dr. GRPO, arXiv 2503.20783): A = r - mean; dividing by the std over-weights groups that are almost
  all right or all wrong.

A group whose advantages are all zero (every sample got the same reward) adds nothing to the policy gradient
but costs a full forward and backward; such groups are dropped before packing and counted (online filtering,
as INTELLECT-2 did). Host-side numpy: it runs on the rollouts before they become device arrays.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

AdvantageMode = Literal["std", "mean"]


@dataclasses.dataclass(frozen=True)
class Advantages:
    values: np.ndarray  # float32 [n], one per sample, in input order
    keep: np.ndarray  # bool [n]: False for samples of dropped (all-zero) groups
    groups: int
    dropped_groups: int
    zero_groups: int = 0  # groups whose rewards were all equal (dropped or not)


def group_advantages(
    rewards: np.ndarray,
    group_ids: np.ndarray,
    mode: AdvantageMode = "std",
    eps: float = 1e-6,
    drop_zero_groups: bool = True,
) -> Advantages:
    """Advantages of samples `rewards` [n] grouped by `group_ids` [n] (any integer labels)."""
    rewards = np.asarray(rewards, np.float64)
    group_ids = np.asarray(group_ids)
    if rewards.shape != group_ids.shape or rewards.ndim != 1:
        raise ValueError(f"advantages: rewards {rewards.shape} and group_ids {group_ids.shape} must be equal 1-D")
    if not np.all(np.isfinite(rewards)):
        raise ValueError(
            f"advantages: non-finite reward at indices {np.flatnonzero(~np.isfinite(rewards))[:8].tolist()}"
        )
    if mode not in ("std", "mean"):
        raise ValueError(f"advantages: mode {mode!r} is not one of 'std', 'mean'")
    labels, inverse, counts = np.unique(group_ids, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=rewards, minlength=len(labels))
    mean = sums / counts
    centred = rewards - mean[inverse]
    values = centred
    if mode == "std":
        sq = np.bincount(inverse, weights=centred**2, minlength=len(labels))
        std = np.sqrt(sq / np.maximum(counts - 1, 1))  # ddof=1; a group of one has std 0
        values = centred / (std[inverse] + eps)
    zero_group = np.bincount(inverse, weights=(values != 0).astype(np.float64), minlength=len(labels)) == 0
    keep = ~zero_group[inverse] if drop_zero_groups else np.ones(len(rewards), bool)
    zero = int(zero_group.sum())
    return Advantages(values.astype(np.float32), keep, len(labels), zero if drop_zero_groups else 0, zero)
