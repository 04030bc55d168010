"""The warm start of a multi-turn pool (`intellect.sft_cli.build_examples` with `data.env`): each example is the
environment's demonstration played through the episode protocol, so its tokens are exactly what the protocol
renders; the loss mask covers exactly the trained model turns. Both are checked against references built here
from the chat template alone (the whole conversation rendered at once, and each trained turn's span found by
rendering the conversation up to it)."""

from __future__ import annotations

import pytest

from bridge.rollouts import FINISH_STOP
from gpu_workers.envs import REGISTRY, Environment, Episode
from gpu_workers.rewards.base import RewardResult
from intellect.config import ConfigError
from intellect.config_io import load_config

FEEDBACK = "That is not right. Try again."  # the retry environment's default answer to a wrong attempt


def _cfg(model, *extra):
    args = ["--model.path", str(model), "--data.task", "sort", "--data.digits", "4", "--data.num_tasks", "60"]
    args += ["--data.eval_tasks", "0", "--data.env", "retry", "--data.max_turns", "3", "--data.max_new_tokens", "12"]
    args += ["--data.max_env_tokens", "32", "--data.max_episode_tokens", "128", "--model.max_seq_len", "128"]
    args += ["--data.max_prompt_len", "48"]
    return load_config(None, [*args, *extra])


def _ids(out):
    return [int(t) for t in (out["input_ids"] if isinstance(out, dict) or hasattr(out, "input_ids") else out)]


def test_retry_examples_are_the_protocol_rendering_and_train_only_the_right_answers(tiny_model):
    from transformers import AutoTokenizer

    from gpu_workers.checks import stop_token_ids
    from gpu_workers.config import episode_limits
    from gpu_workers.envs.episode import Protocol, judge
    from gpu_workers.envs.loading import load_environment
    from intellect.sft_cli import build_examples
    from intellect.tasks_setup import training_tasks

    model = tiny_model(family="qwen2")
    tok = AutoTokenizer.from_pretrained(model)
    stops = stop_token_ids(model)
    im_end = int(tok.convert_tokens_to_ids("<|im_end|>"))
    cfg = _cfg(model)
    tasks = training_tasks(cfg.data)
    examples = build_examples(cfg, tok, stops)
    assert len(examples) == len(tasks)
    protocol = Protocol.for_tokenizer(load_environment("retry"), tok, episode_limits(cfg.worker, cfg.data), stops)
    with_context = 0
    for task, (prompt, rest, mask) in zip(tasks, examples, strict=True):
        tokens = prompt + rest
        assert len(mask) == len(rest) and set(mask) <= {0, 1}
        # the conversation the example holds, read back from its text: attempts, each but the last answered
        text = tok.decode(rest, skip_special_tokens=False)
        attempts = [a.split("<|im_end|>")[0] for a in text.split("<|im_start|>assistant\n")]
        assert attempts[-1] == task.answer and all(a != task.answer for a in attempts[:-1]) and len(attempts) <= 2
        messages = [{"role": "user", "content": task.prompt}]
        for i, attempt in enumerate(attempts):
            messages.append({"role": "assistant", "content": attempt})
            if i < len(attempts) - 1:
                messages.append({"role": "user", "content": FEEDBACK})
        # tokens: the whole conversation rendered at once, up to the last turn's <|im_end|>
        whole = _ids(tok.apply_chat_template(messages, tokenize=True))
        end = max(i for i, t in enumerate(whole) if t == im_end) + 1
        assert tokens == whole[:end]
        assert prompt == _ids(tok.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=True))
        # mask: 1 from where the template opens the last assistant turn to its <|im_end|>, nothing else
        start = len(_ids(tok.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=True)))
        expected = [0] * start + [1] * (end - start)
        assert [0] * len(prompt) + mask == expected
        with_context += len(attempts) == 2
        # and a validator re-running the environment on it, as if a worker had sampled every attempt (each from
        # where the template opens its turn to its <|im_end|>), finds nothing wrong and scores it solved
        spans = []
        for i in range(len(attempts)):
            a = len(_ids(tok.apply_chat_template(messages[: 2 * i + 1], add_generation_prompt=True, tokenize=True)))
            b = len(_ids(tok.apply_chat_template(messages[: 2 * i + 2], tokenize=True))) - 1
            spans.append((a, b))
        sampled = [int(any(a <= j < b for a, b in spans)) for j in range(len(tokens))]
        verdict = judge(protocol, task, 0, tokens, sampled, len(prompt), finish=FINISH_STOP)
        assert verdict.passed and verdict.reward == 1.0 and verdict.turns == len(attempts), verdict
    assert 15 <= with_context <= 45, with_context  # demo_wrong 0.5 of 60 tasks, drawn from the seeds


def test_an_environment_without_demonstrations_is_named(tiny_model):
    from transformers import AutoTokenizer

    from gpu_workers.checks import stop_token_ids
    from intellect.sft_cli import build_examples

    class _Plain(Episode):
        def prompt_messages(self):
            return [{"role": "user", "content": "hi"}]

        def respond(self, model_text):
            return None

        def reward(self):
            return RewardResult(0.0)

    class NoDemo(Environment):
        name = "no_demo_for_test"

        def start(self, task, seed):
            return _Plain()

    model = tiny_model(family="qwen2")
    tok = AutoTokenizer.from_pretrained(model)
    REGISTRY[NoDemo.name] = NoDemo
    try:
        cfg = _cfg(model, "--data.env", NoDemo.name)
        with pytest.raises(
            ConfigError, match="environment 'no_demo_for_test' gives no demonstration of training task 0"
        ):
            build_examples(cfg, tok, stop_token_ids(model))
    finally:
        del REGISTRY[NoDemo.name]
