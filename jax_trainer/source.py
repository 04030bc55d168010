"""Where the learner's batches come from: the `BatchSource` interface and an in-memory source.

The learner asks for the batch of step n and accepts only rollouts of versions v with n - v <= async_level
(docs/design.md section 3). A source blocks until it has one, and its cursor (JSON) goes into every checkpoint so that
a resumed learner neither retrains nor skips a batch. The rollout-store pipeline (`jax_trainer/data.py`) is
the production source; `InMemorySource` serves tests and the synthetic examples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from jax_trainer.advantages import group_advantages
from jax_trainer.packing import PackedBatch, Sample, pack


@dataclasses.dataclass
class StepBatch:
    """One step's data: the packed arrays and what the learner logs about them."""

    packed: PackedBatch
    stats: dict[str, float]  # e.g. reward_mean, dropped_groups, samples, staleness_max
    batch_ids: tuple[str, ...] = ()  # "v{version}/{batch id}" of every rollout batch trained on in this step


class BatchSource(Protocol):
    def next(self, step: int, timeout: float | None = None) -> StepBatch:
        """The batch for optimizer step `step` (blocks up to `timeout` seconds; TimeoutError after)."""

    def cursor(self) -> dict[str, Any]:
        """JSON-serialisable position, saved in checkpoints."""

    def restore(self, cursor: dict[str, Any]) -> None:
        """Continue from a cursor returned by `cursor()`."""


@dataclasses.dataclass
class Rollout:
    """A sample before advantages: what a worker produced and the validator scored."""

    tokens: np.ndarray
    prompt_len: int
    logprobs: np.ndarray
    reward: float
    group: int
    version: int
    name: str = ""
    sampled: np.ndarray | None = None
    """uint8 [n]: 1 on the tokens the model sampled (a multi-turn episode's model turns; None: the completion)."""


def build_step_batch(
    rollouts: Sequence[Rollout],
    step: int,
    *,
    rows: int,
    seq_len: int,
    multiple_of: int = 1,
    advantage_mode: str = "std",
    drop_zero_groups: bool = True,
    truncate: bool = False,
    micro_batches: int | None = None,
) -> StepBatch | None:
    """Advantages per group, online filtering, packing; None when every group was filtered out."""
    adv = group_advantages(
        np.array([r.reward for r in rollouts]),
        np.array([r.group for r in rollouts]),
        advantage_mode,
        drop_zero_groups=drop_zero_groups,
    )
    samples = [
        Sample(r.tokens, r.prompt_len, r.logprobs, float(a), r.version, r.reward, r.name, r.sampled)
        for r, a, k in zip(rollouts, adv.values, adv.keep)
        if k
    ]
    stats = {
        "samples": float(len(rollouts)),
        "samples_trained": float(len(samples)),
        "groups": float(adv.groups),
        "dropped_groups": float(adv.dropped_groups),
        "uninformative_group_frac": adv.zero_groups / adv.groups if adv.groups else 0.0,
        "reward_mean": float(np.mean([r.reward for r in rollouts])) if rollouts else 0.0,
    }
    if not samples:
        return None
    staleness = [step - s.version for s in samples]
    stats.update(staleness_mean=float(np.mean(staleness)), staleness_max=float(max(staleness)))
    return StepBatch(pack(samples, rows, seq_len, multiple_of, truncate, micro_batches), stats)


class InMemorySource:
    """Batches from a callable `make(step) -> list[Rollout]` (synthetic tasks, tests); the cursor is the step."""

    def __init__(
        self,
        make: Callable[[int], Sequence[Rollout]],
        *,
        rows: int,
        seq_len: int,
        multiple_of: int = 1,
        advantage_mode: str = "std",
        async_level: int = 2,
        max_tries: int = 100,
    ):
        self.make = make
        self.rows, self.seq_len, self.multiple_of = rows, seq_len, multiple_of
        self.advantage_mode = advantage_mode
        self.async_level = async_level
        self.max_tries = max_tries
        self.position = 0

    def next(self, step: int, timeout: float | None = None) -> StepBatch:
        for _ in range(self.max_tries):
            rollouts = [r for r in self.make(self.position) if step - r.version <= self.async_level]
            self.position += 1
            batch = build_step_batch(
                rollouts,
                step,
                rows=self.rows,
                seq_len=self.seq_len,
                multiple_of=self.multiple_of,
                advantage_mode=self.advantage_mode,
            )
            if batch is not None:
                return batch
        raise TimeoutError(f"in-memory source: {self.max_tries} draws in a row had no usable group")

    def cursor(self) -> dict[str, Any]:
        return {"position": self.position}

    def restore(self, cursor: dict[str, Any]) -> None:
        self.position = int(cursor["position"])
