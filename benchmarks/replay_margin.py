"""Measure a model's honest replay margin: cross-engine spreads, honest near ties, logprob errors, as JSON.

The measurement is the calibration's (`gpu_workers.calibrate.measure`, docs/verifiable-sampling.md,
"Calibrating a pool"): a vLLM worker in `worker.dtype` and the validator's prefill in `validator.dtype` on the
pool's task prompts, at the pool's temperature, top-p and batch shape. This script prints the whole report as
one JSON line (spread quantiles, honest near ties and their gaps, cost per token and per batch, the largest
logprob difference, the settings they give, the wall time), so that models, dtypes and safety factors can be
compared side by side; an operator writes the settings into a pool with `intellect calibrate`, which runs the
same measurement.

    python benchmarks/replay_margin.py configs/demo.toml --model runs/demo/sft --samples 256 --tie-samples 1024 \\
        [--worker.dtype bfloat16 --validator.dtype bfloat16]    (any config override)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", type=Path, help="the pool's config (its [data], [worker] and [validator])")
    p.add_argument("--model", type=Path, default=None, help="the policy (default: model.path)")
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--tie-samples", type=int, default=None, help="replayable samples for the near ties (--samples)")
    p.add_argument("--batch", type=int, default=32, help="samples generated together (spreads)")
    p.add_argument("--max-tokens", type=int, default=None, help="default: the pool's completion cap, at most 256")
    p.add_argument("--logprobs", type=int, default=20, help="top logprobs the worker lists per position")
    p.add_argument("--safety", type=float, default=2.0)
    p.add_argument("--tie-quantile", type=float, default=0.9)
    p.add_argument("--rate-safety", type=float, default=2.0)
    args, overrides = p.parse_known_args()

    from intellect.calibrate_cli import measure_pool
    from intellect.config_io import load_config

    cfg = load_config(args.config, overrides)
    cal = measure_pool(cfg, args.model or Path(cfg.model.path), args)
    print(json.dumps(cal.report()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
