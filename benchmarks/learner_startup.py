"""How long the learner takes to start: scanned against unrolled layers, side by side in one run (issue 33).

Each measurement runs in a child process of its own (a fresh JAX, no compilation cache), in turn:

- `step`: `GRPOTrainer`'s first step (its compile, plus one run) at `--depths` layers of a narrow Qwen2 shape
  (hidden 64, 4/2 heads, MLP 128, vocabulary 512, 2 x 128 tokens), with the layers scanned
  (`scan_layers = true`, the default on GPU and TPU) and unrolled (`false`, the CPU default): the
  scanned program holds one layer whatever the depth, so its compile time should not grow with depth.
- `startup`: `init_random` and `load_hf` of the Qwen2.5-0.5B shape (hidden 896, 24 layers, vocabulary 151,936)
  in float32, from a checkpoint that `export_hf` wrote first; `load_hf` twice (page cache cold-ish: the first
  read after the export; warm: the second).

Prints one JSON object: per depth, both first-step times and their ratio; the startup times. The figures are
CPU seconds of wall clock on whatever machine runs it; the GPU figures of the same quantities come from
`benchmarks/accelerator.py` (its `grpo_jax_0.5b` and `grpo_jax_0.5b_4layers` stages).

    python benchmarks/learner_startup.py [--depths 4,24] [--skip-startup]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
NARROW = dict(hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=512, batch=2, seq=128)
QWEN_0_5B = dict(hidden=896, intermediate=4864, layers=24, heads=14, kv_heads=2, vocab=151936)


def _model_config(s: dict):
    from jax_trainer.models import ModelConfig

    return ModelConfig(
        model_type="qwen2",
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=s["intermediate"],
        num_layers=s["layers"],
        num_heads=s["heads"],
        num_kv_heads=s["kv_heads"],
        head_dim=s["hidden"] // s["heads"],
        qkv_bias=True,
        tie_embeddings=True,
    )


def child_step(layers: int, scan: bool) -> dict:
    import jax
    from flax import nnx

    sys.path.insert(0, str(HERE))
    import train_step

    from jax_trainer.config import LossConfig, OptimConfig
    from jax_trainer.models import init_random
    from jax_trainer.sharding import make_mesh
    from jax_trainer.train_step import GRPOTrainer

    s = {**NARROW, "layers": layers}
    mesh = make_mesh(fsdp=1, devices=jax.devices()[:1])
    model = init_random(_model_config(s), mesh=mesh, param_dtype="float32", compute_dtype="float32", scan_layers=scan)
    trainer = GRPOTrainer(model, mesh, LossConfig(logprob_source="inference", temperature=1.0), OptimConfig(lr=1e-5))
    state = trainer.init_state(nnx.split(model)[1])
    batch = trainer.device_batch(train_step._packed(train_step.make_batch(argparse.Namespace(**s))))
    t0 = time.perf_counter()
    state, metrics = trainer.step(state, batch)
    jax.block_until_ready((state, metrics))
    return {"first_step_s": time.perf_counter() - t0, "loss": float(metrics["loss"])}


def child_startup() -> dict:
    import tempfile

    import jax
    from flax import nnx

    from jax_trainer.models import export_hf, init_random, load_hf
    from jax_trainer.sharding import make_mesh

    mesh = make_mesh(fsdp=1, devices=jax.devices()[:1])
    cfg = _model_config(QWEN_0_5B)
    out = {}
    t0 = time.perf_counter()
    model = init_random(cfg, mesh=mesh, param_dtype="float32", compute_dtype="float32")
    jax.block_until_ready(nnx.state(model))
    out["init_random_s"] = time.perf_counter() - t0
    hf = {
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
        "max_position_embeddings": 2048,
        "rope_theta": 1000000.0,
        "torch_dtype": "float32",
    }
    with tempfile.TemporaryDirectory(prefix="learner-startup-") as tmp:
        export_hf(model, tmp, version=0, hf_config=hf, dtype="float32", fsync=False)
        del model
        for key in ("load_hf_first_s", "load_hf_warm_s"):
            t0 = time.perf_counter()
            model = load_hf(tmp, mesh=mesh, param_dtype="float32", compute_dtype="float32", verify=False)
            jax.block_until_ready(nnx.state(model))
            out[key] = time.perf_counter() - t0
            del model
    return out


def _run_child(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", *args], capture_output=True, text=True, timeout=1800, check=False
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["exit %d" % proc.returncode])[-1]}
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", default="4,24", help="comma-separated layer counts for the first-step compile")
    ap.add_argument("--skip-startup", action="store_true", help="skip init_random/load_hf at the 0.5B shape")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        kind, *rest = args.child
        result = child_step(int(rest[0]), rest[1] == "scan") if kind == "step" else child_startup()
        print(json.dumps(result), flush=True)
        return 0
    report: dict = {"step": {}}
    for depth in (int(x) for x in args.depths.split(",")):
        scanned, unrolled = _run_child("step", str(depth), "scan"), _run_child("step", str(depth), "unroll")
        entry = {
            "scanned_first_step_s": scanned.get("first_step_s"),
            "unrolled_first_step_s": unrolled.get("first_step_s"),
        }
        if scanned.get("first_step_s") and unrolled.get("first_step_s"):
            entry["unrolled_over_scanned"] = unrolled["first_step_s"] / scanned["first_step_s"]
            entry["same_loss"] = abs(scanned["loss"] - unrolled["loss"]) <= 1e-4 * max(abs(unrolled["loss"]), 1e-3)
        for name, r in (("scanned", scanned), ("unrolled", unrolled)):
            if "error" in r:
                entry[f"{name}_error"] = r["error"]
        report["step"][str(depth)] = entry
        print(json.dumps({"depth": depth, **entry}), file=sys.stderr, flush=True)
    if not args.skip_startup:
        report["startup_0.5b"] = _run_child("startup")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
