"""Worker and validator throughput, side by side in one run: generation with TOPLOC proofs on vs off, the
validator's full check of the batches the worker just generated, and what replayable sampling costs each side.

    python benchmarks/worker.py [--configs tiny:float32,large:bfloat16,vocab32k:float32,...] [--prompts 8]
                                [--samples 8] [--max-tokens 128] [--repeat 5] [--parts proofs,sampler]

Per config (a tiny random model from `intellect.tiny_model`, run in the given dtype):

- one `gpu_workers.engine.Engine` (in-process vLLM, eager) generates an assignment's batch: `--prompts`
  prompts drawn from a fixed pool of random-token prompts by `bridge.assignment` (node key, version 0,
  assignment k = the round), `--samples` samples each with the assignment's seeds, `--max-tokens` new tokens,
  temperature 1 and top-p 0.95 (`--top-p`). Each round generates the batch twice on the SAME engine:
  `generate(..., proofs=True)` (capture hook recording, hidden states sorted per request, proofs built) and
  `generate(..., proofs=False)` (hook inactive, no proofs), the order alternating round by round so that
  noise from a shared machine hits both alike. Worker samples/s and tokens/s are per side; `on_over_off`
  is the median of the per-round ratios (target >= 0.95) and the ratio of the best runs. A shared machine
  moves wall-clock runs by more than the 5% at stake, so the proofs' own work is also timed directly (the
  hook's calls plus everything `Engine.generate` does around vLLM's `generate`: sorting the captured rows
  per request and building the proofs) and `from_proof_work` = 1 - (that work, on minus off) / on time.
- the validator (`gpu_workers.checks.validate_batch` with a `gpu_workers.prefill.Prefill` in the same dtype,
  the assignment, the declared sampling settings, the worker's dtype and the model's stop tokens: fixed data,
  termination, computation, sampling and replay checks; no reward function, rewards are computed alike on both
  sides) checks the proofs-on batch of the same round. `validator_over_worker` is validator samples/s over the
  worker's proofs-on samples/s on that batch, median of rounds and of best runs (target >= 5); the shares of
  the validator's time spent in the prefill forward, the TOPLOC check, the sampling check and the replay check
  are given too, and every batch must be accepted.

The `sampler` part (issue 17's measure), on the same engine and model, `--repeat` interleaved rounds (order
alternating):

- worker: the assignment's batch generated with proofs by the engine's replayable sampler
  (`[worker] sampler = "replayable"`: `gpu_workers.vllm_sampler.ReplayableSampler`, and the engine's check
  that every returned token is the sampler's choice) and by vLLM's own `Sampler` (`sampler="vllm"`), switched in
  place on the model runner between generations. Tokens/s per side; `replayable_over_vllm` is the median of the
  per-round tokens/s ratios (target >= 0.95) and the ratio of the best runs; as for proofs, the samplers' own
  work is also timed directly (`Sampler.sample` on each side, plus the replayable engine's token check) and
  `from_sampler_work` = 1 - (that work, replayable minus vllm) / replayable time;
- validator: `validate_batch` of the replayable batch with `Declared(sampler="replayable")` (every token
  replayed from its seed: `check_replay_batch` and the batch's near-tie budget) and with
  `Declared(sampler="vllm")` (the old checks only). Seconds per sample per side; the replay check's own time
  over the prefill's time in the same validation is `replay_over_prefill` (median of rounds; target <= 0.10),
  and the wall-clock difference of the two validations over the prefill is given too. Both must accept.

Models: `tiny` (hidden 128, 2 layers, vocab 512), `large` (hidden 512, 4 layers, vocab 2048), `vocab32k` and
`vocab152k` (hidden 256, 2 layers, the tokenizer's 512 tokens padded to a vocab of 32,000 / 151,936 as real
checkpoints pad theirs: the sampler and the replay work grow with the vocabulary, the rest of a tiny model does
not, so these are the hardest case for the targets). Random weights give flat next-token distributions (logits
spread ~3 units), where the replayable sampler hashes the whole vocabulary at every step; a trained policy's
peaked rows hash a few hundred tokens. `vocab32k-peaked` and `vocab152k-peaked` are the same models with the
final norm's weight x 4 (logits spread ~12 units), closer to a trained policy.

Both roles share this process and its 2 cores (vLLM sets torch's thread count; the figure is in the output).
Prints one JSON object; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import Progress  # noqa: E402

NODE_KEY = "ab" * 32
MODELS = {
    "tiny": {},  # make_tiny_model's defaults: hidden 128, 2 layers, 4 heads (head_dim 32), vocab 512
    "large": {"hidden": 512, "layers": 4, "heads": 8, "kv_heads": 4, "vocab": 2048},
    "vocab32k": {"hidden": 256, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 32000},
    "vocab152k": {"hidden": 256, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 151936},  # Qwen2.5's padded vocab
    # the same shapes with the final norm's weight x 4: logits spread ~12 instead of ~3 units, peaked like a
    # trained policy's (a few hundred tokens within reach of the Gumbel noise instead of the whole vocabulary)
    "vocab32k-peaked": {"hidden": 256, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 32000, "logit_scale": 4.0},
    "vocab152k-peaked": {"hidden": 256, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 151936, "logit_scale": 4.0},
}
PARTS = ("proofs", "sampler")
TEMPERATURE, TOP_P = 1.0, 0.95


@contextlib.contextmanager
def _stdout_to_stderr():
    """vLLM logs to stdout: point file descriptor 1 at stderr meanwhile, so that stdout holds only the JSON."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


