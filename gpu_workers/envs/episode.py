"""One episode's protocol, the same on a worker (`play`) and a validator (`judge`).

The sequence of an episode is its first prompt, then model turns (sampled) and environment turns (not
sampled) alternating, ending with a model turn. Turn k (from 0) of a sample with seed s is sampled with the
replayable sampler at seed `turn_seed(s, k)` and positions 0, 1, ... within the turn (vLLM counts a request's
generated tokens), with at most `min(max_turn_tokens, max_total_tokens - tokens so far)` tokens: every model
turn is a generation whose prompt is the exact previous sequence, as token ids.

After every model turn the environment's `respond` is called with the turn's text (its tokens decoded without
special tokens); an exception from it ends the episode with reward 0. The episode continues after turn k only
if all of these hold: the turn ended with a stop token, `respond` gave a message, k + 1 < `max_turns`, and the
environment turn's tokens (`TurnRenderer.env_tokens`) number at most `max_env_tokens` and leave room for at least
one more sampled token within `max_total_tokens`; the environment turn's tokens are then appended. Otherwise
the episode ends with turn k and is scored (`Episode.reward`). `finish` is that of the last model turn.

`judge` re-runs the environment on the sampled turns of a recorded sequence and requires everything else to be
exactly what the protocol makes of them: the first prompt, every environment turn byte for byte, every model
turn ending with a stop token (and holding none earlier) unless it is the last and reached its cap, the episode
continuing exactly as long as the protocol continues it, and `finish`. It returns the recomputed reward. The
sampled tokens themselves are the replay check's (`gpu_workers.episode_checks`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from bridge.rollouts import FINISH_LENGTH, FINISH_STOP
from gpu_workers.envs.base import Environment, EnvTurn, EpisodeLimits, as_messages
from gpu_workers.envs.tokens import TurnRenderer

log = logging.getLogger(__name__)
_SHOWN = 3


def turn_seed(seed: int, turn: int) -> int:
    """The replayable sampler's seed of model turn `turn` of a sample with seed `seed`: the seed itself for turn
    0 (a one-turn episode samples as a single-turn sample does), else the first 8 bytes, big-endian, of
    sha256("intellect-turn-seed/v1|{seed}|{turn}") with the top bit cleared."""
    if turn == 0:
        return int(seed)
    digest = hashlib.sha256(f"intellect-turn-seed/v1|{int(seed)}|{int(turn)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


@dataclasses.dataclass
class Protocol:
    """What both sides need to run an episode: the environment, the rendering, the limits, the stop tokens and
    the decoding of a model turn."""

    env: Environment
    renderer: TurnRenderer
    limits: EpisodeLimits
    stop_token_ids: frozenset[int]
    decode: Callable[[Sequence[int]], str]
    """A model turn's text: its tokens decoded without special tokens."""

    @classmethod
    def for_tokenizer(
        cls, env: Environment, tokenizer, limits: EpisodeLimits, stop_token_ids, system_prompt: str | None = None
    ) -> Protocol:
        return cls(
            env,
            TurnRenderer(tokenizer, system_prompt),
            limits,
            frozenset(int(t) for t in stop_token_ids),
            lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True),
        )

    def turn_cap(self, length: int) -> int:
        """The most tokens a model turn starting after `length` tokens may sample."""
        return min(self.limits.max_turn_tokens, self.limits.max_total_tokens - length)

    def respond(self, episode, text: str) -> tuple[tuple[EnvTurn, ...] | None, str | None]:
        """(the environment's messages or None, why it failed or None): an exception ends the episode."""
        try:
            return as_messages(episode.respond(text)), None
        except Exception as err:  # an environment bug or hostile model text: the episode ends, reward 0
            return None, f"the environment raised {type(err).__name__}: {err}"

    def next_turn(self, messages, turn: list[int], index: int, length: int) -> tuple[list[int] | None, str]:
        """The environment turn's tokens after model turn `index` (its tokens `turn`, the sequence then holding
        `length` tokens), or None with why the episode ends there."""
        if not turn or turn[-1] not in self.stop_token_ids:
            return None, "the model turn reached its token cap"
        if messages is None:
            return None, "the environment ended the episode"
        if index + 1 >= self.limits.max_turns:
            return None, f"max_turns ({self.limits.max_turns}) model turns were taken"
        env = self.renderer.env_tokens(messages, turn[-1])
        if len(env) > self.limits.max_env_tokens:
            return None, f"the environment turn has {len(env)} tokens, more than max_env_tokens"
        if length + len(env) + 1 > self.limits.max_total_tokens:
            return None, "the environment turn leaves no room for another model turn within max_total_tokens"
        return env, ""

    def first_prompt(self, episode) -> list[int]:
        return self.renderer.first_prompt(episode.prompt_messages())


