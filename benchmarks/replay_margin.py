"""Measure the replay check's logit tolerance for a pool's model: honest cross-engine raw-logit spreads.

The replay check accepts a token whose noisy score is within 2 d / T of the best (`[validator]
replay_logit_tolerance` = d): the gap between two tokens' scores, as the validator computes it, is off from the
worker's by (err_best - err_token) / T, err being each logit's difference between the two engines. What the
margin must cover is the largest spread max(err) - min(err) over the tokens that compete at a position, so
d = spread / 2 would just hold the largest spread seen; the dtype's default (0.75 in bfloat16) is fixed for every
model, and every logit unit of margin beyond the model's own spread is freedom a cheater may spend on near ties
(docs/verifiable-sampling.md).

This measures it for one model as the pool runs it: a vLLM engine in the workers' dtype (`worker.dtype`)
generates completions of the pool's task prompts (`[data]`) at temperature 1 with its top `--logprobs` logprobs
per position (raw log-softmax there: logprob differences between tokens are logit differences), each batch
beside other requests; the validator's `Prefill` (`validator.dtype`) recomputes the logits of the same tokens.
Per position, err = worker logprob - validator logprob over the tokens the worker listed (its top ones and the
sampled one) whose noisy score, under the validator's logits and the seed's noise, comes within
`gpu_workers.calibration.COMPETING_WINDOW` of the best: the tokens that compete there. The spread is
max(err) - min(err) over them (`competing_spreads`; the spread over every listed token is reported beside it,
larger and irrelevant to the replay). It prints the competing spreads' quantiles
and the tolerance to configure, `--safety` x the largest spread / 2 (rounded up to 0.01), and with `--write`
writes it as a TOML snippet (at least 0.01):

    [validator]
    replay_logit_tolerance = 0.31

Run it for every model a pool serves, on the workers' kind of hardware, and again when the model changes much
(RL sharpens a policy and its logits grow): an honest worker's spread beyond the configured tolerance is an
honest rejection. The tolerance is never set below the spread measured, and the safety factor (default 2) is
the room above it.

    .venv/bin/python benchmarks/replay_margin.py configs/demo.toml --model runs/demo/sft --samples 512 \
        [--worker.dtype bfloat16 --validator.dtype bfloat16]    (any config override)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", type=Path, help="the pool's config (its [data], [worker] and [validator])")
    p.add_argument("--model", type=Path, default=None, help="the policy (default: model.path)")
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--batch", type=int, default=32, help="samples generated together")
    p.add_argument("--max-tokens", type=int, default=None, help="default: the pool's completion cap, at most 256")
    p.add_argument("--logprobs", type=int, default=20, help="top logprobs the worker lists per position")
    p.add_argument("--safety", type=float, default=2.0)
    p.add_argument("--write", type=Path, default=None, help="write the [validator] snippet here")
    args, overrides = p.parse_known_args()

    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from gpu_workers.calibration import competing_spreads, replay_tolerance
    from gpu_workers.checks import REPLAY_LOGIT_TOLERANCE
    from gpu_workers.config import WorkerConfig, completion_cap
    from gpu_workers.engine import Engine
    from gpu_workers.prefill import Prefill
    from gpu_workers.tasks import prompt_tokens
    from intellect.config_io import load_config
    from intellect.tasks_setup import training_tasks

    started = time.monotonic()
    cfg = load_config(args.config, overrides)
    model = args.model or Path(cfg.model.path)
    max_tokens = args.max_tokens or min(completion_cap(cfg.worker, cfg.data), 256)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    tasks = training_tasks(cfg.data)
    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(tasks), args.samples)
    prompts = [prompt_tokens(tasks[int(i)], tokenizer, 0, cfg.data.system_prompt) for i in picks]
    longest = max(len(x) for x in prompts) + max_tokens
    engine = Engine(
        model, 0, WorkerConfig(dtype=cfg.worker.dtype, sampler="vllm", verify_swaps=0), max_model_len=longest + 8
    )
    prefill = Prefill(model, dtype=cfg.validator.dtype)
    found: list[np.ndarray] = []
    found_all: list[np.ndarray] = []
    try:
        for start in range(0, args.samples, args.batch):
            part = prompts[start : start + args.batch]
            others = [prompts[(start + 7 * i) % len(prompts)][: -1 - i % 3] for i in range(len(part) // 4 + 1)]
            params = [
                SamplingParams(n=1, seed=start + i, temperature=1.0, max_tokens=max_tokens, logprobs=args.logprobs)
                for i in range(len(part) + len(others))
            ]
            outs = engine.llm.generate(
                [TokensPrompt(prompt_token_ids=list(x)) for x in part + others], params, use_tqdm=False
            )[: len(part)]
            pairs = [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]
            for i, (o, result) in enumerate(zip(outs, prefill.run(pairs))):
                listed = [{t: e.logprob for t, e in entry.items()} for entry in o.outputs[0].logprobs]
                competing, every = competing_spreads(listed, result.logits, start + i)
                found.append(competing)
                found_all.append(every)
    finally:
        engine.close()
    every = np.concatenate(found)
    largest = float(every.max())
    tolerance = replay_tolerance(largest, args.safety)
    default = REPLAY_LOGIT_TOLERANCE.get(cfg.worker.dtype, REPLAY_LOGIT_TOLERANCE["bfloat16"])
    report = {
        "model": str(model),
        "worker_dtype": cfg.worker.dtype,
        "validator_dtype": cfg.validator.dtype,
        "samples": args.samples,
        "positions": int(len(every)),
        "spread_quantiles": {q: round(float(np.quantile(every, float(q))), 4) for q in ("0.5", "0.99", "0.999")},
        "spread_max": round(largest, 4),
        "spread_max_all_listed": round(float(np.concatenate(found_all).max()), 4),
        "safety": args.safety,
        "replay_logit_tolerance": tolerance,
        "dtype_default": default,
        "seconds": round(time.monotonic() - started, 1),
    }
    snippet = f"[validator]\nreplay_logit_tolerance = {tolerance}\n"
    if args.write:
        args.write.write_text(
            f"# benchmarks/replay_margin.py: largest honest spread {largest:.4f} over {len(every)} positions of "
            f"{model} ({cfg.worker.dtype} worker, {cfg.validator.dtype} validator), x {args.safety} / 2\n{snippet}"
        )
    print(json.dumps(report))
    print(snippet, end="", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
