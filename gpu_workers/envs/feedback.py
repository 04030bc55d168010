"""Multi-turn feedback environments: the environment answers each attempt.

- `retry`: any task of the pool (its prompt and its own reward, `gpu_workers.rewards.score`), answered in up to
  `max_turns` attempts. A right attempt ends the episode; a wrong one is answered with the checker's message
  ("That is not right." and the reward's reason when it gives one, e.g. a code task's failing test) and a
  request to try again. Reward: 1 for a task solved at the first attempt, `decay` ** (attempts - 1) for a later
  one, 0 for none; success is solving it at all.
- `guess`: guess a secret integer in [1, `high`]; each guess is answered "Too high." or "Too low." (or asked
  for a number). The secret is drawn from a hash of the task's prompt, so every sample of a group plays the
  same secret. Reward as `retry`'s.

Both are deterministic in (task, seed) and the model's turns, need no sandbox, and give demonstrations for a
warm start (`Episode.demonstration`): `retry` a wrong attempt (context only, not a training target) drawn from
the seed with probability `demo_wrong` (default 0.5), then the right answer; `guess` a bisection.
"""

from __future__ import annotations

import hashlib
import re

import numpy as np

from gpu_workers.envs.base import Demonstration, Environment, EnvTurn, Episode, register
from gpu_workers.rewards import score
from gpu_workers.rewards.base import RewardResult

_INT = re.compile(r"-?\d+")


def _decay(config) -> float:
    decay = float(config.get("decay", 1.0))
    if not 0 < decay <= 1:
        raise ValueError(f"environment config decay = {decay}: expected a value in (0, 1]")
    return decay


class _Attempts(Episode):
    """An episode of attempts at one answer: reward `decay` ** (attempts - 1) once right, else 0."""

    def __init__(self, decay: float):
        self.decay, self.attempts, self.solved_at = decay, 0, None

    def reward(self) -> RewardResult:
        if self.solved_at is None:
            return RewardResult(0.0, f"not solved in {self.attempts} attempts")
        return RewardResult(float(self.decay ** (self.solved_at - 1)))

    def success(self) -> bool:
        return self.solved_at is not None


@register
class Retry(Environment):
    """Retries with the checker's message (module docstring); config: decay, demo_wrong, feedback."""

    name = "retry"

    def start(self, task, seed: int) -> Episode:
        return _RetryEpisode(task, seed, self.config)


class _RetryEpisode(_Attempts):
    def __init__(self, task, seed: int, config):
        super().__init__(_decay(config))
        self.task, self.seed, self.config = task, int(seed), config
        self.feedback = str(config.get("feedback", "That is not right. Try again."))

    def prompt_messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.task.prompt}]

    def respond(self, model_text: str) -> EnvTurn | None:
        self.attempts += 1
        result = score(self.task, model_text)
        if result.value >= 1.0:
            self.solved_at = self.attempts
            return None
        reason = f" ({result.reason})" if result.reason else ""
        return EnvTurn(f"{self.feedback}{reason}")

    def demonstration(self) -> list[Demonstration] | None:
        if self.task.answer is None:
            return None
        rng = np.random.default_rng([self.seed, 7])
        turns = []
        if rng.random() < float(self.config.get("demo_wrong", 0.5)):
            turns.append(Demonstration(_wrong(self.task.answer, rng), train=False))
        turns.append(Demonstration(self.task.answer))
        return turns


def _wrong(answer: str, rng: np.random.Generator) -> str:
    """A plausible wrong answer: its characters shuffled when that changes it, else a digit or letter changed."""
    chars = list(answer)
    for _ in range(8):
        rng.shuffle(chars)
        if "".join(chars) != answer:
            return "".join(chars)
    return answer[:-1] + ("0" if answer[-1:] != "0" else "1")


@register
class Guess(Environment):
    """Guess the number (module docstring); config: high (100), decay."""

    name = "guess"

    def start(self, task, seed: int) -> Episode:
        return _GuessEpisode(task, seed, self.config)


class _GuessEpisode(_Attempts):
    def __init__(self, task, seed: int, config):
        super().__init__(_decay(config))
        self.high = int(config.get("high", 100))
        if self.high < 2:
            raise ValueError(f"environment guess: high = {self.high}, expected at least 2")
        digest = hashlib.sha256(f"intellect-guess/v1|{task.prompt}".encode()).digest()
        self.secret = 1 + int.from_bytes(digest[:8], "big") % self.high
        self.seed, self.config = int(seed), config

    def prompt_messages(self) -> list[dict[str, str]]:
        return [
            {
                "role": "user",
                "content": f"I am thinking of a whole number from 1 to {self.high}. Guess it: answer with one "
                "number. I will say whether it is too high or too low.",
            }
        ]

    def respond(self, model_text: str) -> EnvTurn | None:
        self.attempts += 1
        numbers = _INT.findall(model_text)
        if not numbers:
            return EnvTurn("Please answer with a number.")
        guess = int(numbers[-1])
        if guess == self.secret:
            self.solved_at = self.attempts
            return None
        return EnvTurn("Too high." if guess > self.secret else "Too low.")

    def demonstration(self) -> list[Demonstration] | None:
        """Bisection: the middle of what the answers so far leave open, until the secret."""
        low, high, turns = 1, self.high, []
        while True:
            guess = (low + high) // 2
            turns.append(Demonstration(str(guess)))
            if guess == self.secret:
                return turns
            low, high = (low, guess - 1) if guess > self.secret else (guess + 1, high)