class _Timed:
    """Wraps a callable and adds the seconds spent in it to `seconds`."""

    def __init__(self, fn) -> None:
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def _best_median(values: list[float]) -> dict[str, float]:
    return {"best": round(max(values), 2), "median": round(statistics.median(values), 2)}


def run_rounds(
    generate, validate, timed: dict[str, _Timed], timed_gen: dict[str, _Timed], args, progress: Progress, label: str
):
    """Warm up, then `args.repeat` rounds of proofs on/off (order alternating) and validation of the on batch.

    Per generation, the proofs' own work is also timed: the hook's calls plus everything `Engine.generate`
    does outside vLLM's `generate` (sorting rows per request, building proofs)."""
    warm, _ = generate(0, True, args.samples)  # untimed: first-call allocations, kernels, the proof table
    generate(0, False, args.samples)
    validate(0, warm)
    rows, same_tokens, rejected = [], True, []
    task = progress.add_task(label, total=args.repeat)
    for k in range(args.repeat):
        row = {}
        for proofs in (True, False) if k % 2 == 0 else (False, True):
            for part in timed_gen.values():
                part.seconds = 0.0
            completions, seconds = generate(k, proofs)
            side = "on" if proofs else "off"
            row[side], row[f"tokens_{side}"] = seconds, sum(len(c.tokens) for c in completions)
            row[f"proof_work_{side}"] = seconds - timed_gen["vllm_generate"].seconds + timed_gen["hook"].seconds
            if proofs:
                on = completions
            else:
                off = completions
        if not all(c.proofs for c in on) or any(c.proofs for c in off):
            raise RuntimeError(f"round {k}: proofs=True must give proofs for every sample, proofs=False none")
        same_tokens &= [c.tokens for c in on] == [c.tokens for c in off]
        for part in timed.values():
            part.seconds = 0.0
        verdict, row["validate"] = validate(k, on)
        row.update({part: t.seconds for part, t in timed.items()})
        if not verdict.accepted:
            rejected.append({"round": k, "reasons": verdict.reasons(5)})
        row["summary"] = verdict.summary()
        rows.append(row)
        progress.advance(task)
    return rows, same_tokens, rejected


