"""`intellect parity` on real weights (a 2-layer cut of SmolLM2-135M-Instruct: its trained embeddings, head and
first layers, logits up to ~80): JAX, transformers and vLLM agree within the floor measured against float64, in
float32 (with the JAX export loaded by vLLM) and in bfloat16; and a JAX model one weight row off fails it."""

from __future__ import annotations

import shutil

import pytest

from intellect.parity import FLOOR_FACTOR, check_parity


def _assert_within_floor(report, dtype):
    assert report.ok, report.to_json()
    for p in report.pairs:
        floor = report.floor[p.metric]
        assert p.tolerance == FLOOR_FACTOR * floor.max and p.mean_tolerance == FLOOR_FACTOR * floor.mean
        assert 0 < p.max_abs_diff <= p.tolerance and 0 < p.mean_abs_diff <= p.mean_tolerance, p
    # the floor is real rounding of a trained model's logits, not a bound picked for random ones
    assert report.logit_scale > 20
    low, high = {"float32": (1e-6, 1e-3), "bfloat16": (1e-2, 2.0)}[dtype]
    assert low < report.floor["logits"].max < high, report.floor


@pytest.mark.vllm
def test_float32_jax_hf_vllm_agree_and_vllm_loads_the_jax_export(real_model, tmp_path):
    report = check_parity(real_model(2), ("jax", "hf", "vllm"), "float32", export_dir=tmp_path / "v000000")
    assert [p.pair for p in report.pairs] == ["jax-hf", "jax-vllm", "hf-vllm"]
    _assert_within_floor(report, "float32")
    assert (tmp_path / "v000000" / "STABLE").exists()


@pytest.mark.vllm
def test_bfloat16_jax_hf_vllm_agree_within_the_bfloat16_floor(real_model):
    report = check_parity(real_model(2), ("jax", "hf", "vllm"), "bfloat16", n_sequences=2, seq_len=32)
    _assert_within_floor(report, "bfloat16")


def test_one_row_of_one_projection_off_by_a_thousandth_fails(real_model, tmp_path, monkeypatch):
    """The JAX model loads a copy whose layer-1 o_proj row 7 is scaled by 1 + 1e-3 (a loader bug of that size);
    transformers scores the original. The same command on the original passes (the float32 test above)."""
    from safetensors.torch import load_file, save_file

    import jax_trainer.models

    src = real_model(2)
    off = tmp_path / "off"
    shutil.copytree(src, off)
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.1.self_attn.o_proj.weight"][7] *= 1 + 1e-3
    save_file(tensors, str(off / "model.safetensors"), metadata={"format": "pt"})
    load_hf = jax_trainer.models.load_hf
    monkeypatch.setattr(jax_trainer.models, "load_hf", lambda _dir, **kw: load_hf(off, **kw))

    report = check_parity(src, ("jax", "hf"), "float32")
    (pair,) = report.pairs
    assert not report.ok and not pair.ok
    assert pair.max_abs_diff > 2 * pair.tolerance and pair.mean_abs_diff > 2 * pair.mean_tolerance, pair
