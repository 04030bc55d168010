"""benchmarks/peer_trl.py: the recipe -> GRPOConfig mapping, the mark snapshots, the prompts the TRL side trains on,
and the throughput and group counts both sides report (no TRL needed)."""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))
import peer_trl  # noqa: E402
import peer_trl_side  # noqa: E402

RECIPE = ROOT / "configs" / "smollm2_135m_syllogism.toml"


def _cfg(*overrides: str):
    from intellect.config_io import load_config

    return load_config(RECIPE, [*peer_trl.RUN_OVERRIDES, *overrides])


def test_the_syllogism_recipe_maps_to_trl_field_by_field():
    recipe = tomllib.loads(RECIPE.read_text())
    data, optim, worker = recipe["data"], recipe["optim"], recipe["worker"]
    kwargs, notes = peer_trl.grpo_config_kwargs(_cfg())
    # 8 prompts x 8 samples = 64 samples per optimizer step, in micro-batches of at most 16 (trainer.micro_batch_size)
    per_step = data["prompts_per_step"] * data["samples_per_prompt"]
    assert per_step == 64
    assert kwargs["per_device_train_batch_size"] * kwargs["gradient_accumulation_steps"] == per_step
    assert kwargs["per_device_train_batch_size"] == 16 and kwargs["gradient_accumulation_steps"] == 4
    assert kwargs["steps_per_generation"] == kwargs["gradient_accumulation_steps"]  # one generation per step
    assert kwargs["num_generations"] == data["samples_per_prompt"] == 8
    assert kwargs["max_completion_length"] == data["max_new_tokens"] == 64
    assert kwargs["learning_rate"] == optim["lr"] == 5e-5
    assert kwargs["max_grad_norm"] == optim["grad_clip"] == 1.0
    assert kwargs["weight_decay"] == optim["weight_decay"] == 0.0
    assert kwargs["warmup_steps"] == optim["warmup_steps"] == 0
    assert kwargs["lr_scheduler_type"] in ("constant", "constant_with_warmup")
    assert (kwargs["adam_beta1"], kwargs["adam_beta2"], kwargs["adam_epsilon"]) == (0.9, 0.99, 1e-8)  # OptimConfig's
    assert kwargs["optim"] == "adamw_torch"
    assert kwargs["temperature"] == worker["temperature"] == recipe["loss"]["temperature"] == 1.0
    assert kwargs["top_p"] == 1.0 and kwargs["top_k"] == 0  # the recipe samples from the full distribution
    assert kwargs["beta"] == 0.0 and kwargs["num_iterations"] == 1
    assert kwargs["loss_type"] == "dapo"  # token_mean: every completion token of the step weighs the same
    assert kwargs["scale_rewards"] == "group"  # advantages divided by the group's std
    assert kwargs["importance_sampling_level"] == "token"
    assert (kwargs["epsilon"], kwargs["epsilon_high"], kwargs["delta"]) == (0.2, 0.2, 4.0)
    assert kwargs["gradient_checkpointing"] is False  # model.remat = "none"
    assert kwargs["bf16"] is False and kwargs["fp16"] is False
    assert kwargs["model_init_kwargs"] == {"dtype": recipe["model"]["param_dtype"]}
    assert kwargs["max_steps"] == peer_trl.OPEN_STEPS and kwargs["seed"] == 0
    json.dumps(kwargs)  # settings.json carries them to TRL's virtualenv
    said = " ".join(notes)
    assert "async_level 2" in said and "online_filter" in said and "1e-4" in said
    assert "warmup" not in said and "weight decay" not in said  # the recipe has neither
    assert "prompts_per_assignment" not in said  # 8 prompts a batch, 8 a step: every step takes one whole batch
    _, notes = peer_trl.grpo_config_kwargs(_cfg("--orchestrator.prompts_per_assignment", "3"))
    assert any("prompts_per_assignment 3 does not divide" in n for n in notes)


def test_other_losses_batches_and_schedules_map_to_their_trl_names():
    kwargs, notes = peer_trl.grpo_config_kwargs(
        _cfg(
            "--loss.policy_loss",
            "dr_grpo",
            "--trainer.steps_per_batch",
            "2",
            "--trainer.micro_batch_size",
            "12",
            "--optim.warmup_steps",
            "5",
            "--optim.schedule",
            "cosine",
            "--optim.weight_decay",
            "0.1",
            "--worker.max_tokens",
            "48",
            "--model.remat",
            "full",
        )
    )
    # two optimizer steps of 32 samples per rollout batch of 64; 32 splits into micro-batches of 8, not 12
    assert kwargs["per_device_train_batch_size"] == 8 and kwargs["gradient_accumulation_steps"] == 4
    assert kwargs["steps_per_generation"] == 8
    assert kwargs["loss_type"] == "dr_grpo" and kwargs["scale_rewards"] == "none"
    assert kwargs["lr_scheduler_type"] == "cosine" and kwargs["warmup_steps"] == 5
    assert kwargs["max_completion_length"] == 48  # worker.max_tokens caps completions before data.max_new_tokens
    assert kwargs["gradient_checkpointing"] is True
    said = " ".join(notes)
    assert "constant_normalizer (32768)" in said  # dr_grpo's divisor differs from TRL's max_completion_length
    assert "warmup" in said and "weight decay" in said and "1e-4" not in said

    kwargs, notes = peer_trl.grpo_config_kwargs(_cfg("--loss.policy_loss", "gspo", "--trainer.async_level", "0"))
    assert kwargs["importance_sampling_level"] == "sequence"
    assert (kwargs["epsilon"], kwargs["epsilon_high"]) == (3e-4, 4e-4) and "delta" not in kwargs
    assert not any("async_level" in n for n in notes)

    kwargs, _ = peer_trl.grpo_config_kwargs(_cfg("--loss.policy_loss", "cispo", "--loss.cispo_eps_high", "0.5"))
    assert kwargs["loss_type"] == "cispo" and kwargs["epsilon_high"] == 0.5
    kwargs, _ = peer_trl.grpo_config_kwargs(_cfg("--loss.aggregation", "seq_mean_token_mean"))
    assert kwargs["loss_type"] == "grpo"


