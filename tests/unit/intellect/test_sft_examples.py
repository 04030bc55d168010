"""The warm start's examples for a length-target recipe (`intellect.sft_cli.build_examples`): prompts state a
target as workers do, completions write the answer on k lines, and the two are drawn independently, so the warm
start gives RL lengths to choose from without telling it which length a target wants."""

from __future__ import annotations

import collections

from intellect.config_io import load_config


def test_warm_start_examples_draw_target_and_line_count_independently(tiny_model):
    from transformers import AutoTokenizer

    from gpu_workers.checks import stop_token_ids
    from intellect.sft_cli import build_examples
    from intellect.tasks_setup import training_tasks

    model = tiny_model(family="qwen2")
    tok = AutoTokenizer.from_pretrained(model)
    stops = stop_token_ids(model)
    common = ["--data.task", "sort", "--data.digits", "3", "--data.num_tasks", "480", "--data.eval_tasks", "0"]
    common += ["--data.max_new_tokens", "24", "--model.path", str(model)]
    cfg = load_config(None, [*common, "--data.length_targets", "[6, 12, 18]", "--run.sft_think_lines", "[1, 2, 3, 4]"])
    tasks = training_tasks(cfg.data)
    pairs = collections.Counter()
    for task, (prompt, completion) in zip(tasks, build_examples(cfg, tok, stops), strict=True):
        text = tok.decode(prompt)
        target = int(text.split("Think for ")[1].split(" tokens")[0])
        assert text.startswith(f"<|im_start|>user\n{task.prompt}\n\nThink for {target} tokens before")
        assert completion[-1] in stops and not set(completion[:-1]) & stops
        lines = tok.decode(completion[:-1]).split("\n")
        assert set(lines) == {task.answer}
        assert len(completion) == 6 * len(lines)  # 3 digits, 2 spaces, a newline or the stop token per line
        pairs[target, len(lines)] += 1
    assert set(pairs) == {(t, k) for t in (6, 12, 18) for k in (1, 2, 3, 4)}
    # independence: every (target, lines) cell near 480 / 12 = 40 (binomial sd ~6)
    assert all(15 <= c <= 65 for c in pairs.values()), pairs

    plain = load_config(None, common)  # no targets, no lines: the prompt as evaluated, the answer once
    for task, (prompt, completion) in list(zip(tasks, build_examples(plain, tok, stops)))[:20]:
        assert "Think for" not in tok.decode(prompt)
        assert tok.decode(completion[:-1]) == task.answer
