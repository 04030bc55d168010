"""`intellect sft` (in process) then `intellect eval` (its own process): a model fine-tuned on a synthetic task scores
high and the untrained model scores ~0, and eval's accuracy agrees with an independent scoring of transformers'
own greedy generations (plain string comparison with the reference answers, no reward code)."""

from __future__ import annotations

import json
import subprocess
import sys

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
max_seq_len = 64
[trainer]
fsdp = -1
batch_size = 16
micro_batch_size = 8
[loss]
temperature = 1.0
[data]
task = "sort"
digits = 3
num_tasks = 600
eval_tasks = 32
task_seed = 5
prompts_per_step = 2
samples_per_prompt = 8
max_prompt_len = 48
max_new_tokens = 16
[worker]
dtype = "float32"
temperature = 1.0
max_tokens = 10
kv_cache_gib = 1.0
"""


def _eval(*argv) -> dict:
    """`intellect eval ... --json` in its own process, as a user (or the launcher) runs it."""
    cmd = [sys.executable, "-m", "intellect", "eval", *map(str, argv), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _transformers_greedy_accuracy(model_dir, config_path) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from intellect.config_io import load_config
    from intellect.tasks_setup import heldout_tasks

    tasks = heldout_tasks(load_config(config_path).data)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    right = 0
    for task in tasks:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": task.prompt}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=[0, 2], pad_token_id=0)
        text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        right += text.strip() == task.answer
    return right / len(tasks)


@pytest.mark.timeout(600)
def test_sft_then_eval(tiny_model, tmp_path):
    base = tiny_model("qwen2", hidden=64, layers=2, heads=2, kv_heads=1)
    config = tmp_path / "recipe.toml"
    config.write_text(RECIPE.format(run_dir=tmp_path / "run", model=base))
    sft_dir = tmp_path / "sft"
    assert (
        main(
            [
                "sft",
                str(config),
                "--steps",
                "40",
                "--lr",
                "3e-3",
                "--batch-size",
                "64",
                "--out",
                str(sft_dir),
                "--no-progress",
            ]
        )
        == 0
    )
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 41)) and {r["role"] for r in records} == {"sft"}
    assert records[-1]["loss"] < 0.5 * records[0]["loss"]

    tuned = _eval(sft_dir, config, "--completions", tmp_path / "completions.jsonl")
    assert tuned["n"] == 32 and tuned["version"] == 0
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 32 and all(len(r["completions"]) == len(r["correct"]) == 1 for r in rows)
    assert sum(r["correct"][0] for r in rows) / 32 == pytest.approx(tuned["accuracy"])
    assert all(r["correct"][0] == (r["completions"][0].strip() == r["answer"]) for r in rows)  # the task's rule
    assert tuned["accuracy"] >= 0.6, tuned
    assert tuned["mean_completion_len"] == pytest.approx(6.0, abs=0.5)  # "1 2 3" + <|im_end|>
    reference = _transformers_greedy_accuracy(sft_dir, config)
    assert abs(tuned["accuracy"] - reference) <= 1 / 32 + 1e-9, (tuned["accuracy"], reference)

    untrained = _eval(base, config, "--n", "16", "--metrics", tmp_path / "m.jsonl", "--step", "0")
    assert untrained["accuracy"] <= 0.1 and untrained["n"] == 16
    logged = json.loads((tmp_path / "m.jsonl").read_text())
    assert logged["role"] == "eval" and logged["step"] == 0 and logged["accuracy"] == untrained["accuracy"]
