"""Bytes and export time of a LoRA version beside the whole model's, in one run.

For a model directory (default: the imported SmolLM2-135M-Instruct) the learner's two exports of one version
are written and timed: the merged model (`export_hf`, what a full fine-tuning run ships every version) and the
adapter alone (`export_adapter`, a PEFT directory), both in `--dtype`, with a trained-looking adapter (B drawn
at random; a fresh B = 0 would compress to nothing on the wire). Each shape of `configs/shapes` is then counted
by the same code (`tensor_specs`, `peft_specs`) without writing anything: the QwQ-32B row is computed, not
measured.

    XLA_FLAGS=--xla_force_host_platform_device_count=1 python benchmarks/adapter_bytes.py [--model DIR]
        [--rank 16] [--dtype float32] [--repeat 3]

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "smollm2-135m")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--repeat", type=int, default=3)
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
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
