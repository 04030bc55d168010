"""`intellect sft CONFIG [--steps N] [--lr LR] [--batch-size B] [--out DIR]`: supervised warm start before RL.

The examples are the config's training tasks (`intellect.tasks_setup.training_tasks(cfg.data)`): the prompt
exactly as workers build it (chat template, `data.system_prompt`) and, as the completion, the task's reference
answer followed by the token the chat template closes an assistant turn with (for ChatML `<|im_end|>`, one of
the ids vLLM stops on), so that the tuned model answers and stops the way the reward and the engine expect.
Tasks are drawn in a shuffled order (`trainer.seed`), epoch after epoch.

With `data.length_targets` each prompt states a target drawn from them, as a worker's does; with
`run.sft_think_lines` the completion writes the answer on k lines (k drawn from that list). The two draws are
independent (a seeded stream of their own), so the warm start teaches the format and a spread of lengths but
not which length a target asks for: that is left for RL to learn from the length reward.

Training runs in `jax_trainer.sft` on the learner's mesh and model settings (`[trainer]` mesh axes,
`[model]` dtypes and remat, rows of `trainer.micro_batch_size` x `model.max_seq_len`). The optimizer is the
`[optim]` AdamW (betas, eps, weight decay, clip, schedule) with the SFT's own learning rate and warmup from the
flags, because `[optim].lr` is the RL rate (usually far smaller). The result is exported as a Hugging Face
directory with the base model's tokenizer files, in the base model's dtype (`--out`, default `<run.dir>/sft`),
which vLLM and transformers load as they are; point `model.path` at it for the RL phase. Per-step metrics go
to `run.dir/metrics.jsonl` with `"role": "sft"`.

With `data.env` (a multi-turn pool) the examples are the environment's demonstrations instead
(`Episode.demonstration`, `build_episode_examples`): each training task's demonstration is played through the
same episode protocol a worker plays (`gpu_workers.envs.episode.demonstrate`), so an example's tokens are the
sequence a worker would hold had it sampled those turns: the first prompt by the chat template, each model
turn's text tokenized and closed by the template's stop token, each environment turn's tokens appended as the
worker appends them. The loss covers only the model turns marked `train` (their stop token included), never
the prompt, the environment's turns or context-only turns (e.g. `retry`'s wrong first attempt). Each task's
episode seed is drawn from `trainer.seed`. An environment that gives no demonstration is an error naming it.

Flags (defaults suit the tiny CPU demo): `--steps` 200, `--lr` 1e-3, `--warmup` 10, `--batch-size` 64 examples.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", type=Path, nargs="?", default=None, help="TOML recipe")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate (default 1e-3)")
    p.add_argument("--warmup", type=int, default=10, help="linear warmup steps (default 10)")
    p.add_argument("--batch-size", type=int, default=64, help="examples per optimizer step (default 64)")
    p.add_argument("--out", type=Path, default=None, help="output HF directory (default <run.dir>/sft)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def completion_tokens(tokenizer, prompt: list[int], messages: list[dict], answer: str, stop_ids) -> list[int]:
    """The tokens after `prompt` when the chat template renders `answer` as the assistant's turn, up to and
    including the first stop token; the tokenizer's eos is appended when the template writes none."""
    full = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": answer}], tokenize=True)
    if isinstance(full, dict) or hasattr(full, "input_ids"):
        full = full["input_ids"]
    full = [int(t) for t in full]
    if full[: len(prompt)] != prompt:
        raise ValueError(
            "the chat template renders the assistant turn in a way that changes the prompt tokens; "
            "cannot derive SFT completions from it"
        )
    tail = full[len(prompt) :]
    for i, t in enumerate(tail):
        if t in stop_ids:
            return tail[: i + 1]
    if tokenizer.eos_token_id is None:
        raise ValueError("the chat template closes the assistant turn with no stop token and the tokenizer has no eos")
    return tail + [int(tokenizer.eos_token_id)]


def build_episode_examples(cfg, tokenizer, stop_ids) -> list[tuple[list[int], list[int], list[int]]]:
    """(first prompt, the rest of the episode, loss mask over the rest) per training task of a `data.env` pool:
    its environment's demonstration played through the episode protocol (module docstring)."""
    import numpy as np

    from gpu_workers.config import episode_limits
    from gpu_workers.envs.episode import Protocol, demonstrate
    from gpu_workers.envs.loading import load_environment, prepare
    from intellect.config import ConfigError
    from intellect.tasks_setup import training_tasks

    if cfg.run.sft_think_lines:
        raise ConfigError("run.sft_think_lines writes a single-turn answer on k lines; unset it with data.env")
    env = load_environment(cfg.data.env, cfg.data.env_config)
    prepare(env, cfg.data.allow_unsandboxed_code)  # a tool environment runs the demonstrated programs
    protocol = Protocol.for_tokenizer(
        env, tokenizer, episode_limits(cfg.worker, cfg.data), stop_ids, cfg.data.system_prompt
    )
    tasks = training_tasks(cfg.data)
    seeds = np.random.default_rng([cfg.trainer.seed, 3]).integers(0, 2**62, size=len(tasks))
    examples = []
    for i, (task, seed) in enumerate(zip(tasks, seeds)):
        try:
            d = demonstrate(protocol, task, int(seed), where=f"training task {i}")
        except ValueError as err:
            raise ConfigError(f"data.env: {err}") from None
        examples.append((d.tokens[: d.prompt_len], d.tokens[d.prompt_len :], d.trained[d.prompt_len :]))
    return examples


