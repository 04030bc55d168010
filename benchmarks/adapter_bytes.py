"""Bytes and export time of a LoRA version beside the whole model's, in one run.

For a model directory (default: the imported SmolLM2-135M-Instruct) the learner's two exports of one version
are written and timed: the merged model (`export_hf`, what a full fine-tuning run ships every version) and the
adapter alone (`export_adapter`, a PEFT directory), both in `--dtype`, with a trained-looking adapter (B drawn
at random; a fresh B = 0 would compress to nothing on the wire). Each shape of `configs/shapes` is then counted
by the same code (`tensor_specs`, `peft_specs`) without writing anything: the QwQ-32B row is computed, not
measured.

`--train-steps N` also trains fresh adapters (B = 0) for N GRPO steps with `--recipe`'s optimizer and loss (pi_old
recomputed: the synthetic batches, `--train-rows` random sequences of the recipe's `max_seq_len` with random
advantages, a new one each step, carry no engine's logprobs), exports the adapter after each step in float32
and bfloat16, and reports each version's SHARDCAST delta (`bridge.shardcast.delta.encode_delta`) of
adapter_model.safetensors against the previous version: `trained.delta_ratio[dtype]` = delta bytes / file bytes
for versions 2..N (`bridge.adapters.write_adapter` writes a delta only where this is at most 0.5).

    XLA_FLAGS=--xla_force_host_platform_device_count=1 python benchmarks/adapter_bytes.py [--model DIR]
        [--rank 16] [--dtype float32] [--repeat 3] [--train-steps 0] [--train-rows 8]
        [--recipe configs/smollm2_135m_chain_sum_lora.toml]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from bridge.shardcast.delta import encode_delta
from bridge.weights import DTYPES, model_digest
from jax_trainer.models import ModelConfig, load_hf, tensor_specs
from jax_trainer.models.hf import export_adapter, export_hf, with_random_b
from jax_trainer.models.lora import TARGETS, LoraSpec, peft_specs
from jax_trainer.sharding import make_mesh

ROOT = Path(__file__).resolve().parents[1]


def counted(config: dict, spec: LoraSpec, dtype: str) -> dict:
    """Tensor bytes of the whole model and of the adapter of `spec`, from the specs alone."""
    cfg = ModelConfig.from_hf(config)
    size = DTYPES[dtype].itemsize
    full = sum(math.prod(s.hf_shape) for s in tensor_specs(cfg)) * size
    adapter = sum(math.prod(s.hf_shape) for s in peft_specs(cfg, spec)) * size
    return {"model_bytes": full, "adapter_bytes": adapter, "ratio": round(full / adapter, 1)}


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def synthetic_batch(vocab: int, rows: int, seq: int, seed: int):
    """`rows` random sequences of `seq` tokens (the first half prompt), each with a random advantage."""
    from jax_trainer.packing import Sample, pack

    rng = np.random.default_rng(seed)
    prompt = seq // 2
    samples = [
        Sample(rng.integers(0, vocab, seq).astype(np.int32), prompt, np.zeros(seq, np.float32), float(rng.normal()), 0)
        for _ in range(rows)
    ]
    return pack(samples, rows=rows, seq_len=seq)


def trained_deltas(args, spec: LoraSpec, digest: str, tmp: Path) -> dict:
    """Delta ratios of consecutive adapter versions of `args.train_steps` real training steps (module docstring)."""
    from intellect.config_io import load_config
    from jax_trainer.train_step import GRPOTrainer, trainable

    recipe = load_config(args.recipe)
    loss = recipe.loss.model_copy(update={"logprob_source": "recompute"})
    mesh = make_mesh(fsdp=1, devices=jax.devices()[:1])
    model = load_hf(args.model, mesh=mesh, lora=spec)
    trainer = GRPOTrainer(model, mesh, loss, recipe.optim)
    state = trainer.init_state(trainable(model))
    seq, vocab = recipe.model.max_seq_len, model.cfg.vocab_size
    dtypes = ("float32", "bfloat16")
    ratios: dict[str, list[float]] = {d: [] for d in dtypes}
    file_bytes, losses = {}, []
    for version in range(1, args.train_steps + 1):
        batch = trainer.device_batch(synthetic_batch(vocab, args.train_rows, seq, seed=version))
        state, metrics = trainer.step(state, batch)
        losses.append(round(float(metrics["loss"]), 4))
        trained = trainer.model(state.params)
        for dtype in dtypes:
            out = tmp / "trained" / dtype / str(version)
            export_adapter(trained, out, version=version, base_digest=digest, dtype=dtype)
            target = out / "adapter_model.safetensors"
            file_bytes[dtype] = target.stat().st_size
            if version > 1:
                base = out.parent / str(version - 1) / "adapter_model.safetensors"
                size, _ = encode_delta(base, target, out.parent / "delta.xzst")
                ratios[dtype].append(round(size / file_bytes[dtype], 3))
    return {
        "recipe": str(args.recipe),
        "steps": args.train_steps,
        "rows": args.train_rows,
        "seq": seq,
        "lr": recipe.optim.lr,
        "losses": losses,
        "adapter_file_bytes": file_bytes,
        "delta_versions": list(range(2, args.train_steps + 1)),
        "delta_ratio": ratios,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "smollm2-135m")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--train-steps", type=int, default=0, help="train this many steps and report delta ratios")
    ap.add_argument("--train-rows", type=int, default=8, help="sequences per training step")
    ap.add_argument("--recipe", type=Path, default=ROOT / "configs" / "smollm2_135m_chain_sum_lora.toml")
    args = ap.parse_args()
    spec = LoraSpec(args.rank, 2.0 * args.rank, tuple(TARGETS))

    model = with_random_b(load_hf(args.model, mesh=make_mesh(fsdp=1, devices=jax.devices()[:1]), lora=spec), 1e-3)
    digest = model_digest(args.model)
    times = {"merged": [], "adapter": []}
    sizes = {}
    with tempfile.TemporaryDirectory(prefix="adapter-bytes-") as tmp:
        for i in range(args.repeat + 1):  # the first of each compiles its layout kernels: not counted
            for kind in ("merged", "adapter"):
                out = Path(tmp) / f"{kind}-{i}"
                t0 = time.perf_counter()
                if kind == "merged":
                    export_hf(model, out, version=i, source_dir=args.model, dtype=args.dtype)
                else:
                    export_adapter(model, out, version=i, base_digest=digest, dtype=args.dtype)
                if i:
                    times[kind].append(time.perf_counter() - t0)
                sizes[kind] = directory_bytes(out)
        trained = trained_deltas(args, spec, digest, Path(tmp)) if args.train_steps else None
    shapes = {
        d.name: counted(json.loads((d / "config.json").read_text()), spec, "bfloat16")
        for d in sorted((ROOT / "configs" / "shapes").iterdir())
        if (d / "config.json").is_file()
    }
    print(
        json.dumps(
            {
                "benchmark": "adapter_bytes",
                "model": str(args.model),
                "rank": spec.rank,
                "alpha": spec.alpha,
                "targets": list(spec.targets),
                "dtype": args.dtype,
                "measured": {
                    "merged_dir_bytes": sizes["merged"],
                    "adapter_dir_bytes": sizes["adapter"],
                    "ratio": round(sizes["merged"] / sizes["adapter"], 1),
                    "merged_export_s": round(statistics.median(times["merged"]), 2),
                    "adapter_export_s": round(statistics.median(times["adapter"]), 3),
                },
                "counted_bfloat16": shapes,
                **({"trained": trained} if trained else {}),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
