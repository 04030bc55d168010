"""`verifiers`: an environment written against the classic `verifiers` API (`MultiTurnEnv`, `ToolEnv`, `Rubric`),
played as our episodes.

Config (`data.env = "verifiers"`, `data.env_config`): `load` names a function returning a verifiers environment,
"package.module:function" (or "package.module", whose `load_environment` is called, the verifiers convention),
called once per process with `args` (a table of keyword arguments); `tool_calls` ("hermes", the default, or
"none"); `success_at` (1.0: an episode succeeds when its reward reaches it). The package is imported only here,
when a pool names this environment; it is the `verifiers` extra (`pip install -e ".[verifiers]" -c
constraints.txt`), pinned to 0.1.2.post1, the last release whose `import verifiers` needs no more than `datasets`
beyond what is installed already (0.1.3 on import `openai-agents`, 0.1.10 `prime-sandboxes` and its RPC stack;
0.2 and later pin `mcp` against ours, and 0.4.0 has only the new `verifiers.v1` API). Environments written for
later 0.1.x releases work where they use only what 0.1.2 has: their methods may be coroutines (they are awaited).

How a task becomes a verifiers row: `question` is the task's prompt, `answer` its answer ("" when it has none),
`task` its meta's "task" ("default"), `info` its meta's "info" when that is a table, else its whole meta. The first
prompt is the environment's own `format_prompt` of the question (its system prompt and few-shot messages, then
the question as a user message). The environment's `dataset` is not read: tasks come from the pool's data, as for
every environment (write the environment's rows to a task file to train on them).

The episode is verifiers' own rollout loop (`MultiTurnEnv.rollout` of 0.1.2) with the model's turns given: state
starts as {prompt, completion, answer, task, info, responses, turn} plus "seed" (the sample's seed, for an
environment that draws anything at random) and goes through `setup_state`; after each model turn the assistant
message is appended, `state["turn"]` counted, and the episode ends if `is_completed` says so or `turn` reached the
environment's `max_turns`; else `env_response(messages, state)` gives the next messages, which must be user or
tool messages with text content (the tool call id is kept in the messages the environment and the rubric see,
but the rendered turn is role and text). An environment that is complete before the first model turn still gets
one. `state["responses"]` holds a `ChatCompletion` per model turn as the chat API would have returned it (fixed
id and time, so it is the same on every node). The reward is the rubric's `score_rollout` (its weighted sum of
reward functions; reward functions that are coroutines are awaited) over the conversation as the tokens hold it:
when the protocol ends an episode the environment wanted to go on with (our `max_turns` or token limits), the
environment's unsent last messages are not scored.

Tool calls: the model writes text, so a tool call is text in the form models with tool-call chat templates are
trained on (`tool_calls = "hermes"`): a `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block. The
environment's tools (`oai_tools`, from the signatures and docstrings of ToolEnv's functions) are described in the
system message the model is shown (the environment and its rubric see the prompt without it, as the chat API
passes tools beside the messages). A model turn with such blocks becomes an assistant message with `tool_calls`
(ids call_<turn>_<i>) and the text before the first block as content, as vLLM's `hermes` tool parser would make
it; a turn with a block that is not such JSON has no tool calls (its whole text is the content). Tools run in
this process, not in the code sandbox: they must be pure functions of their arguments (a calculator, a lookup),
never run model-written code (use `python_tool` for that). Not reproduced: a model's own tool-call format when it
is not this one, the tool schemas as its chat template would render them, streaming, and the environment's
sampling arguments (the pool's sampling settings apply).

Determinism: a validator re-runs the environment on the worker's turns and needs the same messages byte for byte,
so an environment must not use the network, a model, the clock, the process id, files that differ between nodes,
or randomness other than `state["seed"]` and the global generators below. Refused when loaded: an environment
holding a model client (`client`) or scoring with a judge (`JudgeRubric`, a `judge_client`), or one that is not a
chat MultiTurnEnv. While its code runs (setup, completion checks, responses, tools, reward functions), opening or
binding a socket, resolving a host name, starting a process or forking raises `EnvironmentPolicyError` (an audit
hook, for the calling thread and the threads it hands coroutines to) and the episode scores 0 with that reason.
Python's `random` and numpy's global generator are seeded for each call from (task prompt, seed, call number) and
restored after, so an environment that draws from them without a seed is still deterministic. The clock and
threads the environment starts itself cannot be watched: those are the author's to avoid.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import hashlib
import importlib
import inspect
import json
import logging
import random
import re
import sys
import threading
from collections.abc import Mapping
from typing import Any

from gpu_workers.envs.base import Environment, EnvTurn, Episode, register
from gpu_workers.rewards.base import RewardResult

log = logging.getLogger(__name__)
PINNED = "0.1.2.post1"
INSTALL = 'pip install -e ".[verifiers]" -c constraints.txt'
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_BLOCKED = frozenset(
    {
        "socket.connect",
        "socket.bind",
        "socket.getaddrinfo",
        "socket.gethostbyname",
        "socket.gethostbyaddr",
        "socket.sendto",
        "subprocess.Popen",
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.fork",
        "os.forkpty",
    }
)
_GUARD: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("intellect_verifiers_guard", default=None)
_HOOKED = threading.Lock()
_hooked = False
_LOCAL = threading.local()


class VerifiersUnavailable(ImportError):
    """The verifiers package is missing, or is a release without the classic API."""


class EnvironmentPolicyError(RuntimeError):
    """A verifiers environment did something that would make it differ between nodes (network, processes)."""


def import_verifiers():
    """The `verifiers` module, or `VerifiersUnavailable` saying what to install."""
    try:
        import verifiers
    except ImportError as err:
        raise VerifiersUnavailable(
            f"data.env 'verifiers' needs the verifiers package ({PINNED}, its classic MultiTurnEnv/ToolEnv API): "
            f"{INSTALL} ({type(err).__name__}: {err})"
        ) from err
    if not hasattr(verifiers, "MultiTurnEnv"):
        raise VerifiersUnavailable(
            f"verifiers {getattr(verifiers, '__version__', '?')} is installed, but it has no classic MultiTurnEnv "
            f"(releases from 0.2 moved it, 0.4.0 removed it); install the pinned release: {INSTALL}"
        )
    return verifiers


def _audit(event: str, args: Any) -> None:
    guard = _GUARD.get()
    if guard is None or event not in _BLOCKED:
        return
    guard.append(event)
    raise EnvironmentPolicyError(
        f"a verifiers environment may not use the network or start processes (it did: {event}); its output "
        "would differ between a worker and a validator"
    )


def _install_hook() -> None:
    global _hooked
    with _HOOKED:
        if not _hooked:
            sys.addaudithook(_audit)
            _hooked = True


def _loop() -> asyncio.AbstractEventLoop:
    loop = getattr(_LOCAL, "loop", None)
    if loop is None or loop.is_closed():
        loop = _LOCAL.loop = asyncio.new_event_loop()
    return loop


def _resolve(value: Any) -> Any:
    """`value`, or what it gives when awaited (run on this thread's private loop; on a helper thread, with the
    caller's context, when this thread already runs a loop)."""
    if not inspect.isawaitable(value):
        return value

    async def wait():
        return await value

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _loop().run_until_complete(wait())
    from concurrent.futures import ThreadPoolExecutor

    context = contextvars.copy_context()
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(context.run, lambda: _loop().run_until_complete(wait())).result()


def load(spec: Any, args: Any):
    """Call the load function `spec` ("module:function" or "module") with `args`; ValueError naming what is
    wrong."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(
            'data.env_config.load: expected "package.module:function" (a function returning a verifiers '
            f"environment), got {spec!r}"
        )
    if args is None:
        args = {}
    if not isinstance(args, Mapping):
        raise ValueError(f"data.env_config.args: expected a table of keyword arguments, got {args!r}")
    module_name, _, attr = spec.strip().partition(":")
    attr = attr or "load_environment"
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"data.env_config.load {spec!r}: cannot import {module_name!r}: {err}") from err
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"data.env_config.load {spec!r}: module {module_name!r} has no function {attr!r}")
    try:
        return fn(**dict(args))
    except Exception as err:
        raise ValueError(f"data.env_config.load {spec!r} raised {type(err).__name__}: {err}") from err


def check_environment(env: Any, vf) -> None:
    """Refuse what cannot be a deterministic chat episode here (ValueError naming it)."""
    if not isinstance(env, vf.MultiTurnEnv):
        raise ValueError(
            f"data.env_config.load returned {type(env).__name__}, not a verifiers MultiTurnEnv (or ToolEnv, "
            "SingleTurnEnv)"
        )
    if getattr(env, "message_type", "chat") != "chat":
        raise ValueError(
            f"verifiers environment {type(env).__name__} has message_type {env.message_type!r}: only chat "
            "environments can be played as episodes"
        )
    if getattr(env, "client", None) is not None:
        raise ValueError(
            f"verifiers environment {type(env).__name__} holds a model client: an environment that calls a model "
            "or a service cannot be re-run by a validator"
        )
    rubrics, seen = [getattr(env, "rubric", None)], []
    while rubrics:
        rubric = rubrics.pop()
        if rubric is None or any(rubric is r for r in seen):
            continue
        seen.append(rubric)
        if getattr(rubric, "judge_client", None) is not None or type(rubric).__name__ == "JudgeRubric":
            raise ValueError(
                f"verifiers environment {type(env).__name__} scores with a judge model ({type(rubric).__name__}): "
                "a validator cannot recompute a reward that calls a model over the network"
            )
        rubrics.extend(getattr(rubric, "rubrics", None) or [])


def tool_prompt(tools: list[dict]) -> str:
    """The system message's description of the environment's tools and of the tool-call format."""
    lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "You can call functions. Their JSON schemas are listed between <tools> and </tools>:\n"
        f"<tools>\n{lines}\n</tools>\n"
        "To call one, write a JSON object with its name and arguments between <tool_call> and </tool_call>, "
        'e.g. <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>, and end your turn: the result comes '
        "back as a tool message. When you need no more calls, give your answer without a <tool_call> block."
    )


def parse_tool_calls(text: str) -> tuple[str, list[tuple[str, str]]] | None:
    """(content, [(name, arguments as JSON)]) of a model turn with `<tool_call>` blocks, None without any or when
    one is not a JSON object with a string "name" and an object "arguments" (then it is plain text)."""
    blocks = _TOOL_CALL.findall(text)
    if not blocks:
        return None
    calls = []
    for block in blocks:
        try:
            call = json.loads(block)
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        calls.append((call["name"], json.dumps(arguments, ensure_ascii=False)))
    return text[: text.find("<tool_call>")], calls


@register
class Verifiers(Environment):
    """A classic verifiers environment (module docstring); config: load, args, tool_calls, success_at."""

    name = "verifiers"

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        unknown = sorted(set(self.config) - {"load", "args", "tool_calls", "success_at"})
        if unknown:
            raise ValueError(
                f"data.env_config: environment 'verifiers' has no setting {unknown}; its settings: load, args, "
                "tool_calls, success_at"
            )
        self.tool_format = self.config.get("tool_calls", "hermes")
        if self.tool_format not in ("hermes", "none"):
            raise ValueError(f"data.env_config.tool_calls: expected 'hermes' or 'none', got {self.tool_format!r}")
        self.success_at = float(self.config.get("success_at", 1.0))
        self.vf = import_verifiers()
        _install_hook()
        guard: list[str] = []
        token = _GUARD.set(guard)
        try:
            env = load(self.config.get("load"), self.config.get("args"))
        except EnvironmentPolicyError as err:
            raise ValueError(f"data.env_config.load {self.config.get('load')!r}: {err}") from err
        finally:
            _GUARD.reset(token)
        check_environment(env, self.vf)
        self.env = env
        self.tools = list(getattr(env, "oai_tools", None) or []) if self.tool_format == "hermes" else []

    def start(self, task, seed: int) -> Episode:
        return VerifiersEpisode(self, task, int(seed))


class VerifiersEpisode(Episode):
    """One task's episode of a verifiers environment (module docstring)."""

    def __init__(self, owner: Verifiers, task, seed: int):
        self.owner, self.env, self.vf = owner, owner.env, owner.vf
        self.seed, self.calls, self.violations = seed, 0, []
        self._seed_base = f"intellect-verifiers/v1|{task.prompt}|{seed}"
        meta = dict(task.meta or {})
        info = meta["info"] if isinstance(meta.get("info"), dict) else {k: v for k, v in meta.items() if k != "task"}
        self.answer, self.task_name = task.answer or "", str(meta.get("task", "default"))
        self.info = copy.deepcopy(info)
        prompt = self._call(self.env.format_prompt, task.prompt, self.env.system_prompt, self.env.few_shot)
        self.prompt = _check_messages(prompt, "format_prompt", roles=("system", "user", "assistant"))
        # what the model is shown: the prompt, and the tools (which the chat API would pass beside it)
        self.shown = _with_tools(self.prompt, tool_prompt(self.owner.tools)) if self.owner.tools else self.prompt
        state = {
            "prompt": copy.deepcopy(self.prompt),
            "completion": [],
            "answer": self.answer,
            "task": self.task_name,
            "info": self.info,
            "responses": [],
            "turn": 0,
            "seed": seed,
        }
        self.state = self._call(self.env.setup_state, state)
        self.messages = copy.deepcopy(self.prompt)
        self.completion: list[dict] = []
        self.done_before_start = bool(self._call(self.env.is_completed, self.messages, self.state))
        self.pending: list[dict] | None = None  # the environment's messages after the last turn (not yet shown)
        self.state_before_pending: dict | None = None
        self.scored: RewardResult | None = None

    @contextlib.contextmanager
    def _guarded(self):
        self.calls += 1
        digest = hashlib.sha256(f"{self._seed_base}|{self.calls}".encode()).digest()
        import numpy as np

        saved, saved_np = random.getstate(), np.random.get_state()
        random.seed(int.from_bytes(digest[:8], "big"))
        np.random.seed(int.from_bytes(digest[8:12], "big"))
        token = _GUARD.set(self.violations)
        try:
            yield
        finally:
            _GUARD.reset(token)
            random.setstate(saved)
            np.random.set_state(saved_np)

    def _call(self, fn, *args, **kwargs):
        with self._guarded():
            result = _resolve(fn(*args, **kwargs))
        self._check_policy()
        return result

    def _check_policy(self) -> None:
        if self.violations:
            raise EnvironmentPolicyError(
                f"the verifiers environment used {', '.join(sorted(set(self.violations)))}: environments may not "
                "use the network or start processes (their outputs would differ between nodes)"
            )

    def prompt_messages(self) -> list[dict[str, str]]:
        return [dict(m) for m in self.shown]

    def _assistant(self, text: str) -> dict:
        turn = self.state["turn"]
        message: dict[str, Any] = {"role": "assistant", "content": text}
        parsed = parse_tool_calls(text) if self.owner.tools else None
        calls = []
        if parsed is not None:
            from verifiers.types import ChatCompletionMessageToolCall

            content, found = parsed
            calls = [
                ChatCompletionMessageToolCall(
                    id=f"call_{turn}_{i}", type="function", function={"name": name, "arguments": arguments}
                )
                for i, (name, arguments) in enumerate(found)
            ]
            message = {"role": "assistant", "content": content, "tool_calls": calls}
        self.state["responses"].append(_completion(turn, message, calls))
        return message

    def respond(self, model_text: str) -> list[EnvTurn] | None:
        self.pending = self.state_before_pending = None  # called again: the protocol showed the last answer
        message = self._assistant(model_text)
        self.messages.append(message)
        self.completion.append(message)
        self.state["turn"] += 1
        if self.done_before_start:
            return None
        if self._call(self.env.is_completed, self.messages, self.state):  # asked first, as verifiers' loop does
            return None
        max_turns = getattr(self.env, "max_turns", -1)
        if isinstance(max_turns, int) and 0 < max_turns <= self.state["turn"]:
            return None
        try:
            before = copy.deepcopy(self.state)
        except Exception:  # an uncopyable state is scored as it ends up
            before = None
        answer = self._call(self.env.env_response, self.messages, self.state)
        if not (isinstance(answer, tuple) and len(answer) == 2):
            raise TypeError(f"env_response must return (messages, state), got {type(answer).__name__}")
        env_messages, state = answer
        env_messages = _check_messages(env_messages, "env_response", roles=("user", "tool"))
        if not env_messages:
            raise ValueError("env_response returned no messages: the next model turn would follow its own turn")
        if isinstance(state, dict):
            self.state = state
        self.messages += env_messages
        self.completion += env_messages
        self.pending, self.state_before_pending = env_messages, before
        return [EnvTurn(m["content"], role=m["role"]) for m in env_messages]

    def reward(self) -> RewardResult:
        """The rubric's score, computed once (the episode has ended; `success` asks again)."""
        if self.scored is None:
            self.scored = self._reward()
        return self.scored

    def _reward(self) -> RewardResult:
        completion, state = list(self.completion), self.state
        if self.pending is not None:  # the protocol ended the episode: the last messages were never shown
            completion = completion[: len(completion) - len(self.pending)]
            state = self.state_before_pending if self.state_before_pending is not None else state
        rubric = self.env.rubric
        score = self._call(
            _score, rubric, self.prompt, completion, self.answer, state, self.task_name, self.info, self.vf
        )
        metrics = ", ".join(f"{k}={float(v):g}" for k, v in score.metrics.items())
        return RewardResult(float(score.reward), f"verifiers rubric: {metrics}" if metrics else None)

    def success(self) -> bool:
        return self.reward().value >= self.owner.success_at


def _check_messages(messages: Any, where: str, roles: tuple[str, ...]) -> list[dict]:
    if not isinstance(messages, list):
        raise TypeError(f"verifiers {where} must give a list of chat messages, got {type(messages).__name__}")
    out = []
    for m in messages:
        if not isinstance(m, Mapping) or m.get("role") not in roles or not isinstance(m.get("content"), str):
            raise ValueError(
                f"verifiers {where} gave {m!r}: expected messages with role {' or '.join(roles)} and text content"
            )
        out.append(dict(m))
    return out


def _with_tools(prompt: list[dict], tools_text: str) -> list[dict]:
    prompt = [dict(m) for m in prompt]
    if prompt and prompt[0].get("role") == "system":
        prompt[0]["content"] = f"{prompt[0]['content']}\n\n{tools_text}"
        return prompt
    return [{"role": "system", "content": tools_text}] + prompt


def _completion(turn: int, message: dict, calls: list):
    """The ChatCompletion the chat API would have returned for a model turn (fixed id, time and model name)."""
    from verifiers.types import ChatCompletion

    return ChatCompletion.model_validate(
        {
            "id": f"intellect-turn-{turn}",
            "object": "chat.completion",
            "created": 0,
            "model": "intellect",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "tool_calls" if calls else "stop",
                    "message": {
                        "role": "assistant",
                        "content": message["content"] or None,
                        "tool_calls": [c.model_dump() for c in calls] or None,
                    },
                }
            ],
        }
    )


