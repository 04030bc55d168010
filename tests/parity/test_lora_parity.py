"""`intellect parity --adapter`: JAX's LoRA layers, transformers + PEFT and vLLM on the merged weights agree on a
base plus adapter; a perturbed adapter on one side fails the check."""

from __future__ import annotations

import pytest

from bridge.weights import model_digest
from intellect.parity import check_parity


def _adapter(base, out, seed: int = 1, rank: int = 8, scale: float = 0.05):
    """A trained-looking adapter (B drawn at random) of `base`, written by the learner's export."""
    from jax_trainer.models import load_hf
    from jax_trainer.models.hf import export_adapter, with_random_b
    from jax_trainer.models.lora import LoraSpec

    model = load_hf(base, lora=LoraSpec(rank, 2.0 * rank, ("q", "k", "v", "o", "gate", "up", "down")))
    model = with_random_b(model, scale, seed)
    export_adapter(model, out, version=1, base_digest=model_digest(base))
    return out


@pytest.mark.vllm
def test_parity_with_an_adapter_across_jax_hf_vllm_and_a_perturbed_one_fails(tiny_model, tmp_path):
    base = tiny_model(family="llama", tie_embeddings=False)
    adapter = _adapter(base, tmp_path / "adapter")
    report = check_parity(base, engines=("jax", "hf", "vllm"), dtype="float32", adapter=adapter)
    by_pair = {p.pair: p for p in report.pairs}
    assert set(by_pair) == {"jax-hf", "jax-vllm", "hf-vllm"} and report.ok, report.to_json()
    # another adapter on one side is far outside the tolerance: so is a side that would ignore the adapter
    perturbed = _adapter(base, tmp_path / "perturbed", seed=2)
    bad = check_parity(base, engines=("jax", "hf"), dtype="float32", adapter=adapter, jax_adapter=perturbed)
    assert not bad.ok and bad.pairs[0].max_abs_diff > 10 * bad.pairs[0].tolerance


def test_an_adapter_directory_without_its_config_is_named(tiny_model, tmp_path, capsys):
    from intellect.cli import main

    base = tiny_model(family="llama", tie_embeddings=False)
    adapter = _adapter(base, tmp_path / "adapter")
    (adapter / "adapter_config.json").unlink()
    assert main(["parity", str(base), "--engines", "jax,hf", "--adapter", str(adapter)]) == 2
    err = capsys.readouterr().err
    assert f"parity: --adapter: {adapter}: not an adapter version: adapter_config.json is missing" in err
