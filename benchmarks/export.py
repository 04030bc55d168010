"""Export speed of `jax_trainer.export` beside the raw file-write bandwidth of the same machine, in one run.

A random Qwen2-shaped model of ~500 MB in bfloat16 (float32 master weights, sharded over all local devices)
is exported as a Hugging Face directory (gather, layout transpose, bf16 cast, sha256, write). The baseline
writes the same number of bytes sequentially from a ready buffer. Both are timed with and without fsync (a
real export fsyncs before STABLE); the figure of merit is export MB/s / raw MB/s (target >= 0.5). The first
export of a process also compiles the small per-shape layout kernels; it is reported on its own, the medians
are of the exports after it (a learner exports every step).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/export.py [--repeat 3] [--layers 20]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from jax_trainer.models import ModelConfig, export_hf, init_random
from jax_trainer.sharding import make_mesh


def _config(layers: int) -> ModelConfig:
    return ModelConfig(
        model_type="qwen2",
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_layers=layers,
        num_heads=16,
        num_kv_heads=4,
        head_dim=64,
        qkv_bias=True,
        tie_embeddings=True,
    )


def _hf_config(cfg: ModelConfig) -> dict:
    return {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
    }


def raw_write(path: Path, nbytes: int, fsync: bool, chunk: int = 64 << 20) -> float:
    """Seconds to write `nbytes` sequentially from a ready buffer (the physical limit for the export)."""
    buf = np.random.default_rng(0).integers(0, 255, chunk, dtype=np.uint8)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(left, chunk)
            f.write(memoryview(buf)[:n])
            left -= n
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=20, help="decoder layers (20 -> ~518 MB in bf16)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir on the same disk as /tmp)")
    args = ap.parse_args()

    cfg = _config(args.layers)
    model = init_random(cfg, mesh=make_mesh(fsdp=-1), param_dtype="float32")
    root = Path(args.dir or tempfile.mkdtemp(prefix="export-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    results = {}
    try:
        t0 = time.perf_counter()  # the first export also compiles the per-shape layout kernels
        export_hf(model, root / "cold", version=0, hf_config=_hf_config(cfg), dtype="bfloat16")
        results["first_export_s"] = round(time.perf_counter() - t0, 3)
        shutil.rmtree(root / "cold")
        for fsync in (True, False):
            exp_s, raw_s, nbytes = [], [], 0
            for i in range(args.repeat):
                out = root / f"v{i:06d}"
                t0 = time.perf_counter()
                res = export_hf(model, out, version=i, hf_config=_hf_config(cfg), dtype="bfloat16", fsync=fsync)
                exp_s.append(time.perf_counter() - t0)
                nbytes = sum(p.stat().st_size for p in out.iterdir())
                shutil.rmtree(out)
                raw_s.append(raw_write(root / "raw.bin", nbytes, fsync))
                (root / "raw.bin").unlink()
            mb = nbytes / 1e6
            exp_mbps, raw_mbps = mb / statistics.median(exp_s), mb / statistics.median(raw_s)
            results["fsync" if fsync else "page_cache"] = {
                "export_MBps": round(exp_mbps, 1),
                "raw_write_MBps": round(raw_mbps, 1),
                "ratio": round(exp_mbps / raw_mbps, 3),
                "export_s": [round(s, 3) for s in exp_s],
                "raw_s": [round(s, 3) for s in raw_s],
            }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        json.dumps(
            {
                "benchmark": "export",
                "model_bytes": nbytes,
                "tensor_bytes": res.tensor_bytes,
                "params": res.tensor_bytes // 2,
                "devices": jax.device_count(),
                "repeat": args.repeat,
                **results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
