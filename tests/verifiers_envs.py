"""Small environments written against verifiers' classic API (0.1.2), for tests/unit/gpu_workers/test_verifiers_env.py.

They are what a user's environment package holds: a `load_environment`-style function returning a MultiTurnEnv or
ToolEnv over an in-memory dataset, a rubric of reward functions. None of them needs a network, except the ones
that try to and must be refused.
"""

from __future__ import annotations

import random
import re
import socket
import subprocess

import verifiers as vf
from datasets import Dataset

_INT = re.compile(r"-?\d+")


def _rows() -> Dataset:
    return Dataset.from_list([{"question": "Guess my number.", "answer": "5"}])


def _last_guess(messages) -> int | None:
    for m in reversed(messages):
        if m["role"] == "assistant":
            found = _INT.findall(m["content"])
            return int(found[-1]) if found else None
    return None


class GuessEnv(vf.MultiTurnEnv):
    """Guess the task's answer; each wrong guess is answered "Too high." / "Too low." (with a hint drawn from the
    unseeded global `random`, when `hints` is set)."""

    def __init__(self, hints: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.hints = hints

    def setup_state(self, state, **kwargs):
        state["guesses"] = []
        return state

    def is_completed(self, messages, state, **kwargs) -> bool:
        return messages[-1]["role"] == "assistant" and _last_guess(messages) == int(state["answer"])

    def env_response(self, messages, state, **kwargs):
        guess = _last_guess(messages)
        state["guesses"].append(guess)
        if guess is None:
            text = "Please answer with a number."
        else:
            text = "Too high." if guess > int(state["answer"]) else "Too low."
        if self.hints:
            text += f" (hint {random.randint(0, 10**9)})"
        return [{"role": "user", "content": text}], state


def correct(completion, answer, **kwargs) -> float:
    return 1.0 if _last_guess(completion) == int(answer) else 0.0


def few_turns(completion, state, **kwargs) -> float:
    return 1.0 / max(1, state["turn"])


def env_replies(completion, **kwargs) -> float:
    return float(sum(m["role"] == "user" for m in completion))


def logged_guesses(state, **kwargs) -> float:
    return float(len(state["guesses"]))


def load_guess(max_turns: int = 6, hints: bool = False, system_prompt: str | None = "Answer with one number."):
    rubric = vf.Rubric(funcs=[correct, few_turns, env_replies, logged_guesses], weights=[1.0, 0.5, 0.01, 0.001])
    return GuessEnv(hints=hints, dataset=_rows(), system_prompt=system_prompt, rubric=rubric, max_turns=max_turns)


async def async_correct(completion, answer, **kwargs) -> float:
    return correct(completion, answer)


def load_async_reward():
    return GuessEnv(dataset=_rows(), rubric=vf.Rubric(funcs=[async_correct, few_turns], weights=[1.0, 0.25]))


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a (int): the first
        b (int): the second
    """
    return a + b


def capital(country: str) -> str:
    """The capital of a country.

    Args:
        country (str): the country's name
    """
    return {"france": "Paris", "japan": "Tokyo"}[country.lower()]


def tool_answer(completion, answer, **kwargs) -> float:
    last = [m for m in completion if m["role"] == "assistant"][-1]
    return 1.0 if answer in last["content"] else 0.0


def load_tools(max_turns: int = 5):
    rubric = vf.Rubric(funcs=[tool_answer, vf.ToolRubric(tools=[add, capital]).total_tool_calls], weights=[1.0, 0.1])
    return vf.ToolEnv(tools=[add, capital], dataset=_rows(), rubric=rubric, max_turns=max_turns)


def shell(command: str) -> str:
    """Run a shell command.

    Args:
        command (str): the command
    """
    return subprocess.run(command, shell=True, capture_output=True, text=True).stdout


def load_shell_tool():
    return vf.ToolEnv(tools=[shell], dataset=_rows(), max_turns=3)


class NetworkEnv(GuessEnv):
    """Asks a server for its answer to every turn (what a validator could never re-run)."""

    def __init__(self, port: int, **kwargs):
        super().__init__(**kwargs)
        self.port = port

    def env_response(self, messages, state, **kwargs):
        with socket.create_connection(("127.0.0.1", self.port), timeout=1) as conn:
            conn.sendall(b"hello")
        return super().env_response(messages, state, **kwargs)


def load_network(port: int):
    return NetworkEnv(port=port, dataset=_rows(), rubric=vf.Rubric(funcs=[correct]))


def load_with_client():
    from openai import AsyncOpenAI

    return GuessEnv(dataset=_rows(), client=AsyncOpenAI(api_key="x", base_url="http://127.0.0.1:9"))


def load_judge():
    from openai import OpenAI

    return GuessEnv(
        dataset=_rows(), rubric=vf.JudgeRubric(judge_client=OpenAI(api_key="x", base_url="http://127.0.0.1:9"))
    )


def load_completion_env():
    return GuessEnv(dataset=Dataset.from_list([{"prompt": "Guess: ", "answer": "5"}]), message_type="completion")


def load_not_an_env():
    return {"dataset": _rows()}


def load_broken():
    raise RuntimeError("this environment cannot be built")
