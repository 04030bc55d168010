"""The environment interface of multi-turn rollouts.

An environment turns one task into an episode: it gives the first prompt, answers each model turn with an
environment turn (a tool's output or a user message) or ends the episode, and scores the whole episode. It is
deterministic given (task, seed) and the model turns it has seen, so a validator that re-runs it on a worker's
sampled turns must get the same environment turns, byte for byte; anything random in it draws from `seed`.
Tools run in the code sandbox (`gpu_workers.rewards.code`), never in the worker's process.

The worker and the validator, not the environment, turn text into tokens: an environment speaks text, and the
shared rendering (`gpu_workers.envs.tokens`) appends each environment turn's tokens to the exact previous
sequence, so earlier turns are never re-rendered.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from gpu_workers.rewards.base import RewardResult


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
    """Per-episode bounds, enforced by the worker and re-checked by the validator."""

    max_turns: int = 4  # model turns, the last included
    max_turn_tokens: int = 128  # sampled tokens per model turn
    max_env_tokens: int = 256  # tokens of one environment turn (its chat-template wrapper included)
    max_total_tokens: int = 1024  # the whole sequence, first prompt included

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"episode limit {field.name} must be a positive integer, got {value!r}")


@dataclasses.dataclass(frozen=True)
class EnvTurn:
    """What the environment says after a model turn."""

    text: str
    role: str = "user"  # "user" or "tool": the chat role the turn is rendered with

    def __post_init__(self) -> None:
        if self.role not in ("user", "tool"):
            raise ValueError(f"environment turn role must be 'user' or 'tool', got {self.role!r}")
        if not isinstance(self.text, str):
            raise TypeError(f"environment turn text must be a string, got {type(self.text).__name__}")


class Episode(abc.ABC):
    """One task's episode: the state of a conversation between the model and the environment."""

    @abc.abstractmethod
    def prompt_messages(self) -> list[dict[str, str]]:
        """The first prompt as chat messages ({"role", "content"}), rendered with the model's chat template."""

    @abc.abstractmethod
    def respond(self, model_text: str) -> EnvTurn | None:
        """The environment's answer to the model's latest turn (its sampled tokens, decoded), or None when the
        episode ends with that turn. Called once per model turn, in order; never called after None."""

    @abc.abstractmethod
    def reward(self) -> RewardResult:
        """The episode's score, once it has ended (by None from `respond` or by a limit)."""


class Environment(abc.ABC):
    """A named, configured environment; `start` makes a fresh episode of one task."""

    name: ClassVar[str]

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.config = dict(config or {})

    @abc.abstractmethod
    def start(self, task: Any, seed: int) -> Episode:
        """A fresh episode of `task` (a gpu_workers.tasks.Task); deterministic in (task, seed)."""


REGISTRY: dict[str, Callable[[Mapping[str, Any] | None], Environment]] = {}


def register(cls: type[Environment]) -> type[Environment]:
    """Class decorator: make an environment available by its `name`."""
    REGISTRY[cls.name] = cls
    return cls


def get_environment(name: str, config: Mapping[str, Any] | None = None) -> Environment:
    if name not in REGISTRY:
        raise KeyError(f"unknown environment {name!r}; registered: {', '.join(sorted(REGISTRY)) or 'none'}")
    return REGISTRY[name](config)
