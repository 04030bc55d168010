"""The worker's near-tie ledger at other rates, offline: the near-tie cheater's gain and honest workers' strikes.

`benchmarks/near_tie_cheater.py --dump FILE` records, per batch, each honest sample's reward, near-tie cost and
completion tokens as the validator's replay priced them, and every swap the cheater could make (a wrong sample
replaced by the task's answer: its near-tie cost and tokens). The ledger's outcome depends on nothing else, so
this replays, for each ledger (`[orchestrator] near_tie_rate`, `near_tie_slack`), exactly what the online
cheater does (cheapest swap first, while the batch stays within its per-batch budget and the worker's accepted
batches within rate x tokens + slack) and what honest workers' ledgers do:

- the cheater's gain: the mean reward of its accepted batches minus the honest samples' mean, in points (and
  minus the honest mean of the same batches), and its strikes (batches the ledger rejected: three within an hour
  ban the key); besides, the cheater that keeps just enough of its allowance unspent to take no strike;
- honest strikes: a worker whose engines round as the measured honest ones do, and whose pool was calibrated
  from `--calibration-batches` honest batches (`intellect calibrate`'s default: 2,048 samples in the pool's
  batches of 64), sends `--life` batches; the ledger turns each batch that would take it over its allowance into
  a rejection (a strike). Bootstrapped: each of `--trials` trials draws a calibration and a life from the
  measured honest batches (with replacement); reported are the share of lives with a strike and the strikes per
  1,000 batches. The calibration sets the rate and slack as `intellect calibrate` does: `--rate-safety` x the
  honest cost per token, and that many times the costliest honest batch (at least 2) as the slack.

Besides, what the learner's default leaves the cheater (`near_tie_samples_dropped`: every sample whose replay
took a near tie is left out of training, `dropping`): its gain in the mean reward of what trains, where it can
only take the swaps that cost nothing and leave out wrong samples by making them take a near tie (at 1 and at the
floor 0.25 each), and the share of honest samples left out.

Ledgers (`--rate-safety`, a comma list): each rate-safety factor applied to the honest cost per token measured by
the calibration file (`--calibration`, its `near_tie_rate` / 2 by default) for the cheater, and to each trial's
own calibration for honest workers.

    python benchmarks/near_tie_ledger.py DUMP [DUMP ...] --calibration CAL.toml [--rate-safety 1,1.25,1.5,2]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tomllib
from pathlib import Path

import numpy as np


def _batch_ok(cost: float, tokens: int, budgets) -> bool:
    """`gpu_workers.checks.check_near_tie_budget`: the batch's near-tie cost within max(per sample, share x tokens)."""
    per_sample, _, per_batch_token = budgets
    return cost <= max(per_sample, per_batch_token * tokens)


def cheat(batches: list[dict], rate: float, slack: float, budgets, reserve: float = 0.0) -> dict:
    """The online cheater of near_tie_cheater.py replayed under the ledger (rate, slack), keeping `reserve` of its
    allowance unspent (0: it spends to the limit, as the online one does).

    `gain_points`: its accepted batches' mean reward minus every honest sample's (near_tie_cheater.py's figure);
    `matched_gain_points`: minus the honest samples of the same batches (a rejected batch trains nothing either
    way); `strikes`: its batches the ledger rejected (each a strike: `ban_after_rejections` of them within
    `rejection_window_s` ban the key)."""
    spent, judged = 0.0, 0
    honest_rewards, cheat_rewards, matched, swapped, strikes = [], [], [], 0, 0
    for b in batches:
        honest_rewards += b["rewards"]
        if not b["honest_accepted"]:  # its honest samples fail the validator: so does every version of the batch
            continue
        cost, tokens = list(b["cost"]), list(b["tokens"])
        rewards = list(b["rewards"])
        for i, c, t, _ in sorted(b["candidates"], key=lambda x: x[1]):
            trial_cost = sum(cost) - cost[i] + c
            trial_tokens = sum(tokens) - tokens[i] + t
            within = spent + trial_cost <= rate * (judged + trial_tokens) + slack - reserve
            if within and _batch_ok(trial_cost, trial_tokens, budgets):
                cost[i], tokens[i], rewards[i] = c, t, 1.0
                swapped += 1
        if spent + sum(cost) <= rate * (judged + sum(tokens)) + slack:
            spent, judged = spent + sum(cost), judged + sum(tokens)
            cheat_rewards += rewards
            matched += b["rewards"]
        else:
            strikes += 1
    honest, cheater = float(np.mean(honest_rewards)), float(np.mean(cheat_rewards)) if cheat_rewards else math.nan
    return {
        "gain_points": round(100 * (cheater - honest), 2),
        "matched_gain_points": round(100 * (cheater - float(np.mean(matched))), 2) if matched else math.nan,
        "strikes": strikes,
        "swapped": swapped,
        "cheat_reward": round(cheater, 4),
    }


