"""How a worker serves a LoRA version, measured both ways in one run: merged into the base (a plain model, what
`bridge.adapters.merge_adapter` writes) against vLLM's LoRA layers (`enable_lora`, one `LoRARequest` per
version), beside the base alone.

For a model directory (default: the imported SmolLM2-135M-Instruct) a trained-looking adapter (B drawn at
random) of `--rank` on all seven projections is written, then merged (timed: a worker pays it once per version).
Each side is a fresh in-process vLLM engine, one after the other, generating `--prompts` x `--tokens` tokens
(random prompts of 48 tokens, temperature 1, `ignore_eos`) for `--rounds` rounds after a warm-up; generated
tokens/s are medians over rounds. The LoRA side keeps `--max-loras` adapters resident, as a worker keeping two
versions would.

    XLA_FLAGS=--xla_force_host_platform_device_count=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
        python benchmarks/lora_serving.py [--model DIR] [--rank 16] [--prompts 32] [--tokens 64] [--rounds 2]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def write_adapter(model_dir: Path, out: Path, rank: int) -> Path:
    import jax

    from bridge.weights import model_digest
    from jax_trainer.models import load_hf
    from jax_trainer.models.hf import export_adapter, with_random_b
    from jax_trainer.models.lora import TARGETS, LoraSpec
    from jax_trainer.sharding import make_mesh

    spec = LoraSpec(rank, 2.0 * rank, tuple(TARGETS))
    model = load_hf(model_dir, mesh=make_mesh(fsdp=1, devices=jax.devices()[:1]), lora=spec)
    model = with_random_b(model, 1e-3)
    export_adapter(model, out, version=1, base_digest=model_digest(model_dir))
    return out


def generate(
    model_dir: Path, prompts: list[list[int]], tokens: int, rounds: int, adapter: Path | None, rank: int, max_loras: int
) -> list[float]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"enable_lora": True, "max_lora_rank": rank, "max_loras": max_loras} if adapter else {}
    llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, seed=0, max_model_len=256, **extra)
    request = None
    if adapter is not None:
        from vllm.lora.request import LoRARequest

        request = LoRARequest("v1", 1, str(adapter))
    params = SamplingParams(max_tokens=tokens, temperature=1.0, ignore_eos=True, seed=0)
    batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    try:
        llm.generate(batch[:2], SamplingParams(max_tokens=4), use_tqdm=False, lora_request=request)  # warm up
        out = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            results = llm.generate(batch, params, use_tqdm=False, lora_request=request)
            made = sum(len(r.outputs[0].token_ids) for r in results)
            out.append(made / (time.perf_counter() - t0))
        return out
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "smollm2-135m")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-loras", type=int, default=2)
    args = ap.parse_args()

    from bridge.adapters import merge_adapter
    from bridge.weights import model_digest

    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(1)
    prompts = [rng.integers(100, vocab, 48).tolist() for _ in range(args.prompts)]
    with tempfile.TemporaryDirectory(prefix="lora-serving-") as tmp:
        adapter = write_adapter(args.model, Path(tmp) / "adapter", args.rank)
        t0 = time.perf_counter()
        merge_adapter(
            args.model, adapter, Path(tmp) / "merged", version=1, dtype="float32", base_digest=model_digest(args.model)
        )
        merge_s = time.perf_counter() - t0
        sides = {
            "base": (args.model, None),
            "merged": (Path(tmp) / "merged", None),
            "lora": (args.model, adapter),
        }
        speeds = {
            name: generate(d, prompts, args.tokens, args.rounds, a, args.rank, args.max_loras)
            for name, (d, a) in sides.items()
        }
    median = {k: round(statistics.median(v), 1) for k, v in speeds.items()}
    print(
        json.dumps(
            {
                "benchmark": "lora_serving",
                "model": str(args.model),
                "rank": args.rank,
                "prompts": args.prompts,
                "tokens": args.tokens,
                "rounds": args.rounds,
                "merge_s": round(merge_s, 2),
                "decode_tokens_per_s": median,
                "per_round": {k: [round(x, 1) for x in v] for k, v in speeds.items()},
                "merged_over_base": round(median["merged"] / median["base"], 3),
                "lora_over_base": round(median["lora"] / median["base"], 3),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
