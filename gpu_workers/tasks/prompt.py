"""Turning a task into the tokens a worker generates from: the chat template and the length target.

INTELLECT-2 asked for a thinking budget in the prompt ("Think for T tokens before giving a response.") with
T drawn from a configured list, and rewarded staying near it. The target of a sample is drawn from its
sampling seed, so the validator, which knows the seed, knows which target the worker had to use.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpu_workers.tasks.dataset import Task

LENGTH_SUFFIX = "Think for {target} tokens before giving a response."


def length_target(targets: Sequence[int], seed: int) -> int:
    """The thinking-length target of the sample with this seed (0: no target configured)."""
    if not targets:
        return 0
    return int(targets[seed % len(targets)])


def prompt_text(task: Task, target: int = 0) -> str:
    return task.prompt if target <= 0 else f"{task.prompt}\n\n{LENGTH_SUFFIX.format(target=target)}"


def prompt_tokens(task: Task, tokenizer, target: int = 0, system: str | None = None) -> list[int]:
    """Token ids of the chat-templated prompt (with the generation prompt), via the tokenizer's template."""
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt_text(task, target)})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # some tokenizers return a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]
