"""Where a finished (or running) `intellect run` spent its time, per policy step: generation, validation, training,
weight transfer and evaluation, read from the run directory the launcher wrote (metrics.jsonl and logs/).

    python benchmarks/run_timeline.py runs/smollm2-letters [--json out.json]

Prints one JSON object: the run's wall time from the first evaluation's start to the last metrics row, the mean
seconds per step of each stage, and the share of the wall time each role was busy. The stages overlap (the
roles are separate processes and `trainer.async_level` lets generation run ahead of training), so on a machine
with fewer cores than roles the busy shares add up to more than 1: the sum over a role's stages says how much
of the wall clock that role kept a core busy, and the largest one is the pipeline's bottleneck.

Figures come from the lines each role logs:
- worker: "assignment N (version V): S samples, T sampled tokens in X s" (generation, rewards and TOPLOC
  proofs), "engine: version V from ... in X s" and "engine: now at version V (swap X s)" (loading a policy into
  vLLM) and "fetched version V: ... in X s" (its SHARDCAST download);
- validator: "verdict on B posted in X s" (prefill, TOPLOC, sampler replay and reward checks of one batch) and
  "fetched vN: ... in X s";
- both: "merged adapter version V into version 0 in X s" (a version shipped as a LoRA adapter, merged locally);
- learner: metrics rows (step_s: the step, the first one's compile included; wait_s: waiting for batches) and
  "exported version V ... in X s" (the export SHARDCAST serves; with LoRA also the adapter beside it);
- eval rows of metrics.jsonl (seconds per held-out evaluation).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from datetime import datetime
from pathlib import Path

_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")
_PATTERNS = {
    "generation": re.compile(r"assignment \d+ \(version \d+\): \d+ samples, \d+ (?:sampled )?tokens in ([\d.]+) s"),
    "worker_engine_load": re.compile(
        r"engine: (?:version \d+ from .* in ([\d.]+) s|now at version \d+ \(swap ([\d.]+) s\))"
    ),
    "worker_fetch": re.compile(r"fetched version \d+: [\d.]+ MiB in ([\d.]+) s"),
    "validation": re.compile(r"verdict on \S+ posted in ([\d.]+) s"),
    "validator_fetch": re.compile(r"fetched v\d+: [\d.]+ MiB in ([\d.]+) s"),
    "export": re.compile(r"exported (?:version|adapter) \d+ (?:as its adapter )?to .* in ([\d.]+) s"),
    "adapter_merge": re.compile(r"merged adapter version \d+ into version \d+ in ([\d.]+) s"),
}


def _stamp(line: str) -> float | None:
    m = _STAMP.match(line)
    if m is None:
        return None
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp() + int(m.group(2)) / 1000


def log_durations(path: Path) -> dict[str, list[float]]:
    """Seconds of each stage this log reports, in order."""
    found: dict[str, list[float]] = {}
    with open(path, errors="replace") as f:
        for line in f:
            for stage, pattern in _PATTERNS.items():
                m = pattern.search(line)
                if m:
                    found.setdefault(stage, []).append(float(next(g for g in m.groups() if g is not None)))
    return found


def timeline(run_dir: Path) -> dict:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise SystemExit(f"{metrics}: no metrics.jsonl (is {run_dir} a run directory of `intellect run`?)")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    learner = [r for r in rows if r.get("role") == "learner"]
    evals = [r for r in rows if r.get("role") == "eval"]
    if not learner:
        raise SystemExit(f"{metrics}: no learner step yet")
    start = min(r["time"] - r.get("seconds", 0.0) for r in evals) if evals else min(r["time"] for r in rows)
    wall = max(r["time"] for r in rows) - start
    steps = len(learner)
    stages: dict[str, list[float]] = {}
    for log in sorted((run_dir / "logs").glob("*.log")):
        for stage, values in log_durations(log).items():
            if stage == "adapter_merge":  # both nodes log it: counted per role
                stage = ("validator_" if log.stem.startswith("validator") else "worker_") + stage
            stages.setdefault(stage, []).extend(values)
    stages["training"] = [r["step_s"] for r in learner]  # the step itself (the first one compiles)
    stages["learner_waiting"] = [r.get("wait_s", 0.0) for r in learner]
    stages["evaluation"] = [r["seconds"] for r in evals]
    per_step = {k: round(sum(v) / steps, 2) for k, v in sorted(stages.items())}
    busy = {
        "worker": sum(
            sum(stages.get(k, [])) for k in ("generation", "worker_engine_load", "worker_fetch", "worker_adapter_merge")
        )
        / wall,
        "validator": sum(sum(stages.get(k, [])) for k in ("validation", "validator_fetch", "validator_adapter_merge"))
        / wall,
        "learner": sum(sum(stages.get(k, [])) for k in ("training", "export")) / wall,
        "evaluation": sum(stages["evaluation"]) / wall,
    }
    return {
        "run_dir": str(run_dir),
        "steps": steps,
        "wall_s": round(wall, 1),
        "wall_s_per_step": round(wall / steps, 1),
        "seconds_per_step": per_step,
        "counts": {k: len(v) for k, v in sorted(stages.items())},
        "median_s": {k: round(statistics.median(v), 2) for k, v in sorted(stages.items()) if v},
        "busy_share": {k: round(v, 3) for k, v in busy.items()},
        "bottleneck": max(("worker", "validator", "learner"), key=lambda k: busy[k]),
        # batches made and judged vs trained on: the rest went stale (older than trainer.async_level) or wait
        "batches": {
            "generated": len(stages.get("generation", [])),
            "judged": len(stages.get("validation", [])),
            "trained": int(sum(r.get("batches", 0) for r in learner)),
            "stale_dropped": int(sum(r.get("stale_batches", 0) for r in learner)),
        },
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    out = timeline(args.run_dir)
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
