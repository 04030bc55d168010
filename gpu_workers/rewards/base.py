"""What every reward returns, and the guard that keeps a crashing verifier from killing a worker."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RewardResult:
    value: float
    reason: str | None = None  # why the reward is what it is, when not simply right/wrong (e.g. a crash)


RewardFn = Callable[["Task", str], RewardResult]  # noqa: F821  (Task from gpu_workers.tasks)


def guarded(name: str, fn: RewardFn) -> RewardFn:
    """Wrap a reward so any exception becomes reward 0 with the reason logged, never a dead process."""

    def call(task, completion: str) -> RewardResult:
        try:
            return fn(task, completion)
        except Exception as exc:  # a verifier bug or hostile input must not take the worker down
            reason = f"{name} verifier crashed: {type(exc).__name__}: {exc}"
            log.warning(reason)
            return RewardResult(0.0, reason)

    return call