@dataclasses.dataclass
class Rollout:
    """One episode as a worker played it (what a rollout batch stores of it)."""

    tokens: list[int]
    sampled: list[int]
    prompt_len: int
    logprobs: list[float]
    full_logprobs: list[float] | None
    hidden: list[Any]  # per model turn: [n, hidden] states behind its tokens (torch tensors), in order
    finish: int = FINISH_STOP
    reward: float = 0.0
    reason: str | None = None
    turns: int = 0
    success: bool = False
    ended: str = ""


def play(
    protocol: Protocol,
    tasks: Sequence[Any],
    seeds: Sequence[int],
    generate: Callable[[list[list[int]], list[int], list[int]], list[Any]],
) -> list[Rollout]:
    """Play one episode per (task, seed), all of them turn by turn together: `generate(prompts, seeds,
    max_tokens)` samples one model turn per prompt (an engine's `Completion`s: tokens, logprobs, full_logprobs,
    finish, hidden) with the turn's seed."""
    episodes = [protocol.env.start(task, int(seed)) for task, seed in zip(tasks, seeds)]
    rollouts = []
    for i, episode in enumerate(episodes):
        prompt = protocol.first_prompt(episode)
        if len(prompt) >= protocol.limits.max_total_tokens:
            raise ValueError(
                f"task {i}: the first prompt has {len(prompt)} tokens, max_total_tokens is "
                f"{protocol.limits.max_total_tokens}: no room for a model turn"
            )
        rollouts.append(Rollout(list(prompt), [0] * len(prompt), len(prompt), [0.0] * len(prompt), [], []))
    with_full = True
    active = list(range(len(episodes)))
    for turn in range(protocol.limits.max_turns):
        if not active:
            break
        outs = generate(
            [rollouts[i].tokens for i in active],
            [turn_seed(seeds[i], turn) for i in active],
            [protocol.turn_cap(len(rollouts[i].tokens)) for i in active],
        )
        still = []
        for i, out in zip(active, outs):
            r, tokens = rollouts[i], [int(t) for t in out.tokens]
            r.tokens += tokens
            r.sampled += [1] * len(tokens)
            r.logprobs += [float(x) for x in out.logprobs]
            if out.full_logprobs is None:
                with_full = False
            else:
                r.full_logprobs = (r.full_logprobs or []) + [float(x) for x in out.full_logprobs]
            r.hidden.append(out.hidden)
            r.turns += 1
            messages, failure = protocol.respond(episodes[i], protocol.decode(tokens))
            env, why = protocol.next_turn(messages, tokens, turn, len(r.tokens)) if failure is None else (None, "")
            if env is None:
                r.finish = FINISH_STOP if out.finish == FINISH_STOP else FINISH_LENGTH
                r.ended = failure or why
                _score(r, episodes[i], failure)
                continue
            r.tokens += env
            r.sampled += [0] * len(env)
            r.logprobs += [0.0] * len(env)
            still.append(i)
        active = still
    for r in rollouts:  # full logprobs only where every turn of every episode has them (the replayable sampler)
        if not with_full:
            r.full_logprobs = None
            continue
        full = iter(r.full_logprobs)
        r.full_logprobs = [0.0] * r.prompt_len + [next(full) if s else 0.0 for s in r.sampled[r.prompt_len :]]
    return rollouts


@dataclasses.dataclass(frozen=True)
class Demonstrated:
    """One task's demonstration played through the protocol: the sequence a worker would hold had it sampled the
    demonstration's turns, and `trained`, 1 on the tokens of the turns to train on (`Demonstration.train`, the
    stop token included), 0 on the prompt, the environment turns and context-only turns."""

    tokens: list[int]
    trained: list[int]
    prompt_len: int
    turns: int
    reward: float


