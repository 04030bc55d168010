"""Environment turns as tokens, appended to the exact previous sequence (never re-rendering earlier turns).

A multi-turn rollout is one token sequence: the first prompt (the chat template over the episode's first
messages, with the generation prompt), then each model turn exactly as sampled, then each environment turn's
tokens, and so on. Re-rendering the whole conversation with the chat template after every turn, as chat APIs
do, would re-tokenize the model's earlier turns (their text may tokenize otherwise than the tokens sampled)
and let templates rewrite them (Qwen3 drops earlier `<think>` blocks): the tokens trained on would not be the
ones sampled. So only the new environment turn is rendered, and its tokens are appended.

`TurnRenderer.env_tokens(messages, stop_token)` is the text the chat template writes between the end of an
assistant turn's content and the start of the next assistant turn's content, around `messages`, tokenized on
its own (`add_special_tokens=False`): the template is rendered over a fixed placeholder conversation (a user
turn and an assistant turn), once closed and once followed by `messages` and the generation prompt, and the
difference is taken as a string. The assistant turn's closing text (ChatML: `<|im_end|>` then a newline) is
where the model stopped: the text of the stop token the model sampled is taken off its front when it starts
with it (the model wrote it), and the rest (the newline) opens the environment turn. A model turn that ended
without a stop token ends the episode, so it is never followed by an environment turn.

An environment turn's text is text, whatever it holds: a tool's output or a verifiers environment's message that
contains the string of one of the tokenizer's added tokens (`<|im_end|>`, `<|im_start|>`, `<tool_call>`) would
otherwise be tokenized as that token, and a program's print could close the tool turn and open a fake assistant
turn the model then reads as its own. Each such string in a message's content gets a zero-width space (U+200B)
after its first character before rendering, so it tokenizes as ordinary text (`plain_text`); only the template's
own wrapper yields added tokens. The environment and its reward see the content unchanged.

The rule is a pure function of (tokenizer, chat template, messages, stop token), so a worker and a validator
with the same tokenizer get the same tokens byte for byte. A template that renders the placeholder
conversation so that a prefix changes when more follows (it rewrites earlier turns) is refused with
`RenderError` naming what differed: no rule of this kind can append to it.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpu_workers.envs.base import EnvTurn

_USER, _ASSISTANT = "Question?", "Answer."
_ZWSP = "\u200b"


def plain_text(text: str, added: Sequence[str]) -> str:
    """`text` with every occurrence of an added token's string in `added` (longest first) broken by a zero-width
    space after its first character, so that a tokenizer reads it as ordinary text (module docstring)."""
    for token in added:
        if token in text:
            text = text.replace(token, token[0] + _ZWSP + token[1:])
    return text


class RenderError(ValueError):
    """The chat template cannot be rendered turn by turn (it rewrites earlier turns, or refuses a role)."""


class TurnRenderer:
    """The first prompt and each environment turn of an episode as token ids, for one tokenizer."""

    def __init__(self, tokenizer, system_prompt: str | None = None):
        self.tokenizer, self.system_prompt = tokenizer, system_prompt
        head = [{"role": "user", "content": _USER}]
        self._placeholder = head + [{"role": "assistant", "content": _ASSISTANT}]
        opened = self._render(head, generation_prompt=True)
        self._closed = self._render(self._placeholder, generation_prompt=False)
        if not self._closed.startswith(opened + _ASSISTANT):
            raise RenderError(
                "the chat template does not render an assistant turn as the generation prompt followed by its "
                f"content: {self._closed[-200:]!r} does not continue {opened[-200:]!r}"
            )
        self.close = self._closed[len(opened) + len(_ASSISTANT) :]
        """What the template writes after an assistant turn's content (ChatML: "<|im_end|>\\n")."""
        self._cache: dict[tuple[tuple[tuple[str, str], ...], int | None], list[int]] = {}
        self._added = sorted((t for t in tokenizer.get_added_vocab() if len(t) > 1), key=len, reverse=True)
        """The strings the tokenizer splits out as added tokens, longest first (`plain_text`)."""

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
        except Exception as err:  # jinja raises for roles or orders a template refuses
            raise RenderError(f"the chat template refuses {[m['role'] for m in messages]}: {err}") from err
        if not isinstance(text, str):
            raise RenderError(f"the chat template rendered {type(text).__name__}, not text")
        return text

    def first_prompt(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The episode's first prompt: `data.system_prompt` (when set and the episode brings none) and its
        messages, rendered with the generation prompt, as token ids."""
        messages = list(messages)
        if self.system_prompt and not (messages and messages[0]["role"] == "system"):
            messages = [{"role": "system", "content": self.system_prompt}] + messages
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as err:
            raise RenderError(f"the chat template refuses the first prompt's messages: {err}") from err
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # some tokenizers return a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def env_text(self, messages: Sequence[EnvTurn], stop_token: int | None) -> str:
        """The text of the environment turn after a model turn that ended with `stop_token` (module docstring)."""
        turns = [{"role": m.role, "content": plain_text(m.text, self._added)} for m in messages]
        full = self._render(self._placeholder + turns, generation_prompt=True)
        if not full.startswith(self._closed):
            raise RenderError(
                "the chat template rewrites the conversation before a new turn (it cannot be rendered turn by "
                f"turn): {full[: len(self._closed)][-200:]!r} != {self._closed[-200:]!r}"
            )
        tail = self.close
        if stop_token is not None:
            stop_text = self.tokenizer.decode([int(stop_token)], skip_special_tokens=False)
            if stop_text and tail.startswith(stop_text):
                tail = tail[len(stop_text) :]
        return tail + full[len(self._closed) :]

    def env_tokens(self, messages: Sequence[EnvTurn], stop_token: int | None) -> list[int]:
        """The token ids of `env_text`, tokenized on their own (no special tokens added)."""
        key = (tuple((m.role, m.text) for m in messages), None if stop_token is None else int(stop_token))
        if key not in self._cache:
            if len(self._cache) > 4096:
                self._cache.clear()
            text = self.env_text(messages, stop_token)
            self._cache[key] = [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]
        return list(self._cache[key])

    def turn_tokens(self, text: str, stop_token: int) -> list[int]:
        """A model turn written as text (a demonstration for a warm start): its tokens, then `stop_token`."""
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)] + [int(stop_token)]
