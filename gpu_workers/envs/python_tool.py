"""`python_tool`: a math task with a sandboxed Python interpreter as a tool.

The first prompt is the task's prompt and the rules: a reply holding a ```python code block is a tool call, the
block's program is run in the code sandbox (`gpu_workers.rewards.code`: bubblewrap, no network, no host files,
one process, CPU, memory, output and wall-clock limits) and what it printed comes back as a tool turn (role
"tool"; an error or a limit as "error: ..."); a reply without a code block is the final answer, which ends the
episode and is scored by the task's own reward (`math` for arithmetic). An episode that ends by a limit
without a final answer scores 0.

The tool output is a pure function of the program (the sandbox shows the program the same empty filesystem,
the same Python and the same path on every node), so a validator re-running the program gets the same bytes.
Two caveats: a program near a time limit may hit it on one machine and not on another (its output then
differs and the batch is rejected), and without the sandbox (`data.allow_unsandboxed_code`, trusted pools
only) error messages name a scratch directory that differs per run, so this environment requires the
sandbox. Config: `timeout_s` (2), `memory_mb` (256), `max_output_chars` (1000).
"""

from __future__ import annotations

import re

from gpu_workers.envs.base import Demonstration, Environment, EnvTurn, Episode, register
from gpu_workers.rewards import score
from gpu_workers.rewards.base import RewardResult

_BLOCK = re.compile(r"```(?:python|py)\s*\n(.*?)```", re.DOTALL)
RULES = (
    "You may run Python: write a program in a ```python code block and its printed output will be shown to you. "
    "When you know the answer, reply with the answer alone, without a code block."
)


def tool_program(text: str) -> str | None:
    """The program of a tool call: the last ```python block of a model turn (None: the turn is an answer)."""
    blocks = _BLOCK.findall(text)
    return blocks[-1] if blocks else None


@register
class PythonTool(Environment):
    """A math task with a sandboxed Python tool (module docstring)."""

    name = "python_tool"

    def start(self, task, seed: int) -> Episode:
        return _ToolEpisode(task, self.config)

    def uses_sandbox(self) -> bool:
        return True


class _ToolEpisode(Episode):
    def __init__(self, task, config):
        from gpu_workers.rewards.code import Limits

        self.task, self.answer = task, None
        timeout = float(config.get("timeout_s", 2.0))
        self.limits = Limits(
            cpu_s=max(1, int(timeout)), memory_mb=int(config.get("memory_mb", 256)), wall_s=2 * timeout + 3.0
        )
        self.max_chars = int(config.get("max_output_chars", 1000))
        self.calls = 0

    def prompt_messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"{self.task.prompt}\n\n{RULES}"}]

    def respond(self, model_text: str) -> EnvTurn | None:
        program = tool_program(model_text)
        if program is None:
            self.answer = model_text
            return None
        from gpu_workers.rewards.code import run_test

        self.calls += 1
        ok, out = run_test(program, "", self.limits)
        text = out if ok else f"error: {out}"
        if len(text) > self.max_chars:
            text = text[: self.max_chars] + "\n[output truncated]"
        return EnvTurn(text.rstrip("\n") or "(no output)", role="tool")

    def reward(self) -> RewardResult:
        if self.answer is None:
            return RewardResult(0.0, f"no final answer after {self.calls} tool calls")
        return score(self.task, self.answer)

    def demonstration(self) -> list[Demonstration] | None:
        meta = self.task.meta or {}
        if self.task.answer is None or not {"a", "b", "op"} <= set(meta):
            return None
        return [
            Demonstration(f"```python\nprint({meta['a']} {meta['op']} {meta['b']})\n```"),
            Demonstration(str(self.task.answer)),
        ]