def _version(weights: Path, v: int, stable: bool, payload: str) -> Path:
    d = weights / f"v{v:06d}"
    d.mkdir(parents=True)
    (d / "config.json").write_text(payload)
    if stable:
        (d / "STABLE").write_text(f"{v}\n")
    return d


def test_a_mark_copies_the_newest_complete_export_and_skips_incomplete_ones(tmp_path):
    weights, base = tmp_path / "weights", tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("base")
    assert peer_trl.newest_stable(weights) is None
    took = peer_trl.snapshot(weights, tmp_path / "mark-0", base)  # nothing exported yet: the base policy
    assert took == {"version": 0, "exported": None} and (tmp_path / "mark-0" / "config.json").read_text() == "base"

    _version(weights, 9, True, "nine")
    _version(weights, 10, True, "ten")  # newer by number, not by name order against v000009
    _version(weights, 11, False, "eleven, half written")
    (weights / ".v000012.partial-0a1b2c3d").mkdir()
    (weights / "v12").mkdir()
    assert peer_trl.newest_stable(weights) == weights / "v000010"
    took = peer_trl.snapshot(weights, tmp_path / "mark-1", base)
    assert took["version"] == 10 and took["exported"] > 0
    assert (tmp_path / "mark-1" / "config.json").read_text() == "ten"
    assert (tmp_path / "mark-1" / "STABLE").is_file() and not (tmp_path / "mark-1.partial").exists()


def test_rates_count_the_steps_that_ended_by_the_last_mark():
    t0 = 1000.0
    records = [
        {"time": t0 + 50, "samples": 64, "samples_trained": 48},
        {"time": t0 + 70, "samples": 64, "samples_trained": 32},
        {"time": t0 + 90, "samples": 64, "samples_trained": 64},
        {"time": t0 + 130, "samples": 64, "samples_trained": 64},  # after the mark
    ]
    r = peer_trl.rates(records, t0, t0 + 100)
    assert r["steps"] == 3 and r["samples"] == 192 and r["samples_trained"] == 144
    assert r["samples_per_s"] == pytest.approx(1.92) and r["samples_trained_per_s"] == pytest.approx(1.44)
    assert r["samples_trained_per_s_after_first_step"] == pytest.approx((32 + 64) / 40)
    assert r["first_step_s"] == 50.0
    none = peer_trl.rates([], t0, t0 + 100)
    assert none["steps"] == 0 and none["samples_trained_per_s"] == 0 and none["first_step_s"] is None


def test_groups_with_equal_rewards_are_not_counted_as_trained():
    tally: dict = {}
    peer_trl_side.tally_groups([1.0, 0.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0, 1.0], 4, tally)
    assert tally["samples"] == 12 and tally["samples_trained"] == 8 and tally["reward_sum"] == pytest.approx(3 + 2 + 1)
    with pytest.raises(ValueError, match="whole groups of 4"):
        peer_trl_side.tally_groups([1.0, 0.0, 1.0], 4, tally)


def test_the_prompts_file_renders_exactly_the_workers_prompt_tokens(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    from gpu_workers.rewards import sample_reward
    from gpu_workers.tasks import prompt_tokens, synthetic_tasks

    tokenizer = AutoTokenizer.from_pretrained(tiny_model(family="llama"))
    tasks = list(synthetic_tasks("arithmetic", 6, seed=3, digits=2))
    system = "Answer with the number alone."
    path = tmp_path / "prompts.jsonl"
    assert peer_trl.write_prompts(tasks, tokenizer, system, [8, 16], path) == 12
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    seen = set()
    for row in rows:
        task = peer_trl_side.task_from_json(row["task"])
        i = tasks.index(task)
        want = prompt_tokens(tasks[i], tokenizer, row["target"], system)
        got = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
        got = got["input_ids"] if hasattr(got, "keys") else got
        assert list(got) == want == row["prompt_ids"]
        assert (
            tokenizer.decode(want).count(system) == 1
            and f"Think for {row['target']} tokens" in row["prompt"][-1]["content"]
        )
        answer = tasks[i].answer
        for completion in (answer, "no idea"):  # the TRL side's reward is ours on the same task
            assert sample_reward(task, completion, 5, row["target"], 0.1) == sample_reward(
                tasks[i], completion, 5, row["target"], 0.1
            )
        seen.add((i, row["target"]))
    assert seen == {(i, t) for i in range(6) for t in (8, 16)}  # every task once per length target

    rows_without = tmp_path / "plain.jsonl"
    peer_trl.write_prompts(tasks[:2], tokenizer, None, [], rows_without)
    plain = [json.loads(line) for line in rows_without.read_text().splitlines()]
    assert [r["target"] for r in plain] == [0, 0] and [m["role"] for m in plain[0]["prompt"]] == ["user"]
    assert plain[0]["prompt_ids"] == prompt_tokens(tasks[0], tokenizer)


def test_a_task_json_cannot_carry_is_refused_by_its_index(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    from gpu_workers.tasks import Task

    tokenizer = AutoTokenizer.from_pretrained(tiny_model(family="llama"))
    tasks = [Task("1+1", "exact", "2"), Task("2+2", "exact", "4", meta={"pair": (1, 2)})]
    with pytest.raises(ValueError, match="training task 1 does not survive JSON"):
        peer_trl.write_prompts(tasks, tokenizer, None, [], tmp_path / "p.jsonl")