async def _score(rubric, prompt, completion, answer, state, task, info, vf):
    """The rubric's score of one rollout: its own `score_rollout` unless it is the base Rubric's, which is run
    here with each reward function's result awaited when it is a coroutine (0.1.2's does not await them)."""
    if type(rubric).score_rollout is not vf.Rubric.score_rollout:
        return await _await(rubric.score_rollout(prompt, completion, answer, state, task=task, info=info))
    values = []
    for func in rubric.get_reward_funcs():
        value = await rubric.call_reward_func(
            func=func,
            parser=rubric.parser,
            prompt=prompt,
            completion=completion,
            answer=answer,
            state=state,
            task=task,
            info=info,
        )
        try:
            value = await _await(value)
        except EnvironmentPolicyError:
            raise
        except Exception as err:  # as verifiers does for a reward function that raises: 0
            log.error("verifiers reward function %s raised %s: %s", func.__name__, type(err).__name__, err)
            value = 0.0
        values.append(value)
    from verifiers.types import RolloutScore

    return RolloutScore(
        reward=sum(v * w for v, w in zip(values, rubric.get_reward_weights())),
        metrics={f.__name__: v for f, v in zip(rubric.get_reward_funcs(), values)},
    )


async def _await(value):
    return await value if inspect.isawaitable(value) else value
