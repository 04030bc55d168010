"""The TRL side of `benchmarks/peer_trl.py`: TRL's GRPOTrainer on the prompts and rewards that script wrote, run by
the python of TRL's own virtualenv with this checkout on PYTHONPATH (only `gpu_workers.rewards` and
`gpu_workers.tasks` are imported from it: no jax, no vLLM).

    python benchmarks/peer_trl_side.py SETTINGS.json

Before training it checks that TRL's tokenizer call renders every prompt to the token ids ours gives. A wall-clock
mark's policy is the weights after the last optimizer step that ended before the mark (kept in a shadow copy);
training stops at the first step end after the last mark. Writes OUT/mark-{M}min (save_pretrained), one
metrics.jsonl record per step and summary.json. Importing this module imports nothing outside the standard library.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def task_to_json(task) -> str:
    """A `gpu_workers.tasks.Task` as one JSON string (`task_from_json` reads it back)."""
    return json.dumps(dataclasses.asdict(task), sort_keys=True)


def task_from_json(text: str):
    from gpu_workers.tasks.dataset import CodeCheck, Task

    fields = json.loads(text)
    check = fields.pop("check")
    return Task(**fields, check=None if check is None else CodeCheck(**check))


def tally_groups(rewards: Sequence[float], group: int, tally: dict) -> None:
    """Add a generation batch's samples to `tally`: all of them to "samples", those of groups whose rewards differ
    (the groups a GRPO step learns from; ours drops the others before the loss) to "samples_trained"."""
    if len(rewards) % group:
        raise ValueError(f"{len(rewards)} rewards are not whole groups of {group}")
    for i in range(0, len(rewards), group):
        g = rewards[i : i + group]
        tally["samples"] = tally.get("samples", 0) + len(g)
        tally["samples_trained"] = tally.get("samples_trained", 0) + (len(g) if max(g) != min(g) else 0)
        tally["reward_sum"] = tally.get("reward_sum", 0.0) + float(sum(g))


def _check_rendering(tokenizer, rows: list[dict]) -> None:
    """TRL's own call for conversational prompts must give the token ids ours gives (`prompt_ids`)."""
    for start in range(0, len(rows), 256):
        batch = rows[start : start + 256]
        ids = tokenizer.apply_chat_template(
            conversation=[r["prompt"] for r in batch], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for i, (row, got) in enumerate(zip(batch, ids)):
            if list(got) != row["prompt_ids"]:
                raise SystemExit(
                    f"peer_trl_side: prompt row {start + i} renders to other token ids in TRL's virtualenv than "
                    f"ours ({len(got)} against {len(row['prompt_ids'])} tokens): the tokenizers or chat templates "
                    "differ; install the transformers version of constraints.txt in it"
                )


def _append(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def run(settings: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from gpu_workers.rewards import sample_reward

    t0, out = settings["t0"], Path(settings["out"])
    pending = sorted(settings["minutes"])
    group = settings["grpo"]["num_generations"]
    metrics = out / "metrics.jsonl"
    rows = [json.loads(line) for line in Path(settings["prompts"]).read_text().splitlines() if line.strip()]
    tokenizer = AutoTokenizer.from_pretrained(settings["model"])
    _check_rendering(tokenizer, rows)
    dataset = Dataset.from_list([{"prompt": r["prompt"], "task": r["task"], "target": r["target"]} for r in rows])
    tasks: dict[str, object] = {}
    tally: dict = {}

    def reward(prompts, completions, completion_ids, task, target, **_):
        """The worker's reward: the completion decoded as the worker decodes it, `sample_reward` on the task."""
        values = []
        for ids, text_of_task, length_target in zip(completion_ids, task, target):
            if text_of_task not in tasks:
                tasks[text_of_task] = task_from_json(text_of_task)
            text = tokenizer.decode(ids, skip_special_tokens=True)
            result = sample_reward(
                tasks[text_of_task], text, len(ids), length_target, settings["length_penalty"], settings["length_mode"]
            )
            values.append(result.value)
        tally_groups(values, group, tally)
        return values

    dtype = getattr(torch, settings["grpo"]["model_init_kwargs"]["dtype"])
    shadow = AutoModelForCausalLM.from_pretrained(settings["model"], dtype=dtype).eval().requires_grad_(False)
    marks: dict[str, dict] = {}
    held = {"step": 0, "elapsed_s": 0.0}  # the shadow's policy: after which step, and when that step ended

    def save(minute: int, step_time: float) -> None:
        dest = out / f"mark-{minute}min"
        tmp = dest.with_name(dest.name + ".partial")
        shadow.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(dest)
        marks[str(minute)] = {
            "step": held["step"],
            "policy_elapsed_s": round(held["elapsed_s"], 1),
            "elapsed_s": round(step_time, 1),
            "dir": str(dest),
        }
        print(f"mark {minute} min: step {held['step']} saved to {dest}", file=sys.stderr, flush=True)

    class Marks(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            now = time.time()
            record = {"role": "learner", "step": state.global_step, "time": now, **tally}
            tally.clear()
            _append(metrics, record)
            while pending and now - t0 >= pending[0] * 60:
                save(pending.pop(0), now - t0)
            if not pending:
                control.should_training_stop = True
            else:
                shadow.load_state_dict(model.state_dict())
                held.update(step=state.global_step, elapsed_s=now - t0)

        def on_log(self, args, state, control, logs=None, **kwargs):
            _append(metrics, {"role": "log", "step": state.global_step, "time": time.time(), **(logs or {})})

        def on_train_end(self, args, state, control, model=None, **kwargs):
            if pending:  # trained all trainer.steps before the last mark: the final policy stands at the rest
                shadow.load_state_dict(model.state_dict())
                held.update(step=state.global_step, elapsed_s=time.time() - t0)
                while pending:
                    save(pending.pop(0), time.time() - t0)

    args = GRPOConfig(
        output_dir=str(out / "trainer"),
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
        remove_unused_columns=False,
        log_completions=False,
        **settings["grpo"],
    )
    trainer = GRPOTrainer(
        model=settings["model"],
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Marks()],
    )
    stop_ids = sorted(int(i) for i in trainer.eos_token_ids)
    trainer.train()
    import transformers
    import trl

    summary = {
        "t0": t0,
        "minutes": settings["minutes"],
        "marks": marks,
        "prompts": len(rows),
        "stop_token_ids": stop_ids,
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
        "torch_threads": torch.get_num_threads(),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    print(json.dumps(run(json.loads(Path(argv[0]).read_text()))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
