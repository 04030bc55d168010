"""benchmarks/accelerator_workers.py's stages run in small mode (a tiny random model, CPU against CPU): each
returns JSON-able figures that hold for two CPU sides, checked against what must be true, not against the
stage's own earlier output."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def stages(tiny_model):
    spec = importlib.util.spec_from_file_location("accelerator_workers", ROOT / "benchmarks" / "accelerator_workers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.SMALL_MODEL = tiny_model()  # the session's tiny model (small mode would make its own in the temp dir)
    return module.STAGES


def test_the_stages_are_the_ones_the_issue_names(stages):
    assert list(stages) == ["validator_prefill", "toploc_cross_device", "replay_cross_device", "vllm_decode"]


def test_prefill_speed_is_measured_on_both_sides(stages):
    result = json.loads(json.dumps(stages["validator_prefill"](True)))
    for side in ("accelerator", "cpu"):
        assert result[side]["device"] == "cpu" and result[side]["tokens"] == 4 * (32 + 96)
        assert result[side]["tokens_per_s"] > 0
    ratio = result["accelerator"]["tokens_per_s"] / result["cpu"]["tokens_per_s"]
    assert result["speedup"] == pytest.approx(ratio, rel=0.01, abs=0.005)  # printed to 2 decimals
    # and float32 on the accelerator, over bfloat16: the price of float32 replay
    f32 = result["accelerator_float32"]["tokens_per_s"]
    assert f32 > 0 and result["float32_over_bfloat16"] == pytest.approx(
        f32 / result["accelerator"]["tokens_per_s"], rel=0.01
    )


def test_cross_device_proofs_are_accepted_both_ways_in_both_dtypes(stages):
    result = json.loads(json.dumps(stages["toploc_cross_device"](True)))
    keys = [
        f"{d}_{a}_proofs_vs_{b}"
        for d in ("bfloat16", "float32")
        for a, b in (("accelerator", "cpu"), ("cpu", "accelerator"))
    ]
    for key in keys:
        figures = result[key]
        assert figures["accepted"] == figures["of"] == 4, key  # honest: the same model on both sides
        assert 0 <= figures["worst_exp_mismatches"] <= 38 and 0 <= figures["worst_mant_err_mean"] <= 10, key


def test_replay_verdicts_agree_and_catch_the_tampered_copies(stages):
    result = json.loads(json.dumps(stages["replay_cross_device"](True)))
    assert result["identical"] and result["differing_samples"] == []
    assert result["honest_passed"] == {"accelerator": 4, "cpu": 4}
    assert result["tampered_rejected"] == {"accelerator": 4, "cpu": 4}


def test_decode_is_skipped_with_a_reason_without_vllm_on_cuda(stages):
    assert stages["vllm_decode"](True) == {"skipped": "small mode is CPU-only"}
