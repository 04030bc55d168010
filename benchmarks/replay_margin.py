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
larger and irrelevant to the replay). It prints the competing spreads' quantiles and the tolerance to
configure: `--safety` x the larger of the largest spread and the largest honest near-tie gap below, / 2
(rounded up to 0.01, at least 0.01; a flip's gap was seen beyond the listed tokens' spreads of another run).

Then the near ties an honest worker makes (`--tie-samples`, default `--samples`): a worker with the replayable
sampler (`worker.sampler = "replayable"`) generates completions with their seeds at the pool's temperature and
top-p, and the validator replays them; every token that is not the validator's replayed choice is a near tie, and
its gap (best noisy score minus the token's, in raw logits) is what the engines' rounding made of it
(`gpu_workers.calibration.near_tie_gaps`). These completions come in the pool's batches, `[orchestrator]
prompts_per_assignment` prompts x `[data] samples_per_prompt` samples: a group's samples share a prompt, and one
rounding error in a shared context can flip the choice in several of them. It prints `tie_logit_tolerance`, whose
tie margin holds the `--tie-quantile` (0.9) quantile of the honest gaps (honest near ties cost 0.25-1, most under
0.6; a choice beyond them costs 1), the honest near-tie cost per completion token under it, and the worker's
near-tie ledger (`[orchestrator] near_tie_rate`, `--rate-safety` x that cost: what a worker's accepted batches
may spend per token over its lifetime, plus `near_tie_slack`, `--rate-safety` x the costliest honest batch, at
least 2). The same completions give the largest honest |stored - recomputed| logprob (at T = 1, beyond the
top-p term) and `max_logprob_diff`, `--safety` x it: a peaked bfloat16 policy's honest errors reached 1.9
where the dtype's default allows 0.75. With `--write`, all of them as a TOML snippet:

    [validator]
    replay_logit_tolerance = 0.31
    tie_logit_tolerance = 0.19
    max_logprob_diff = 0.72

    [orchestrator]
    near_tie_rate = 0.0023
    near_tie_slack = 4.2

Run it for every model a pool serves, on the workers' kind of hardware, and again when the model changes much
(RL sharpens a policy and its logits grow): an honest worker's spread beyond the configured tolerance is an
honest rejection. The tolerance is never set below the spread measured, and the safety factor (default 2) is
the room above it; a flatter policy makes more near ties per token than a peaked one, so measure the ledger rate
on the flattest policy the pool will serve (the start of training, usually).

    .venv/bin/python benchmarks/replay_margin.py configs/demo.toml --model runs/demo/sft --samples 512 \
        [--worker.dtype bfloat16 --validator.dtype bfloat16]    (any config override)
"""

from __future__ import annotations

import argparse
import json
import math
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
    p.add_argument("--batch", type=int, default=32, help="samples generated together (spreads)")
    p.add_argument("--max-tokens", type=int, default=None, help="default: the pool's completion cap, at most 256")
    p.add_argument("--logprobs", type=int, default=20, help="top logprobs the worker lists per position")
    p.add_argument("--safety", type=float, default=2.0)
    p.add_argument(
        "--tie-samples", type=int, default=None, help="replayable samples for the near ties (default --samples)"
    )
    p.add_argument(
        "--tie-quantile", type=float, default=0.9, help="the quantile of honest near-tie gaps the tie margin holds"
    )
    p.add_argument("--rate-safety", type=float, default=2.0, help="near_tie_rate over the honest cost per token")
    p.add_argument("--write", type=Path, default=None, help="write the [validator] snippet here")
    args, overrides = p.parse_known_args()

    import torch
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from gpu_workers.calibration import (
        competing_spreads,
        logprob_tolerance,
        near_tie_gaps,
        near_tie_rate,
        replay_tolerance,
        tie_tolerance,
    )
    from gpu_workers.checks import (
        MAX_LOGPROB_DIFF,
        REPLAY_LOGIT_TOLERANCE,
        _top_p_kept,
        near_tie_costs,
        stop_token_ids,
    )
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
    # the near ties of honest replayable-sampler completions at the pool's temperature and top-p
    temperature, top_p = cfg.worker.temperature, cfg.worker.top_p
    gaps: list[np.ndarray] = []
    tie_tokens, worst_logprob, batch_of = 0, 0.0, []
    engine = Engine(model, 0, WorkerConfig(dtype=cfg.worker.dtype, verify_swaps=0), max_model_len=longest + 8)
    try:
        # the pool's batches: prompts_per_assignment prompts x samples_per_prompt samples each (a group's samples
        # share their prompt, and a rounding error of a shared context can flip the choice in several of them)
        group = cfg.data.samples_per_prompt
        per_batch = cfg.orchestrator.prompts_per_assignment * group
        n = args.tie_samples if args.tie_samples is not None else args.samples
        for start in range(0, n, per_batch):
            part = [prompts[((start + i) // group) % len(prompts)] for i in range(min(per_batch, n - start))]
            seeds = [(1 << 20) + start + i for i in range(len(part))]
            outs = engine.generate(
                part,
                seeds,
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_tokens,
                stop_token_ids=sorted(stop_token_ids(model)),
                proofs=False,
            )
            pairs = [(list(x), list(o.tokens)) for x, o in zip(part, outs)]
            for (_, tokens), result, seed, o in zip(pairs, prefill.run(pairs), seeds, outs):
                z = result.logits.float()
                if top_p < 1:  # the validator's nucleus (the replay's pass-overs are left aside here)
                    z = z.masked_fill(~_top_p_kept(z / temperature, top_p), -float("inf"))
                gaps.append(near_tie_gaps(tokens, z, seed, temperature))
                batch_of.append(start // per_batch)
                tie_tokens += len(tokens)
                recomputed = torch.log_softmax(z / temperature, dim=-1)[torch.arange(len(tokens)), torch.tensor(tokens)]
                # as the sampling check states its bound: at T = 1, beyond the top-p boundary term
                diff = (np.abs(o.logprobs - recomputed.numpy()) - math.log(1 / top_p)).clip(min=0) * temperature
                worst_logprob = max(worst_logprob, float(diff.max()))
    finally:
        engine.close()
    every = np.concatenate(found)
    largest = float(every.max())
    honest_gaps = np.concatenate(gaps) if gaps else np.zeros(0)
    widest = float(honest_gaps.max()) if len(honest_gaps) else 0.0
    # the margin holds the larger of the two with the safety factor: a flip's gap is a spread's share, but the
    # replayable engine's flips were seen beyond the listed tokens' spreads (another run, other batch neighbours)
    tolerance = replay_tolerance(max(largest, widest), args.safety)
    held = float(np.quantile(honest_gaps, args.tie_quantile)) if len(honest_gaps) else 0.0
    tie = min(tie_tolerance(held), tolerance)
    costs = [float(near_tie_costs(g, 2 * tie).sum()) for g in gaps]
    cost = sum(costs)
    rate = near_tie_rate(cost / max(tie_tokens, 1), args.rate_safety)
    by_batch = np.bincount(np.asarray(batch_of, dtype=np.int64), weights=costs) if costs else np.zeros(1)
    # the ledger's slack holds the costliest honest batch seen, with the same room as the rate
    slack = max(2.0, math.ceil(10 * args.rate_safety * float(by_batch.max())) / 10)
    logprob = logprob_tolerance(worst_logprob, args.safety)
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
        "tie_tokens": tie_tokens,
        "honest_near_ties": int(len(honest_gaps)),
        "honest_near_tie_share_of_tokens": round(len(honest_gaps) / max(tie_tokens, 1), 5),
        "honest_gap_quantiles": {
            q: round(float(np.quantile(honest_gaps, float(q))), 4) if len(honest_gaps) else 0.0
            for q in ("0.5", "0.9", "1.0")
        },
        "tie_quantile": args.tie_quantile,
        "tie_logit_tolerance": tie,
        "honest_near_tie_cost_per_token": round(cost / max(tie_tokens, 1), 6),
        "rate_safety": args.rate_safety,
        "near_tie_rate": rate,
        "honest_batches": int(len(by_batch)),
        "honest_batch_cost_max": round(float(by_batch.max()), 3),
        "near_tie_slack": slack,
        "honest_logprob_diff_max": round(worst_logprob, 4),
        "max_logprob_diff": logprob,
        "logprob_dtype_default": MAX_LOGPROB_DIFF.get(cfg.worker.dtype, MAX_LOGPROB_DIFF["bfloat16"]),
        "seconds": round(time.monotonic() - started, 1),
    }
    snippet = (
        f"[validator]\nreplay_logit_tolerance = {tolerance}\ntie_logit_tolerance = {tie}\n"
        f"max_logprob_diff = {logprob}\n\n"
        f"[orchestrator]\nnear_tie_rate = {rate}\nnear_tie_slack = {slack}\n"
    )
    if args.write:
        args.write.write_text(
            f"# benchmarks/replay_margin.py: largest honest spread {largest:.4f} over {len(every)} positions of "
            f"{model} ({cfg.worker.dtype} worker, {cfg.validator.dtype} validator), x {args.safety} / 2; honest "
            f"near-tie gaps' {args.tie_quantile:g} quantile {held:.4f}; honest near-tie cost "
            f"{cost / max(tie_tokens, 1):.6f} per token x {args.rate_safety}\n{snippet}"
        )
    print(json.dumps(report))
    print(snippet, end="", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
