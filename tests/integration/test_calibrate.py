"""Issue 49 items 1 and 2: `intellect calibrate` as an operator runs it, and the safe defaults it unlocks.

A bfloat16 replay pool's validator refuses to start without a calibration of the pool's model (and says to run
`intellect calibrate`); the command measures the model as the pool runs it and writes a recipe fragment whose
settings hold what it measured, recorded with the model's digest; a recipe that includes it starts (the
validator's check passes, the orchestrator keeps the worker's near-tie ledger at the calibrated rate), one
naming another model or dtype does not, and float32 pools or `allow_uncalibrated = true` need none.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bridge.weights import model_digest
from gpu_workers.calibration import calibration_problem
from intellect import cli
from intellect.config_io import load_config

ROOT = Path(__file__).resolve().parents[2]
BF16 = ["--worker.dtype", "bfloat16", "--validator.dtype", "bfloat16"]


def _intellect(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("INTELLECT_")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-m", "intellect", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_a_bf16_pool_refuses_until_calibrated_and_the_fragment_holds_what_was_measured(tmp_path, tiny_model, capsys):
    model = tiny_model("qwen2")
    pool = [f"--model.path={model}", f"--run.dir={tmp_path / 'run'}", *BF16]
    recipe = tmp_path / "pool.toml"
    recipe.write_text(f'include = ["{ROOT / "configs" / "demo.toml"}"]\n')
    # uncalibrated: the validator command refuses, naming what to run, before it contacts anyone
    assert cli.main(["validator", str(recipe), *pool, "--validator.orchestrator_url=http://127.0.0.1:9"]) == 2
    refused = capsys.readouterr().err
    assert "intellect calibrate" in refused and "allow_uncalibrated" in refused

    out = tmp_path / "calibration.toml"
    done = _intellect(
        "calibrate", str(recipe), *pool, "--out", str(out), "--json",
        "--samples", "8", "--tie-samples", "16", "--batch", "8", "--max-tokens", "12",
        "--orchestrator.prompts_per_assignment", "2", "--data.samples_per_prompt", "4",
        "--data.prompts_per_step", "64", "--trainer.batch_size", "256",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)  # stdout is the report alone: vLLM logs on stderr
    print(f"calibrate: {report['seconds']} s measuring")
    assert report["tie_tokens"] > 0 and report["honest_batches"] == 2  # 16 samples in batches of 2 x 4
    assert report["calibrated_model"] == model_digest(model)

    recipe.write_text(f'include = ["{ROOT / "configs" / "demo.toml"}", "{out}"]\n')
    cfg = load_config(recipe, pool, env={})
    v, o = cfg.validator, cfg.orchestrator
    assert (v.calibrated_model, v.calibrated_dtype) == (model_digest(model), "bfloat16")
    assert 2 * v.replay_logit_tolerance >= max(report["spread_max"], report["honest_gap_quantiles"]["1.0"])
    assert 0 < v.tie_logit_tolerance <= v.replay_logit_tolerance
    assert v.max_logprob_diff >= 2 * report["honest_logprob_diff_max"]
    assert o.near_tie_rate >= 2 * report["honest_near_tie_cost_per_token"] and o.near_tie_rate > 0
    assert o.near_tie_slack >= max(2.0, 2 * report["honest_batch_cost_max"])
    # the validator's per-sample and per-batch budgets hold the honest samples and batches measured
    assert v.near_ties_per_token >= max(0.05, 2 * report["honest_sample_excess_per_token_max"])
    assert v.near_ties_per_batch_token >= max(0.02, 2 * report["honest_batch_cost_per_token_max"])
    # and the sampling check's mean logprob bounds the honest logprob errors measured
    assert v.mean_signed_logprob_diff >= max(0.05, 2 * report["honest_logprob_bias"])
    assert v.mean_logprob_diff >= max(0.15, 2 * report["honest_logprob_abs_mean"])
    assert v.logprob_diff_allowance >= max(0.1, 2 * report["honest_logprob_sample_excess_max"])
    assert calibration_problem(v, cfg.worker, cfg.model.path, o.near_tie_rate) is None
    # what the ledger leaves a cheater beyond honest rounding, per sample of the 16 measured, is in the report
    free = report["near_tie_freedom"]
    beyond = (o.near_tie_rate - report["honest_near_tie_cost_per_token"]) * report["tie_tokens"] / 16
    assert free["cost"] == pytest.approx(beyond, abs=1e-4) and free["choices_high"] == pytest.approx(
        4 * free["cost"], abs=4e-4
    )
    assert f"{free['choices_low']}-{free['choices_high']} near-tie choices" in out.read_text()
    # and the share of honest samples with a near tie (what the learner leaves out): each holds one at least
    share = report["honest_near_tie_sample_share"]
    assert (share > 0) == (report["honest_near_ties"] > 0) and share <= min(1.0, report["honest_near_ties"] / 16)

    # the ledger is on, at the calibrated rate, in the orchestrator this recipe starts
    from intellect.orchestrator_cli import build_app

    app = build_app(cfg, database_url=f"sqlite:///{tmp_path / 'orchestrator.db'}")
    assert app.state.orchestrator.scheduler.near_tie_rate == o.near_tie_rate
    app.state.orchestrator.close()

    # what the calibration does not cover is refused: another model, another dtype, the ledger left out
    other = tmp_path / "other-model"
    shutil.copytree(model, other)
    with open(other / "model.safetensors", "r+b") as f:  # one weight's last byte: another model
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    assert "intellect calibrate" in calibration_problem(v, cfg.worker, other, o.near_tie_rate)
    fp16 = cfg.worker.model_copy(update={"dtype": "float16"})
    assert "float16" in calibration_problem(v, fp16, cfg.model.path, o.near_tie_rate)
    assert "near_tie_rate" in calibration_problem(v, cfg.worker, cfg.model.path, None)
    # and what needs none starts without one
    bare = load_config(ROOT / "configs" / "demo.toml", pool, env={})
    assert calibration_problem(bare.validator, bare.worker, model, None) is not None
    fp32 = bare.worker.model_copy(update={"dtype": "float32"})
    assert calibration_problem(bare.validator, fp32, model, None) is None
    allowed = bare.validator.model_copy(update={"allow_uncalibrated": True})
    assert calibration_problem(allowed, bare.worker, model, None) is None