def _scale_logits(model_dir: Path, factor: float) -> None:
    """Multiply the final norm's weight by `factor` (every logit scales by it)."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * factor
    save_file(tensors, path, metadata={"format": "pt"})


def _install_bench_samplers(worker) -> dict:
    """Keep the runner's replayable sampler and a vLLM `Sampler` side by side (once); returns both."""
    from vllm.v1.sample.sampler import Sampler

    from gpu_workers.vllm_sampler import ReplayableSampler

    runner = worker.model_runner
    if not hasattr(runner, "bench_samplers"):
        if not isinstance(runner.sampler, ReplayableSampler):
            raise RuntimeError(
                "the engine was expected to start with the replayable sampler ([worker] sampler default)"
            )
        runner.bench_samplers = {
            "replayable": runner.sampler,
            "vllm": Sampler(logprobs_mode=runner.sampler.logprobs_mode),
        }
    return runner.bench_samplers


def _use_sampler(worker, name: str) -> None:
    runner = worker.model_runner
    runner.sampler = runner.bench_samplers[name]


def run_sampler_rounds(engine, generate, validate_declared, declared, args, progress: Progress, label: str) -> dict:
    """Interleaved rounds on one engine: generation with the replayable sampler vs vLLM's, and validation of the
    replayable batch with and without the replay check (see the module docstring)."""
    import dataclasses

    from gpu_workers import checks

    samplers = engine.llm.collective_rpc(_install_bench_samplers)[0]  # in process: the objects themselves
    work = {name: _Timed(sampler.sample) for name, sampler in samplers.items()}
    for name, sampler in samplers.items():
        sampler.sample = work[name]  # an instance attribute shadows the method
    check = _Timed(engine._check_replayed)
    engine._check_replayed = check
    worker_config = engine.config
    timed = {
        "prefill": validate_declared.prefill_timer,
        "replay_check": _Timed(checks.check_replay_batch),
        "near_tie_budget": _Timed(checks.check_near_tie_budget),
    }
    originals = checks.check_replay_batch, checks.check_near_tie_budget
    checks.check_replay_batch, checks.check_near_tie_budget = timed["replay_check"], timed["near_tie_budget"]
    declared_by = {
        "replay": dataclasses.replace(declared, sampler="replayable"),
        "no_replay": dataclasses.replace(declared, sampler="vllm"),
    }

    def use(name: str) -> None:
        engine.llm.collective_rpc(_use_sampler, args=(name,))
        engine.config = worker_config.model_copy(update={"sampler": name})

    rows, rejected = [], []
    try:
        for name in ("replayable", "vllm"):  # warm-up, untimed
            use(name)
            warm, _ = generate(0, True, args.samples)
        for side in declared_by:
            validate_declared(0, warm, declared_by[side])
        task = progress.add_task(f"{label} samplers", total=args.repeat)
        for k in range(args.repeat):
            row: dict = {}
            for name in ("replayable", "vllm") if k % 2 == 0 else ("vllm", "replayable"):
                use(name)
                work[name].seconds, check.seconds = 0.0, 0.0
                completions, seconds = generate(k, True)
                row[name], row[f"tokens_{name}"] = seconds, sum(len(c.tokens) for c in completions)
                row[f"work_{name}"] = work[name].seconds + (check.seconds if name == "replayable" else 0.0)
                if name == "replayable":
                    batch = completions
            for side in ("replay", "no_replay") if k % 2 == 0 else ("no_replay", "replay"):
                for t in timed.values():
                    t.seconds = 0.0
                verdict, row[f"validate_{side}"] = validate_declared(k, batch, declared_by[side])
                for part, t in timed.items():
                    row[f"{part}_{side}"] = t.seconds
                if not verdict.accepted:
                    rejected.append({"round": k, "declared": side, "reasons": verdict.reasons(5)})
            rows.append(row)
            progress.advance(task)
    finally:
        use("replayable")
        engine.config = worker_config
        del engine._check_replayed
        for sampler in samplers.values():
            del sampler.sample
        checks.check_replay_batch, checks.check_near_tie_budget = originals

    n = args.prompts * args.samples
    rep_tps = [r["tokens_replayable"] / r["replayable"] for r in rows]
    vllm_tps = [r["tokens_vllm"] / r["vllm"] for r in rows]
    ratio = statistics.median(a / b for a, b in zip(rep_tps, vllm_tps))
    from_work = statistics.median(1 - (r["work_replayable"] - r["work_vllm"]) / r["replayable"] for r in rows)
    replay_work = [r["replay_check_replay"] + r["near_tie_budget_replay"] for r in rows]
    over_prefill = statistics.median(w / r["prefill_replay"] for w, r in zip(replay_work, rows))
    wall_added = statistics.median((r["validate_replay"] - r["validate_no_replay"]) / r["prefill_replay"] for r in rows)
    return {
        "rounds": args.repeat,
        "worker": {
            "replayable": {
                "tokens_per_s": _best_median(rep_tps),
                "sampler_work_s": round(statistics.median(r["work_replayable"] for r in rows), 4),
            },
            "vllm": {
                "tokens_per_s": _best_median(vllm_tps),
                "sampler_work_s": round(statistics.median(r["work_vllm"] for r in rows), 4),
            },
            "seconds_per_round": {name: [round(r[name], 3) for r in rows] for name in ("replayable", "vllm")},
            "replayable_over_vllm": {
                "median_of_rounds": round(ratio, 3),
                "of_best": round(max(rep_tps) / max(vllm_tps), 3),
                "from_sampler_work": round(from_work, 3),
                "target": 0.95,
                "meets_target": ratio >= 0.95,
            },
        },
        "validator": {
            "s_per_sample": {
                side: round(statistics.median(r[f"validate_{side}"] for r in rows) / n, 5)
                for side in ("replay", "no_replay")
            },
            "prefill_s_per_sample": round(statistics.median(r["prefill_replay"] for r in rows) / n, 5),
            "replay_check_s_per_sample": round(statistics.median(replay_work) / n, 5),
            "replay_over_prefill": {
                "median_of_rounds": round(over_prefill, 4),
                "max_of_rounds": round(max(w / r["prefill_replay"] for w, r in zip(replay_work, rows)), 4),
                "target": 0.10,
                "meets_target": over_prefill <= 0.10,
            },
            "wall_clock_added_over_prefill": round(wall_added, 4),
            "batches_accepted": {
                side: args.repeat - sum(x["declared"] == side for x in rejected) for side in ("replay", "no_replay")
            },
            "rejected": rejected,
        },
    }


