"""Asynchronous vs synchronous RL on the demo recipe: wall-clock per learner step and learner busy fraction.

Runs `intellect run configs/demo.toml` twice on this machine, with trainer.async_level 0 (on-policy: every step
waits for rollouts of the newest version) and 2 (workers generate with policies up to 2 versions old while the
learner trains), with the same seed, the same warm-started model and the same number of steps; evaluations are
off so that only the RL loop is timed. The warm start (`intellect sft`) runs once and both runs start from it.

Per run: seconds per step (from the learner's metrics.jsonl timestamps, first step excluded: it holds the
compilation and the first rollouts), the learner's busy fraction (time in the train step over time waiting
plus training), staleness, and the whole run's wall-clock.

    python benchmarks/async.py [--steps 12] [--config configs/demo.toml]

Prints one JSON object; `speedup` is async_level 0's seconds per step over async_level 2's (target >= 1.3).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def intellect(*argv: str, log: Path) -> float:
    env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "--xla_force_host_platform_device_count=2")}
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        code = subprocess.call(
            [sys.executable, "-m", "intellect", *argv], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT
        )
    if code != 0:
        raise SystemExit(f"intellect {argv[0]} failed ({code}); see {log}")
    return time.perf_counter() - t0


def learner_records(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("role") == "learner"]


def measure(config: Path, work: Path, sft: Path, async_level: int, steps: int) -> dict:
    run_dir = work / f"async{async_level}"
    wall = intellect(
        "run",
        str(config),
        "--run.dir",
        str(run_dir),
        "--run.sft_steps",
        "0",
        "--model.path",
        str(sft),
        "--trainer.async_level",
        str(async_level),
        "--trainer.steps",
        str(steps),
        "--run.eval_interval",
        "0",
        "--data.eval_tasks",
        "0",
        log=work / f"async{async_level}.log",
    )
    records = learner_records(run_dir)
    times = [r["time"] for r in records]
    per_step = [b - a for a, b in zip(times, times[1:])]
    return {
        "async_level": async_level,
        "steps": len(records),
        "run_wall_s": round(wall, 1),
        "s_per_step_mean": round(statistics.mean(per_step), 2),
        "s_per_step_median": round(statistics.median(per_step), 2),
        "learner_busy_frac_mean": round(statistics.mean(r["busy_frac"] for r in records[1:]), 3),
        "learner_wait_s_mean": round(statistics.mean(r["wait_s"] for r in records[1:]), 2),
        "learner_step_s_mean": round(statistics.mean(r["step_s"] for r in records[1:]), 2),
        "staleness_mean": round(statistics.mean(r["staleness_mean"] for r in records), 2),
        "reward_mean_last5": round(statistics.mean(r["reward_mean"] for r in records[-5:]), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "demo.toml")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--sft-steps", type=int, default=25)
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="async-bench-", dir=args.workdir))
    model = work / "tiny-model"
    intellect("make-tiny-model", str(model), "--family", "qwen2", log=work / "model.log")
    sft = work / "sft"
    sft_s = intellect(
        "sft",
        str(args.config),
        "--model.path",
        str(model),
        "--run.dir",
        str(work / "sft-run"),
        "--steps",
        str(args.sft_steps),
        "--out",
        str(sft),
        log=work / "sft.log",
    )
    runs = {f"async_level_{level}": measure(args.config, work, sft, level, args.steps) for level in (0, 2)}
    sync, asyn = runs["async_level_0"], runs["async_level_2"]
    print(
        json.dumps(
            {
                "benchmark": "async",
                "config": str(args.config),
                "steps": args.steps,
                "cpus": os.cpu_count(),
                "sft_s": round(sft_s, 1),
                **runs,
                "speedup": round(sync["s_per_step_mean"] / asyn["s_per_step_mean"], 2),
                "speedup_median": round(sync["s_per_step_median"] / asyn["s_per_step_median"], 2),
                "target": 1.3,
                "workdir": str(work),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