def engine_turns(engine, protocol: Protocol, temperature: float, top_p: float, **options) -> Callable:
    """The `generate` that `play` calls, on a `gpu_workers.engine.Engine`: each turn sampled at its seed with the
    pool's sampling settings, stopping on the protocol's stop tokens, capped per prompt; `options` go to
    `Engine.generate` (the worker's `hidden_only=True` for proofs, an evaluation's `proofs=False`)."""
    stops = sorted(protocol.stop_token_ids)

    def generate(prompts, turn_seeds, caps):
        return engine.generate(
            prompts, turn_seeds, temperature=temperature, top_p=top_p, max_tokens=caps, stop_token_ids=stops, **options
        )

    return generate


def turn_stop_token(protocol: Protocol) -> int:
    """The stop token a model turn ends with when it is written as text: the first token of what the chat
    template writes after an assistant turn (ChatML: `<|im_end|>`) when the protocol stops on it, else the
    smallest of the protocol's stop tokens."""
    close = protocol.renderer.tokenizer.encode(protocol.renderer.close, add_special_tokens=False)
    if close and int(close[0]) in protocol.stop_token_ids:
        return int(close[0])
    if not protocol.stop_token_ids:
        raise ValueError("the protocol has no stop tokens to end a demonstrated turn with")
    return min(protocol.stop_token_ids)


def demonstrate(protocol: Protocol, task: Any, seed: int, where: str = "task") -> Demonstrated:
    """Play `task`'s demonstration (`Episode.demonstration`) as an episode at `seed`: the first prompt, then each
    demonstrated turn as its tokens (`TurnRenderer.turn_tokens`, ended by `turn_stop_token`) and the environment's
    answer to it appended exactly as `play` appends it (the environment sees the turn's tokens decoded as a
    worker's turn is). ValueError, naming the environment and `where`, when the environment gives no
    demonstration, a turn does not fit the episode's limits, the episode ends before the demonstration does, or
    the demonstration does not solve the task."""
    name = f"environment {protocol.env.name!r}"
    episode = protocol.env.start(task, int(seed))
    turns = episode.demonstration()
    if not turns:
        raise ValueError(f"{name} gives no demonstration of {where} (a supervised warm start needs one)")
    if not any(t.train for t in turns):
        raise ValueError(f"{name}: the demonstration of {where} has no turn to train on (every turn is context)")
    stop = turn_stop_token(protocol)
    tokens = protocol.first_prompt(episode)
    prompt_len = len(tokens)
    trained = [0] * prompt_len
    messages = None
    for k, demo in enumerate(turns):
        turn = protocol.renderer.turn_tokens(demo.text, stop)
        cap = protocol.turn_cap(len(tokens))
        if len(turn) > cap:
            raise ValueError(
                f"{name}: turn {k} of the demonstration of {where} has {len(turn)} tokens, more than its cap of "
                f"{cap} (data.max_new_tokens / worker.max_tokens, data.max_episode_tokens)"
            )
        tokens += turn
        trained += [int(demo.train)] * len(turn)
        messages, failure = protocol.respond(episode, protocol.decode(turn))
        if failure is not None:
            raise ValueError(f"{name}: on the demonstration of {where}, {failure}")
        if k == len(turns) - 1:
            break
        env, why = protocol.next_turn(messages, turn, k, len(tokens))
        if env is None:
            raise ValueError(
                f"{name}: the episode of {where} ends after turn {k} of its {len(turns)}-turn demonstration: {why}"
            )
        tokens += env
        trained += [0] * len(env)
    rollout = Rollout([], [], 0, [], None, [])
    _score(rollout, episode, None)
    if not rollout.success:
        raise ValueError(
            f"{name}: the demonstration of {where} does not solve it (reward {rollout.reward}: {rollout.reason})"
        )
    return Demonstrated(tokens, trained, prompt_len, len(turns), rollout.reward)


def _score(rollout: Rollout, episode, failure: str | None) -> None:
    if failure is not None:
        rollout.reward, rollout.reason, rollout.success = 0.0, failure, False
        return
    try:
        result = episode.reward()
        rollout.reward, rollout.reason = float(result.value), result.reason
        rollout.success = bool(episode.success())
    except Exception as err:  # a crashing scorer gives 0, as a crashing reward does
        rollout.reward, rollout.reason, rollout.success = 0.0, f"the environment's reward raised {err!r}", False
    if not np.isfinite(rollout.reward):
        rollout.reward, rollout.reason = 0.0, f"the environment's reward was {rollout.reward}"