def strike_free(batches: list[dict], rate: float, slack: float, budgets) -> dict:
    """The cheater that keeps the smallest reserve (in steps of 0.25) with which it took no strike over these
    batches, chosen knowing them (so at least as well as a cheater could do without a strike)."""
    for quarter in range(0, 4 * int(slack + 20 + rate * 1e5)):
        row = cheat(batches, rate, slack, budgets, quarter / 4)
        if row["strikes"] == 0:
            return {"reserve": quarter / 4, **row}
    return {"reserve": None}


def dropping(batches: list[dict], rate: float, slack: float, budgets, drop_cost: float | None) -> dict:
    """What trains where the learner leaves out every sample whose replay took a near tie (`[loss]
    near_tie_samples = "drop"`, the default): an honest worker's samples with no near-tie cost train; the
    cheater's near-tie swaps train nothing, so it takes only the swaps that cost nothing (the task's answer is
    the seed's own choice by the validator's logits, where its engine's rounding had taken another token), and
    then selects: it makes wrong samples (lowest reward first) take a near tie, at `drop_cost` each (1 beyond the
    tie margin, the floor 0.25 within it; assumed available in every sample), or, with `drop_cost` None, at each
    sample's own cheapest near tie as the dump measured it (`cheapest`; a sample offering none stays), so that
    they do not train, while its batch stays within the per-batch budget and its accepted batches within the
    ledger (rate, slack).

    `gain_points`: its trained samples' mean reward minus the honest trained samples' of the same batches;
    `honest_dropped_share`: the honest samples left out (the defence's cost to honest work)."""
    spent, judged, strikes = 0.0, 0, 0
    honest_trained, cheat_trained, dropped, total, free_swaps, selected = [], [], 0, 0, 0, 0
    for b in batches:
        if not b["honest_accepted"]:
            continue
        cost, tokens, rewards = list(b["cost"]), list(b["tokens"]), list(b["rewards"])
        total += len(cost)
        dropped += sum(c > 0 for c in cost)
        for i, c, t, _ in b["candidates"]:
            if c == 0:  # the answer is the seed's own choice: it trains as an honest sample would
                cost[i], tokens[i], rewards[i] = 0.0, t, 1.0
                free_swaps += 1
        price = [drop_cost] * len(cost) if drop_cost is not None else list(b["cheapest"])
        order = sorted((r, price[i] or 0.0, i) for i, (r, c) in enumerate(zip(rewards, cost)) if c == 0 and price[i])
        for r, p, i in order:  # the lowest rewards first, the cheapest first among equals
            trained = [x for x, c in zip(rewards, cost) if c == 0]
            if not trained or r >= float(np.mean(trained)):
                break  # leaving out a sample at or above the trained mean does not raise it
            trial = sum(cost) + p
            if spent + trial > rate * (judged + sum(tokens)) + slack or not _batch_ok(trial, sum(tokens), budgets):
                continue  # a cheaper one may still fit
            cost[i] = p
            selected += 1
        if spent + sum(cost) <= rate * (judged + sum(tokens)) + slack:
            spent, judged = spent + sum(cost), judged + sum(tokens)
            cheat_trained += [r for r, c in zip(rewards, cost) if c == 0]
            honest_trained += [r for r, c in zip(b["rewards"], b["cost"]) if c == 0]
        else:
            strikes += 1
    gain = float(np.mean(cheat_trained)) - float(np.mean(honest_trained)) if cheat_trained else math.nan
    return {
        "drop_cost": "each sample's cheapest" if drop_cost is None else drop_cost,
        "gain_points": round(100 * gain, 2),
        "strikes": strikes,
        "free_swaps": free_swaps,
        "selected": selected,
        "honest_dropped_share": round(dropped / max(total, 1), 4),
    }


