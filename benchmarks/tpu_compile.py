"""The shipped recipes' learner steps compiled for their TPU slices by XLA:TPU, on this host (libtpu installed).

Cases (`--cases`, default all):
- `qwq32b`: configs/intellect2_qwq32b.toml (QwQ-32B's shape from configs/shapes/qwq-32b) on v5p-128, the recipe's
  mesh data 1 x fsdp 16 x tensor 4, full depth;
- `q05`: configs/qwen2_5_0_5b_gsm8k.toml (Qwen2.5-0.5B's shape) on v5p-8, mesh data 1 x fsdp 4, full depth (24
  layers), and `q05_4layers`: the same at 4 layers, for the ratio of the compile times (scanned layers: the
  program holds one layer whatever the depth).

Attention is `splash` in every case. For each: compile time, XLA:TPU's per-chip peak against the chip's HBM,
FLOPs and bytes per step and the roofline step time (`intellect.plan_tpu`), and, with `--cpu-plan`, the XLA:CPU
estimate `intellect plan` gives for the same mesh on fake CPU devices (scanned layers, as the TPU runs them)
beside it, with the ratio. One JSON object per case on stdout as each finishes, then a summary object. Big: run
it under `flock /tmp/heavy.lock`.

    python benchmarks/tpu_compile.py [--cases q05_4layers,q05,qwq32b] [--cpu-plan] \
        [--set qwq32b:--trainer.micro_batch_size=8]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = {  # in the order they run: the first compile of a process also loads libtpu
    "q05_4layers": ("configs/qwen2_5_0_5b_gsm8k.toml", "configs/shapes/qwen2.5-0.5b", "v5p-8", ["layers=4"]),
    "q05": ("configs/qwen2_5_0_5b_gsm8k.toml", "configs/shapes/qwen2.5-0.5b", "v5p-8", []),
    "qwq32b": ("configs/intellect2_qwq32b.toml", "configs/shapes/qwq-32b", "v5p-128", []),
}
PEAK = re.compile(r"^\s+peak\s+([\d.]+) (GiB|MiB)", re.M)


def _shape_dir(shape: str, layers: int | None, out: Path) -> Path:
    if layers is None:
        return ROOT / shape
    hf = json.loads((ROOT / shape / "config.json").read_text())
    hf["num_hidden_layers"] = layers
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf))
    return out


def cpu_plan_peak(recipe: str, model_dir: Path, devices: int, extra: list[str], timeout: float) -> dict:
    """`intellect plan` on `devices` fake CPU devices (its XLA:CPU estimate), scanned layers: the peak per device."""
    cmd = [
        sys.executable,
        "-m",
        "intellect",
        "plan",
        recipe,
        "--model.path",
        str(model_dir),
        "--devices",
        str(devices),
        "--model.scan_layers",
        "true",
        "--model.attention",
        "xla",
        *extra,
    ]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"cpu_plan_error": f"did not finish in {timeout:.0f} s", "cpu_plan_cmd": " ".join(cmd[2:])}
    found = PEAK.search(done.stdout)
    if not found:
        return {"cpu_plan_error": (done.stdout + done.stderr)[-800:], "cpu_plan_cmd": " ".join(cmd[2:])}
    peak = float(found.group(1)) * (2**30 if found.group(2) == "GiB" else 2**20)
    return {
        "cpu_peak_gib": round(peak / 2**30, 2),
        "cpu_plan_s": round(time.perf_counter() - t0, 1),
        "cpu_plan_cmd": " ".join(cmd[2:]),
    }


def run_case(name: str, extra: list[str], cpu_plan: bool, cpu_timeout: float, work: Path) -> dict:
    from intellect.config_io import load_config
    from intellect.plan_tpu import plan_tpu
    from jax_trainer.topology import slice_spec

    recipe, shape, topology, opts = CASES[name]
    layers = next((int(o.split("=")[1]) for o in opts if o.startswith("layers=")), None)
    model_dir = _shape_dir(shape, layers, work / name)
    overrides = ["--model.path", str(model_dir), "--model.attention", "splash", *extra]
    if topology == "v5p-8":
        overrides += ["--trainer.fsdp=-1"]
    cfg = load_config(ROOT / recipe, overrides)
    t0 = time.perf_counter()
    result = plan_tpu(cfg, topology)
    plan, cost, chip = result["plan"], result["cost"], slice_spec(topology).chip
    out = {
        "case": name,
        "recipe": recipe,
        "topology": topology,
        "mesh": result["mesh"],
        "layers": result["layers"],
        "rows_x_seq": f"{result['rows']} x {result['seq_len']}",
        "overrides": extra,
        "attention": result["attention"],
        "mosaic_calls": result["mosaic_calls"],
        "compile_s": result["compile_s"],
        "plan_s": round(time.perf_counter() - t0, 1),
        "params_gib": round(plan.params / 2**30, 3),
        "opt_state_gib": round(plan.opt_state / 2**30, 3),
        "temporaries_gib": round(plan.temporaries / 2**30, 3),
        "tpu_peak_gib": round(plan.peak / 2**30, 3),
        "hbm_gib": round(chip.hbm_bytes / 2**30, 1),
        "fits": result["fits"],
        "advice": result["advice"],
        "flops_per_step": float(f"{cost.flops:.4g}"),
        "cost_program_loops": result["cost_loops"],
        "bytes_per_step": float(f"{cost.bytes:.4g}"),
        "bytes_per_step_high": float(f"{cost.bytes_high:.4g}"),
        "splash_flops_estimate": float(f"{cost.attention_flops:.4g}"),
        "roofline_s": float(f"{result['roofline_s']:.4g}"),
        "roofline_with_kernels_s": float(f"{result['roofline_with_kernels_s']:.4g}"),
    }
    if cpu_plan:
        cpu = cpu_plan_peak(recipe, model_dir, result["chips"], extra, cpu_timeout)
        out.update(cpu)
        if "cpu_peak_gib" in cpu:
            out["cpu_over_tpu_peak"] = round(cpu["cpu_peak_gib"] / out["tpu_peak_gib"], 2)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--cpu-plan", action="store_true", help="also run `intellect plan` on fake CPU devices")
    p.add_argument("--cpu-timeout", type=float, default=1800.0)
    p.add_argument("--set", action="append", default=[], help="CASE:--section.key=value, an override for one case")
    p.add_argument("--work", type=Path, default=Path("/tmp/tpu_compile_bench"))
    args = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jax_trainer import xla_flags

    xla_flags.apply("tpu")
    results = {}
    for name in args.cases.split(","):
        extra = [s.split(":", 1)[1] for s in args.set if s.split(":", 1)[0] == name]
        results[name] = run_case(name, extra, args.cpu_plan, args.cpu_timeout, args.work)
        print(json.dumps(results[name]), flush=True)
    summary = {"summary": True}
    if "q05" in results and "q05_4layers" in results:
        summary["q05_compile_24_over_4_layers"] = round(
            results["q05"]["compile_s"] / results["q05_4layers"]["compile_s"], 2
        )
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
