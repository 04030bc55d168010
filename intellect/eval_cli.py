"""`intellect eval MODEL_DIR [CONFIG]`: pass@1 of a policy on the config's held-out tasks (episode success with
`data.env`), through vLLM.

The held-out tasks are `intellect.tasks_setup.heldout_tasks(cfg.data)` (never a training prompt);
`--task` and `--n` override `data.task` and `data.eval_tasks`. Greedy decoding by default; `--samples K
--temperature T` gives the sampled pass@1 averaged over K samples per task. Completions are capped at
`worker.max_tokens` (else `data.max_new_tokens`) and stop where vLLM stops (the model's eos ids). The engine
runs in `worker.dtype`.

With `data.length_targets` every task is asked once per target (stated in the prompt as workers state it)
and the record adds `length_abs_err` (the mean over targets of mean |completion length - target|) and, per
target T, `length_abs_err/T`, `length_mean/T` and `accuracy/T` (`gpu_workers.evaluate`).

With `data.env` (a multi-turn pool) every held-out task is played as an episode of the pool's environment
through the protocol a worker plays (`gpu_workers.evaluate.evaluate_episodes`: turn caps and limits of
`gpu_workers.config.episode_limits`, the turn seeds, the environment turns appended as token ids), greedy or
sampled as above, and scored by the environment: the record adds `success_rate` (the mean of
`Episode.success`; `accuracy` is the same number, so a run's charts read it), `mean_reward` and `mean_turns`,
and `--completions FILE` writes one JSON line per episode: {"prompt", "answer", "seed", "turns" (each
{"role": "assistant" or "environment", "text", "tokens"}), "model_turns", "reward", "success", "reason",
"ended"}; an assistant turn's text is what the environment was shown (its tokens decoded without special
tokens). Replaying those turns through a fresh episode of the environment at that seed gives the same verdict.

Prints one JSON line: {"accuracy", "n", "samples", "mean_completion_len", "format_rate", "accuracy_in_format",
"best_constant_accuracy", "best_constant_answer", "model", "version", "task", "temperature", "seconds"}: beside
pass@1, the share of completions whose answer is in the task's expected format, pass@1 among those, and the best
constant answer's score on the same tasks (`gpu_workers.rewards.answers`; null where the reward has no format
rule, e.g. code); with `--metrics FILE --step S` the same record, with "role": "eval", "step" and
"time", is appended to FILE (a run's metrics.jsonl); `--completions FILE` writes what the policy answered, a JSON
line per task: {"prompt", "answer", "completions", "correct"}. Without `--json` a short human summary with a few
examples goes to stderr first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", type=Path, help="Hugging Face directory of the policy (an export, or model.path)")
    p.add_argument("config", type=Path, nargs="?", default=None, help="TOML recipe (its [data] picks the tasks)")
    p.add_argument("--task", default=None, help="task family to score (overrides data.task)")
    p.add_argument("--n", type=int, default=None, help="held-out tasks to score (overrides data.eval_tasks)")
    p.add_argument("--samples", type=int, default=1, help="samples per task (needs --temperature > 0 when > 1)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--seed", type=int, default=0, help="first sampling seed")
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    p.add_argument("--metrics", type=Path, default=None, help="append the result to this metrics.jsonl")
    p.add_argument("--step", type=int, default=None, help="learner step recorded with --metrics")
    p.add_argument(
        "--completions",
        type=Path,
        default=None,
        help="write every task's prompt, reference answer, completions and verdicts here (JSON lines)",
    )


def _fail(message: str) -> int:
    print(f"intellect eval: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from intellect.cli import config_from_args

    if not (args.model_dir / "config.json").is_file():
        return _fail(f"{args.model_dir} is not a Hugging Face model directory (no config.json)")
    if (args.metrics is None) != (args.step is None):
        return _fail("--metrics and --step go together")
    overrides = list(args.overrides)
    if args.task is not None:
        overrides += ["--data.task", args.task]
    if args.n is not None:
        overrides += ["--data.eval_tasks", str(args.n)]
    args.overrides = overrides
    cfg = config_from_args(args)
    if cfg.data.eval_tasks < 1:
        return _fail("no held-out tasks to score: data.eval_tasks (or --n) is 0")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(cfg.worker.kv_cache_gib))))

    from transformers import AutoTokenizer

    from gpu_workers.checks import stop_token_ids
    from gpu_workers.config import completion_cap
    from gpu_workers.engine import Engine
    from gpu_workers.evaluate import evaluate, model_version
    from gpu_workers.rewards import code
    from intellect.tasks_setup import heldout_tasks

    tasks = heldout_tasks(cfg.data)
    try:
        code.prepare(tasks, cfg.data.allow_unsandboxed_code)
        if cfg.data.env is not None:  # an environment whose tools run model-written code needs the sandbox too
            from gpu_workers.envs.loading import load_environment, prepare

            prepare(load_environment(cfg.data.env, cfg.data.env_config), cfg.data.allow_unsandboxed_code)
    except code.SandboxUnavailable as exc:
        return _fail(str(exc))
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    version = model_version(args.model_dir)
    if cfg.data.env is not None:
        return _eval_episodes(args, cfg, tasks, tokenizer, version)
    t0 = time.perf_counter()
    engine = Engine(args.model_dir, version, cfg.worker.model_copy(update={"verify_swaps": 0}), cfg.model.max_seq_len)
    try:
        result = evaluate(
            engine,
            tasks,
            tokenizer,
            max_tokens=completion_cap(cfg.worker, cfg.data),
            stop_token_ids=sorted(stop_token_ids(args.model_dir)),
            system_prompt=cfg.data.system_prompt,
            samples=args.samples,
            temperature=args.temperature,
            top_p=cfg.worker.top_p,
            seed=args.seed,
            length_targets=cfg.data.length_targets,
        )
    except ValueError as exc:
        return _fail(str(exc))
    finally:
        engine.close()
    record = _record(args, cfg, result, version, t0)
    if not args.json:
        print(
            f"{tasks.name}: pass@1 {result.accuracy:.3f} over {result.n} tasks x {result.samples} "
            f"(version {version}, {result.mean_completion_len:.1f} tokens per completion)",
            file=sys.stderr,
        )
        if result.constant is not None:
            print(
                f"  best constant answer {result.constant.answer!r}: {result.constant.accuracy:.3f} "
                f"(the reference of {result.constant.frequency:.1%} of the tasks)",
                file=sys.stderr,
            )
        if result.format_rate is not None:
            among = "none" if result.accuracy_in_format is None else f"{result.accuracy_in_format:.3f}"
            print(
                f"  answers in the expected format: {result.format_rate:.1%}; pass@1 among them {among}",
                file=sys.stderr,
            )
        for target, m in result.by_target.items():
            print(
                f"  target {target} tokens: mean |length - target| {m['abs_err']:.2f}, mean length "
                f"{m['mean_len']:.1f}, pass@1 {m['accuracy']:.3f}",
                file=sys.stderr,
            )
        for task, texts, ok in list(zip(tasks, result.completions, result.correct))[:3]:
            print(
                f"  {task.prompt!r} -> {texts[0]!r} ({'right' if ok[0] else 'wrong'}; answer {task.answer!r})",
                file=sys.stderr,
            )
    if args.completions is not None:
        with open(args.completions, "w") as f:
            for task, texts, ok in zip(tasks, result.completions, result.correct):
                row = {"prompt": task.prompt, "answer": task.answer, "completions": list(texts)}
                f.write(json.dumps({**row, "correct": [bool(x) for x in ok]}) + "\n")
    _finish(args, cfg, record)
    return 0


def _record(args: argparse.Namespace, cfg, result, version: int, t0: float, **extra) -> dict:
    """What an evaluation reports: its summary, the model, version, task (and `extra`), temperature, wall time."""
    return {
        **result.summary(),
        "model": str(args.model_dir),
        "version": version,
        "task": cfg.data.task,
        **extra,
        "temperature": args.temperature,
        "seconds": round(time.perf_counter() - t0, 3),
    }


def _finish(args: argparse.Namespace, cfg, record: dict) -> None:
    """Append the record to --metrics and print it."""
    if args.metrics is not None:
        from intellect.metrics import MetricsLog

        metrics = MetricsLog(cfg, "eval", args.metrics)  # and W&B when run.wandb_mode asks
        metrics.write({"role": "eval", "step": args.step, "time": time.time(), **record})
        metrics.close()
    print(json.dumps(record), flush=True)


def _eval_episodes(args: argparse.Namespace, cfg, tasks, tokenizer, version: int) -> int:
    """A multi-turn pool's held-out tasks played as episodes (module docstring)."""
    from gpu_workers.checks import stop_token_ids
    from gpu_workers.config import episode_limits, sample_caps
    from gpu_workers.engine import Engine
    from gpu_workers.envs.episode import Protocol
    from gpu_workers.envs.loading import load_environment
    from gpu_workers.evaluate import evaluate_episodes

    env = load_environment(cfg.data.env, cfg.data.env_config)
    limits = episode_limits(cfg.worker, cfg.data)
    protocol = Protocol.for_tokenizer(env, tokenizer, limits, stop_token_ids(args.model_dir), cfg.data.system_prompt)
    t0 = time.perf_counter()
    worker = cfg.worker.model_copy(update={"verify_swaps": 0})
    engine = Engine(args.model_dir, version, worker, sample_caps(cfg.worker, cfg.data)[1])
    try:
        result = evaluate_episodes(
            engine,
            protocol,
            tasks,
            samples=args.samples,
            temperature=args.temperature,
            top_p=cfg.worker.top_p,
            seed=args.seed,
        )
    except ValueError as exc:
        return _fail(str(exc))
    finally:
        engine.close()
    record = _record(args, cfg, result, version, t0, env=cfg.data.env)
    if not args.json:
        print(
            f"{tasks.name} in {cfg.data.env}: success {result.success_rate:.3f}, mean reward {result.mean_reward:.3f}, "
            f"{result.mean_turns:.2f} model turns per episode over {result.n} tasks x {result.samples} "
            f"(version {version})",
            file=sys.stderr,
        )
        for e in result.episodes[:3]:
            said = " | ".join(t["text"] for t in e["turns"] if t["role"] == "assistant")
            print(
                f"  {tasks[e['task']].prompt!r} -> {said!r} ({'solved' if e['success'] else 'not solved'})",
                file=sys.stderr,
            )
    if args.completions is not None:
        with open(args.completions, "w") as f:
            for e in result.episodes:
                task = tasks[e["task"]]
                f.write(json.dumps({"prompt": task.prompt, "answer": task.answer, **e}) + "\n")
    _finish(args, cfg, record)
    return 0