def honest_strikes(costs: np.ndarray, tokens: np.ndarray, rate: float, slack: float) -> int:
    """Strikes of an honest worker sending these batches under the ledger: each batch that would take its accepted
    batches over rate x tokens + slack is rejected (and not counted in the ledger)."""
    spent, judged, strikes = 0.0, 0, 0
    for c, t in zip(costs, tokens):
        if spent + c <= rate * (judged + t) + slack:
            spent, judged = spent + c, judged + t
        else:
            strikes += 1
    return strikes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dumps", nargs="+", type=Path, help="what near_tie_cheater.py --dump wrote")
    p.add_argument("--calibration", type=Path, required=True, help="what `intellect calibrate` wrote for the pool")
    p.add_argument("--honest-rate", type=float, default=None, help="honest cost per token (the file's rate / 2)")
    p.add_argument("--rate-safety", default="1,1.25,1.5,2")
    p.add_argument("--calibration-batches", type=int, default=32)
    p.add_argument("--life", type=int, default=500, help="batches an honest worker sends in a trial")
    p.add_argument("--trials", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    cal = tomllib.loads(args.calibration.read_text())
    honest_rate = args.honest_rate if args.honest_rate is not None else cal["orchestrator"]["near_tie_rate"] / 2
    dumps = [json.loads(d.read_text()) for d in args.dumps]
    budgets = dumps[0]["settings"]["near_ties"]
    batches = [b for d in dumps for b in d["batches"]]
    costs = np.array([sum(b["cost"]) for b in batches])
    tokens = np.array([sum(b["tokens"]) for b in batches])
    rng = np.random.default_rng(args.seed)
    out = {
        "dumps": [str(d) for d in args.dumps],
        "batches": len(batches),
        "honest_cost_per_token_in_dumps": round(float(costs.sum() / tokens.sum()), 6),
        "honest_rate_of_calibration": honest_rate,
        "calibration_slack": cal["orchestrator"]["near_tie_slack"],
        "ledgers": [],
    }
    # the learner's default: no sample with a near tie trains (the cheater's choices with it), at the calibration
    out["near_tie_samples_dropped"] = [
        dropping(batches, 2 * honest_rate, cal["orchestrator"]["near_tie_slack"], budgets, drop_cost)
        for drop_cost in (1.0, 0.25, *((None,) if all(b.get("cheapest") for b in batches) else ()))
    ]
    for safety in (float(x) for x in args.rate_safety.split(",")):
        rate = safety * honest_rate
        row = {"rate_safety": safety, "near_tie_rate": round(rate, 6)}
        row["cheater"] = cheat(batches, rate, cal["orchestrator"]["near_tie_slack"], budgets)
        row["strike_free_cheater"] = strike_free(batches, rate, cal["orchestrator"]["near_tie_slack"], budgets)
        lives_struck, strikes = 0, 0
        for _ in range(args.trials):
            pick = rng.integers(0, len(batches), args.calibration_batches)
            trial_rate = safety * costs[pick].sum() / max(tokens[pick].sum(), 1)
            trial_slack = max(2.0, math.ceil(10 * safety * costs[pick].max()) / 10)
            life = rng.integers(0, len(batches), args.life)
            s = honest_strikes(costs[life], tokens[life], trial_rate, trial_slack)
            lives_struck += s > 0
            strikes += s
        row["honest"] = {
            "lives_with_a_strike": round(lives_struck / args.trials, 4),
            "strikes_per_1000_batches": round(1000 * strikes / (args.trials * args.life), 3),
        }
        out["ledgers"].append(row)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
