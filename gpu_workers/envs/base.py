"""The environment interface of multi-turn rollouts.

An environment turns one task into an episode: it gives the first prompt, answers each model turn with an
environment turn (a tool's output or a user message) or ends the episode, and scores the whole episode. It is
deterministic given (task, seed) and the model turns it has seen, so a validator that re-runs it on a worker's
sampled turns must get the same environment turns, byte for byte; anything random in it draws from `seed`.
Tools run in the code sandbox (`gpu_workers.rewards.code`), never in the worker's process.

The worker and the validator, not the environment, turn text into tokens: an environment speaks text, and the
shared rendering (`gpu_workers.envs.tokens`) appends each environment turn's tokens to the exact previous
sequence, so earlier turns are never re-rendered. The episode's protocol, the same on both sides, is in
`gpu_workers.envs.episode`: `respond` is called once after every model turn, the last one included (so the
environment has seen every sampled turn when it scores), and the episode ends when `respond` returns None, when
the model turn ended without a stop token, when `EpisodeLimits.max_turns` model turns were taken, or when the
next environment turn would not fit `max_env_tokens` or leave room for another sampled token.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping, Sequence
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

    @property
    def max_sampled_tokens(self) -> int:
        """The most tokens one episode's model turns can hold together (what its TOPLOC proofs cover)."""
        return min(self.max_turns * self.max_turn_tokens, self.max_total_tokens - 1)


@dataclasses.dataclass(frozen=True)
class EnvTurn:
    """One message the environment says after a model turn."""

    text: str
    role: str = "user"  # "user" or "tool": the chat role the turn is rendered with

    def __post_init__(self) -> None:
        if self.role not in ("user", "tool"):
            raise ValueError(f"environment turn role must be 'user' or 'tool', got {self.role!r}")
        if not isinstance(self.text, str):
            raise TypeError(f"environment turn text must be a string, got {type(self.text).__name__}")


Response = EnvTurn | Sequence[EnvTurn] | None
"""What `Episode.respond` returns: one message, several (rendered together as one environment turn, e.g. the
outputs of several tool calls), or None to end the episode."""


def as_messages(response: Response) -> tuple[EnvTurn, ...] | None:
    """`respond`'s answer as a tuple of messages (None: the episode ends); TypeError for anything else."""
    if response is None:
        return None
    turns = (response,) if isinstance(response, EnvTurn) else tuple(response)
    if not turns or not all(isinstance(t, EnvTurn) for t in turns):
        raise TypeError(f"an environment's respond() must return EnvTurn(s) or None, got {response!r}")
    return turns


@dataclasses.dataclass(frozen=True)
class Demonstration:
    """A model turn of a worked episode, for a supervised warm start (`intellect sft` with `data.env` plays them
    through `gpu_workers.envs.episode.demonstrate`)."""

    text: str
    train: bool = True  # False: the turn is context only (e.g. a wrong first attempt), not a training target


class Episode(abc.ABC):
    """One task's episode: the state of a conversation between the model and the environment."""

    @abc.abstractmethod
    def prompt_messages(self) -> list[dict[str, str]]:
        """The first prompt as chat messages ({"role", "content"}), rendered with the model's chat template."""

    @abc.abstractmethod
    def respond(self, model_text: str) -> Response:
        """The environment's answer to the model's latest turn (its sampled tokens, decoded without special
        tokens), or None when the episode ends with that turn. Called once per model turn, in order, the last
        turn included; never called after None."""

    @abc.abstractmethod
    def reward(self) -> RewardResult:
        """The episode's score, once it has ended (by None from `respond` or by a limit)."""

    def success(self) -> bool:
        """Whether the episode solved its task (`play` records it; `intellect eval` reports the rate): by default
        a reward of 1."""
        return self.reward().value >= 1.0

    def demonstration(self) -> list[Demonstration] | None:
        """The model turns of a worked episode of this task (None: the environment has none), for a supervised
        warm start; `respond` is called on each of them in turn, so call it on a fresh episode."""
        return None


class Environment(abc.ABC):
    """A named, configured environment; `start` makes a fresh episode of one task."""

    name: ClassVar[str]

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.config = dict(config or {})

    @abc.abstractmethod
    def start(self, task: Any, seed: int) -> Episode:
        """A fresh episode of `task` (a gpu_workers.tasks.Task); deterministic in (task, seed)."""

    def uses_sandbox(self) -> bool:
        """Whether its tools run model-written code (the node must then have the code sandbox, as for code
        rewards: `gpu_workers.rewards.code.prepare`)."""
        return False


REGISTRY: dict[str, Callable[[Mapping[str, Any] | None], Environment]] = {}


def register(cls: type[Environment]) -> type[Environment]:
    """Class decorator: make an environment available by its `name`."""
    REGISTRY[cls.name] = cls
    return cls


def get_environment(name: str, config: Mapping[str, Any] | None = None) -> Environment:
    if name not in REGISTRY:
        raise KeyError(f"unknown environment {name!r}; registered: {', '.join(sorted(REGISTRY)) or 'none'}")
    return REGISTRY[name](config)