@dataclasses.dataclass(frozen=True)
class Judgement:
    """The validator's re-run of one episode: reasons it differs from the protocol (none: it matches), and the
    recomputed reward (None where the re-run could not get that far)."""

    reasons: tuple[str, ...]
    reward: float | None
    turns: int
    env_tokens: int

    @property
    def passed(self) -> bool:
        return not self.reasons


def model_turns(sampled: np.ndarray, prompt_len: int) -> list[tuple[int, int]]:
    """[start, end) of each run of sampled tokens after the prompt, in order."""
    mask = np.asarray(sampled, dtype=np.int8)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    spans = [(int(a), int(b)) for a, b in zip(edges[0::2], edges[1::2])]
    return [(a, b) for a, b in spans if a >= prompt_len]


def judge(
    protocol: Protocol,
    task: Any,
    seed: int,
    tokens: Sequence[int],
    sampled: Sequence[int],
    prompt_len: int,
    finish: int,
) -> Judgement:
    """Re-run the environment on the recorded sequence's sampled turns (module docstring)."""
    tokens = [int(t) for t in tokens]
    sampled = np.asarray(sampled, dtype=np.uint8)
    limits, stops = protocol.limits, protocol.stop_token_ids
    episode = protocol.env.start(task, int(seed))
    reasons: list[str] = []

    def done(reward: float | None, turns: int, env_tokens: int) -> Judgement:
        return Judgement(tuple(reasons), reward, turns, env_tokens)

    expected = protocol.first_prompt(episode)
    if tokens[:prompt_len] != expected or len(expected) != prompt_len:
        reasons.append(
            f"the first prompt ({prompt_len} tokens) is not the environment's ({len(expected)} tokens) for this "
            "task and seed"
        )
        return done(None, 0, 0)
    if len(tokens) > limits.max_total_tokens:
        reasons.append(f"{len(tokens)} tokens, more than max_total_tokens ({limits.max_total_tokens})")
        return done(None, 0, 0)
    spans = model_turns(sampled, prompt_len)
    if not spans or spans[0][0] != prompt_len or spans[-1][1] != len(tokens):
        reasons.append("the sequence does not start its first model turn right after the prompt and end with one")
        return done(None, 0, 0)
    if len(spans) > limits.max_turns:
        reasons.append(f"{len(spans)} model turns, more than max_turns ({limits.max_turns})")
        return done(None, len(spans), 0)
    env_total = 0
    for k, (a, b) in enumerate(spans):
        turn = tokens[a:b]
        cap = protocol.turn_cap(a)
        early = [j for j, t in enumerate(turn[:-1]) if t in stops]
        if early:
            reasons.append(
                f"model turn {k} holds stop token {turn[early[0]]} at its position {early[0]}, before its end"
            )
        if len(turn) > cap:
            reasons.append(f"model turn {k} has {len(turn)} tokens, more than its cap of {cap}")
        if turn[-1] not in stops and len(turn) != cap:
            reasons.append(f"model turn {k} ends without a stop token after {len(turn)} tokens, short of its cap {cap}")
        if reasons:
            return done(None, len(spans), env_total)
        messages, failure = protocol.respond(episode, protocol.decode(turn))
        env, why = protocol.next_turn(messages, turn, k, b) if failure is None else (None, failure)
        last = k == len(spans) - 1
        if last:
            if env is not None:
                reasons.append(
                    f"the episode ends after model turn {k}, but the environment answers it and the limits allow "
                    "another turn (ended early)"
                )
                return done(None, len(spans), env_total)
            break
        if env is None:
            reasons.append(f"the episode continues after model turn {k}, but it ends there: {why} (extended)")
            return done(None, len(spans), env_total)
        recorded = tokens[b : spans[k + 1][0]]
        env_total += len(recorded)
        if recorded != env:
            j = next((j for j, (x, y) in enumerate(zip(env, recorded)) if x != y), min(len(env), len(recorded)))
            reasons.append(
                f"environment turn {k} is not the environment's: {len(recorded)} tokens recorded, {len(env)} "
                f"rendered, first difference at its token {j} (recorded {recorded[j : j + _SHOWN]}, "
                f"rendered {env[j : j + _SHOWN]})"
            )
            return done(None, len(spans), env_total)
    want = FINISH_STOP if tokens[-1] in stops else FINISH_LENGTH
    if int(finish) != want:
        reasons.append(f"finish is {int(finish)}, the last model turn says {want}")
    rollout = Rollout([], [], 0, [], None, [])
    _score(rollout, episode, failure)
    return done(rollout.reward, len(spans), env_total)