def build_examples(cfg, tokenizer, stop_ids) -> list[tuple[list[int], ...]]:
    """The warm start's examples: (prompt, completion) per training task, or with `data.env` (prompt, rest of
    the episode, loss mask) per task (`build_episode_examples`)."""
    import numpy as np

    from gpu_workers.tasks import prompt_text, prompt_tokens
    from intellect.config import ConfigError
    from intellect.tasks_setup import training_tasks

    if cfg.data.env is not None:
        return build_episode_examples(cfg, tokenizer, stop_ids)

    targets, lines = cfg.data.length_targets, cfg.run.sft_think_lines
    draw = np.random.default_rng([cfg.trainer.seed, 2])  # its own stream: the batch order's is trainer.seed
    examples = []
    for i, task in enumerate(training_tasks(cfg.data)):
        if task.answer is None:
            raise ConfigError(f"data: training task {i} has no reference answer to fine-tune on")
        target = int(targets[draw.integers(len(targets))]) if targets else 0
        repeats = int(lines[draw.integers(len(lines))]) if lines else 1  # drawn apart from the target
        prompt = prompt_tokens(task, tokenizer, target, cfg.data.system_prompt)
        messages = [{"role": "system", "content": cfg.data.system_prompt}] if cfg.data.system_prompt else []
        messages.append({"role": "user", "content": prompt_text(task, target)})
        answer = "\n".join([task.answer] * repeats)
        examples.append((prompt, completion_tokens(tokenizer, prompt, messages, answer, stop_ids)))
    return examples


def _base_dtype(model_dir: Path) -> str:
    hf = json.loads((model_dir / "config.json").read_text())
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    return dtype if dtype in ("float32", "bfloat16", "float16") else "float32"


def run(args: argparse.Namespace) -> int:
    from intellect.cli import config_from_args

    cfg = config_from_args(args)
    bad = [
        f"--{flag} {value} (must be {rule})"
        for flag, value, ok, rule in (
            ("steps", args.steps, args.steps >= 1, ">= 1"),
            ("batch-size", args.batch_size, args.batch_size >= 1, ">= 1"),
            ("lr", args.lr, args.lr > 0, "> 0"),
            ("warmup", args.warmup, args.warmup >= 0, ">= 0"),
        )
        if not ok
    ]
    if bad:
        print(f"intellect sft: bad flag values: {'; '.join(bad)}", file=sys.stderr)
        return 2
    base = Path(cfg.model.path)
    out = args.out or Path(cfg.run.dir) / "sft"
    if (out / "STABLE").exists():
        print(
            f"intellect sft: {out} already holds a finished model; remove it or choose another --out", file=sys.stderr
        )
        return 2

    from jax_trainer import host

    host.prepare(cfg.trainer.retain_host_memory, cfg.model.path)  # before jax starts a backend
    import jax
    import numpy as np
    from flax import nnx
    from transformers import AutoTokenizer

    from gpu_workers.checks import stop_token_ids
    from gpu_workers.rewards.code import SandboxUnavailable
    from intellect.config import ConfigError
    from intellect.learner_setup import load_base, mesh_from_config
    from intellect.metrics import wandb_sink
    from jax_trainer.models import export_hf
    from jax_trainer.sft import SFTTrainer, pack_examples, sft_loop

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(base)
    try:
        examples = build_examples(cfg, tokenizer, stop_token_ids(base))
    except (ConfigError, SandboxUnavailable) as err:
        print(f"intellect sft: {err}", file=sys.stderr)
        return 2
    too_long = [i for i, (p, c, *_) in enumerate(examples) if len(p) + len(c) > cfg.model.max_seq_len]
    if too_long:
        print(
            f"intellect sft: {len(too_long)} examples (first: task {too_long[0]}) exceed model.max_seq_len "
            f"{cfg.model.max_seq_len}",
            file=sys.stderr,
        )
        return 2
    mesh = mesh_from_config(cfg)
    model = load_base(cfg, base, mesh)
    optim = cfg.optim.model_copy(update={"lr": args.lr, "warmup_steps": args.warmup})
    trainer = SFTTrainer(model, mesh, optim, cfg.trainer.model_copy(update={"steps": args.steps}))
    state = trainer.init_state(nnx.split(model)[1])
    rng = np.random.default_rng(cfg.trainer.seed)

    def batches():
        order, pos = rng.permutation(len(examples)), 0
        while True:
            if pos + args.batch_size > len(order):
                order, pos = np.concatenate([order[pos:], rng.permutation(len(examples))]), 0
            chosen = order[pos : pos + args.batch_size]
            pos += args.batch_size
            yield pack_examples([examples[i] for i in chosen], cfg.trainer.micro_batch_size, cfg.model.max_seq_len)

    metrics_path = cfg.run.metrics_path
    metrics_path.parent.mkdir(parents=True, exist_ok=True)
    last: dict = {}
    sink = wandb_sink(cfg, "sft")

    def on_step(step: int, record: dict) -> None:
        last.update(record)
        if sink is not None and jax.process_index() == 0:
            sink.log(record)

    state = sft_loop(
        trainer,
        state,
        batches(),
        args.steps,
        metrics_path=metrics_path,
        progress=not args.no_progress and sys.stderr.isatty(),
        on_step=on_step,
    )
    if sink is not None:
        sink.close()
    export_hf(trainer.model(state.params), out, version=0, source_dir=base, dtype=_base_dtype(base))
    print(
        json.dumps(
            {
                "out": str(out),
                "steps": args.steps,
                "loss": last.get("loss"),
                "accuracy": last.get("accuracy"),
                "examples": len(examples),
                "seconds": round(time.perf_counter() - t0, 3),
            }
        ),
        flush=True,
    )
    return 0
