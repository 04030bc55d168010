"""benchmarks/replay_margin.py, run as a pool operator runs it on a tiny model: the snippet it writes is a config a
validator and an orchestrator load, and its settings hold what it measured (the margin holds the widest honest
near tie and the largest spread, the logprob bound the largest honest difference, the ledger twice the honest
spend). The measurement itself is gpu_workers.calibration's, tested against numpy in test_calibration.py."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_the_written_settings_load_and_hold_what_was_measured(tmp_path, tiny_model, run_benchmark):
    out = tmp_path / "calibration.toml"
    args = [
        str(ROOT / "configs" / "demo.toml"),
        "--model",
        str(tiny_model("qwen2")),
        "--samples", "8", "--tie-samples", "16", "--batch", "8", "--max-tokens", "12",
        "--worker.dtype", "bfloat16", "--validator.dtype", "bfloat16",
        "--orchestrator.prompts_per_assignment", "2", "--data.samples_per_prompt", "4",
        "--data.prompts_per_step", "64",
        "--write", str(out),
    ]  # fmt: skip
    done = run_benchmark("replay_margin.py", args, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, timeout=600)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["tie_tokens"] > 0 and report["honest_batches"] == 2  # 16 samples in batches of 2 x 4
    written = tomllib.loads(out.read_text())
    v, o = written["validator"], written["orchestrator"]
    assert 2 * v["replay_logit_tolerance"] >= max(report["spread_max"], report["honest_gap_quantiles"]["1.0"])
    assert 0 < v["tie_logit_tolerance"] <= v["replay_logit_tolerance"]
    assert v["max_logprob_diff"] >= 2 * report["honest_logprob_diff_max"]
    assert o["near_tie_rate"] >= 2 * report["honest_near_tie_cost_per_token"]
    assert o["near_tie_slack"] >= max(2.0, 2 * report["honest_batch_cost_max"])

    from gpu_workers.config import ValidatorConfig
    from orchestrator.config import OrchestratorConfig

    ValidatorConfig(**v)  # both sections load as the roles read them
    OrchestratorConfig(**o)
