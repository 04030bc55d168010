"""Versions shipped as LoRA adapters (`[model.lora] ship = "adapter"`) through a real pool: SHARDCAST carries the
adapter (megabytes, not the model), the worker and the validator merge it into version 0 by the merge contract;
honest batches are accepted and a worker that serves the base alone under the adapter's version is rejected."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_worker_validator import Pool, wait_until

from bridge.protocol import load_or_create_key, public_key_hex
from bridge.weights import WeightsError, model_digest

BASE_ONLY = Path(__file__).with_name("base_only_worker.py")


def export_adapter_version(model_dir: Path, weights: Path, version: int, scale: float = 0.3) -> Path:
    """Version 0 (the base) and `version` as an adapter on it whose B is drawn at random (`scale`: large enough that
    the adapter moves the sampled tokens' logprobs far beyond the validator's tolerance)."""
    from jax_trainer.models import export_hf, load_hf
    from jax_trainer.models.hf import export_adapter, with_random_b
    from jax_trainer.models.lora import LoraSpec

    model = load_hf(model_dir, lora=LoraSpec(8, 16.0, ("q", "v", "o", "up", "down")))
    export_hf(model, weights / "v000000", version=0, source_dir=model_dir, dtype="float32")
    model = with_random_b(model, scale, version)
    out = weights / f"v{version:06d}"
    export_adapter(model, out, version=version, base_digest=model_digest(weights / "v000000"), base_version=0)
    return out


@pytest.fixture
def lora_pool(tmp_path, tiny_model):
    p = Pool(tmp_path, tiny_model("qwen2"))
    yield p
    p.close()


def test_an_adapter_for_another_base_is_refused_by_name(tmp_path, tiny_model):
    from gpu_workers.adapters import servable

    weights = tmp_path / "weights"
    adapter = export_adapter_version(tiny_model("qwen2"), weights, 1)
    other = tiny_model("llama")  # a held "base" that is not the adapter's
    with pytest.raises(WeightsError, match=f"trained on base model {model_digest(weights / 'v000000')}"):
        servable(adapter, tmp_path / "node", lambda _: other)


def test_adapter_versions_through_a_pool_and_a_base_only_cheater(lora_pool):
    pool = lora_pool
    adapter = export_adapter_version(pool.model_dir, pool.weights, 1)
    full = sum(p.stat().st_size for p in (pool.weights / "v000000").glob("*.safetensors"))
    assert (adapter / "adapter_model.safetensors").stat().st_size < full / 4
    pool.orchestrator.start()
    origin = pool.start("origin", "shardcast", "origin", str(pool.config), "--dir", str(pool.weights))
    pool.admin.announce_policy(1, relays=[f"http://127.0.0.1:{pool.origin_port}"])
    worker, key = pool.node("worker", "worker1")
    validator, _ = pool.node("validator", "validator")
    cheat = pool.start(
        "cheater", str(pool.config), "--worker.key_path", str(pool.tmp / "keys" / "c.key"), program=(str(BASE_ONLY),)
    )
    cheat_key = public_key_hex(load_or_create_key(pool.tmp / "keys" / "c.key"))
    procs = [worker, validator, origin]
    seen: dict = {}

    def judged() -> bool:
        for status in ("accepted", "rejected"):
            for b in pool.batches(status):
                seen[b.batch_id] = (status, b)
        honest = [b for s, b in seen.values() if b.node_key == key and s == "accepted" and b.version == 1]
        cheated = [b for s, b in seen.values() if b.node_key == cheat_key and s == "rejected"]
        return honest and cheated

    wait_until(judged, 300, "an accepted honest and a rejected base-only batch at the adapter's version", procs)
    assert not [b for s, b in seen.values() if b.node_key == key and s == "rejected"]  # no honest rejection
    assert not [b for s, b in seen.values() if b.node_key == cheat_key and s == "accepted"]
    assert all(
        "computation" in b.failed_checks for s, b in seen.values() if b.node_key == cheat_key and s == "rejected"
    )
    # each node merged the adapter into version 0 itself
    assert "merged adapter version 1 into version 0" in pool.log("worker1")
    assert "merged adapter version 1 into version 0" in pool.log("validator")
    assert cheat.poll() is None or cheat.returncode == 3