def bench_config(name: str, dtype: str, args, workdir: Path, progress: Progress) -> dict:
    import torch

    from bridge.assignment import assigned_sample_seeds, assigned_task_ids
    from gpu_workers import capture as capture_module
    from gpu_workers import checks
    from gpu_workers.checks import AssignedWork, Declared, Sample, stop_token_ids, validate_batch
    from gpu_workers.config import WorkerConfig
    from gpu_workers.engine import Engine
    from gpu_workers.prefill import Prefill
    from intellect.tiny_model import make_tiny_model

    shape = dict(MODELS[name])
    logit_scale = shape.pop("logit_scale", 1.0)
    model_dir = workdir / name
    if not (model_dir / "config.json").is_file():
        make_tiny_model(model_dir, **shape)
        if logit_scale != 1.0:
            _scale_logits(model_dir, logit_scale)
    config = json.loads((model_dir / "config.json").read_text())
    rng = np.random.default_rng(0)
    pool = [
        rng.integers(3, min(config["vocab_size"], 512), int(rng.integers(16, 65))).tolist() for _ in range(args.pool)
    ]
    max_model_len = 64 + args.max_tokens
    stops = stop_token_ids(model_dir)
    engine = Engine(model_dir, 0, WorkerConfig(dtype=dtype, verify_swaps=0), max_model_len)
    prefill = Prefill(model_dir, dtype=dtype)
    timed = {
        "prefill": _Timed(prefill.run),
        "computation_check": _Timed(checks.check_computation_batch),
        "sampling_check": _Timed(checks.check_sampling_batch),
        "replay_check": _Timed(checks.check_replay_batch),
    }
    prefill.run = timed["prefill"]
    declared = Declared(
        temperature=TEMPERATURE,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        stop_token_ids=stops,
        max_model_len=max_model_len,
        dtype=dtype,
    )
    n = args.prompts * args.samples

    def batch(k: int) -> tuple[list[list[int]], list[int], list[int]]:
        tasks = np.repeat(assigned_task_ids(NODE_KEY, 0, k, len(pool), args.prompts), args.samples).tolist()
        return [pool[t] for t in tasks], assigned_sample_seeds(NODE_KEY, 0, k, n), tasks

    def generate(k: int, proofs: bool, count: int = n):
        prompts, seeds, _ = batch(k)
        prompts, seeds = prompts[:count], seeds[:count]
        start = time.perf_counter()
        out = engine.generate(
            prompts, seeds, temperature=TEMPERATURE, top_p=args.top_p, max_tokens=args.max_tokens, proofs=proofs
        )
        return out, time.perf_counter() - start

    def validate(k: int, completions, declared: Declared = declared) -> tuple[object, float]:
        _, seeds, tasks = batch(k)
        if len(completions) < n:  # the warm-up's partial batch: no assignment to hold it to
            samples = [Sample.of(c) for c in completions]
            return validate_batch(samples, prefill, declared), 0.0
        samples = [
            Sample.of(c, seed=s, task_id=t, group_id=i // args.samples)
            for i, (c, s, t) in enumerate(zip(completions, seeds, tasks))
        ]
        assignment = AssignedWork(
            node_key=NODE_KEY,
            version=0,
            k=k,
            num_tasks=len(pool),
            samples_per_prompt=args.samples,
            prompt_tokens_of=lambda t, _target: pool[t],
        )
        start = time.perf_counter()
        verdict = validate_batch(samples, prefill, declared, assignment)
        return verdict, time.perf_counter() - start

    validate.prefill_timer = timed["prefill"]
    model = {
        "name": name,
        "hidden": config["hidden_size"],
        "layers": config["num_hidden_layers"],
        "heads": config["num_attention_heads"],
        "vocab": config["vocab_size"],
        "dtype": dtype,
        "logit_scale": logit_scale,
    }
    result: dict = {"model": model, "samples_per_batch": n, "max_tokens": args.max_tokens, "top_p": args.top_p}
    if "sampler" in args.parts:
        result["sampler"] = run_sampler_rounds(engine, generate, validate, declared, args, progress, f"{name} {dtype}")
    if "proofs" not in args.parts:
        result["torch_threads"] = torch.get_num_threads()
        engine.close()
        return result

    hook = _Timed(capture_module._Recorder.__call__)
    timed_gen = {"hook": hook, "vllm_generate": _Timed(engine.llm.generate)}
    engine.llm.generate = timed_gen["vllm_generate"]
    originals = (
        checks.check_computation_batch,
        checks.check_sampling_batch,
        checks.check_replay_batch,
        capture_module._Recorder.__call__,
    )
    checks.check_computation_batch, checks.check_sampling_batch, checks.check_replay_batch = (
        timed["computation_check"],
        timed["sampling_check"],
        timed["replay_check"],
    )
    capture_module._Recorder.__call__ = lambda self, *a: hook(self, *a)
    try:
        rows, same_tokens, rejected = run_rounds(
            generate, validate, timed, timed_gen, args, progress, f"{name} {dtype}"
        )
    finally:
        (
            checks.check_computation_batch,
            checks.check_sampling_batch,
            checks.check_replay_batch,
            capture_module._Recorder.__call__,
        ) = originals
        del engine.llm.generate
    threads = torch.get_num_threads()
    engine.close()

    on_sps = [n / r["on"] for r in rows]
    off_sps = [n / r["off"] for r in rows]
    val_sps = [n / r["validate"] for r in rows]
    on_over_off = statistics.median(r["off"] / r["on"] for r in rows)
    val_over_worker = statistics.median(r["on"] / r["validate"] for r in rows)
    # the noise-robust estimate: a proofs-on run minus its proof work is the same generation as a proofs-off run
    from_work = statistics.median(1 - (r["proof_work_on"] - r["proof_work_off"]) / r["on"] for r in rows)
    return {
        **result,
        "rounds": args.repeat,
        "torch_threads": threads,
        "seconds_per_round": {side: [round(r[side], 3) for r in rows] for side in ("on", "off", "validate")},
        "mean_tokens_per_sample": round(statistics.mean(r["tokens_on"] for r in rows) / n, 1),
        "worker": {
            "proofs_on": {
                "samples_per_s": _best_median(on_sps),
                "tokens_per_s": _best_median([r["tokens_on"] / r["on"] for r in rows]),
            },
            "proofs_off": {
                "samples_per_s": _best_median(off_sps),
                "tokens_per_s": _best_median([r["tokens_off"] / r["off"] for r in rows]),
            },
            "on_over_off": {
                "median_of_rounds": round(on_over_off, 3),
                "of_best": round(max(on_sps) / max(off_sps), 3),
                "from_proof_work": round(from_work, 3),
                "target": 0.95,
                "meets_target": on_over_off >= 0.95,
            },
            "proof_work_s": {
                "on": round(statistics.median(r["proof_work_on"] for r in rows), 4),
                "off": round(statistics.median(r["proof_work_off"] for r in rows), 4),
            },
            "same_tokens_on_off": same_tokens,
        },
        "validator": {
            "samples_per_s": _best_median(val_sps),
            "validator_over_worker": {
                "median_of_rounds": round(val_over_worker, 2),
                "of_best": round(max(val_sps) / max(on_sps), 2),
                "target": 5.0,
                "meets_target": val_over_worker >= 5.0,
            },
            "share_of_validation_time": {
                part: round(statistics.median(r[part] / r["validate"] for r in rows), 3) for part in timed
            },
            "batches_accepted": args.repeat - len(rejected),
            "rejected": rejected,
            "last_summary": rows[-1]["summary"],
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--configs",
        default="tiny:float32,tiny:bfloat16,large:float32,large:bfloat16",
        help=f"comma-separated MODEL:DTYPE, MODEL one of {', '.join(MODELS)}",
    )
    parser.add_argument("--prompts", type=int, default=8, help="prompts per batch")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per sample (at most)")
    parser.add_argument("--pool", type=int, default=64, help="random-token prompts (16-64 tokens) the tasks draw from")
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds per config (order alternates)")
    parser.add_argument(
        "--top-p",
        type=float,
        default=TOP_P,
        help="top-p of generation and validation (temperature 1; the demo and INTELLECT-2 use 1.0)",
    )
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help="comma-separated: proofs (TOPLOC on vs off, full validation), sampler (replayable vs "
        "vllm sampler, validation with vs without replay)",
    )
    args = parser.parse_args()
    args.parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not args.parts or not args.parts <= set(PARTS):
        parser.error(f"--parts: expected a comma-separated subset of {', '.join(PARTS)}")
    configs = []
    for item in args.configs.split(","):
        name, _, dtype = item.strip().partition(":")
        if name not in MODELS or dtype not in ("float32", "bfloat16"):
            parser.error(
                f"--configs: {item!r} is not MODEL:DTYPE with MODEL in {sorted(MODELS)} and DTYPE float32 or bfloat16"
            )
        configs.append((name, dtype))
    results = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        _stdout_to_stderr(),
        Progress(console=Console(stderr=True), transient=True) as progress,
    ):
        for name, dtype in configs:
            results.append(bench_config(name, dtype, args, Path(tmp), progress))
    print(json.dumps({"configs": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
