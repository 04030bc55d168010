"""Versions shipped as LoRA adapters (`[model.lora] ship = "adapter"`) through a real pool: SHARDCAST carries the
adapter (megabytes, not the model), the worker and the validator merge it into version 0 by the merge contract;
honest batches are accepted, and workers that serve anything but the contract's merge under an adapter's version
(adapter_cheat_worker.py's forges: the base alone, an older version, stacked adapters, another rank, scaling or
targets, a bfloat16 merge) are rejected for computation."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_worker_validator import Pool, wait_until

from bridge.protocol import load_or_create_key, public_key_hex
from bridge.weights import WeightsError, model_digest

CHEAT = Path(__file__).with_name("adapter_cheat_worker.py")
# forge -> the check that rejects its batches: computation (TOPLOC) for weights off by an adapter-sized delta. A
# bfloat16 merge moves the float32 pool's logprobs by bfloat16 rounding only (a sample's mean ~0.03, its largest
# ~0.1): within TOPLOC's limits, beyond the sampling check's float32 bound (0.05 a token) in most samples
FORGES = {
    "base-only": "computation",
    "older": "computation",
    "stacked": "computation",
    "half-rank": "computation",
    "alpha-as-scaling": "computation",
    "attention-only": "computation",
    "bfloat16-merge": "sampling",
}
HONEST_AT = {"stacked": {1}}  # versions at which a forge serves the contract's merge (stacked: nothing below v1)


def export_adapter_versions(model_dir: Path, weights: Path, versions=(1,), scale: float = 0.3) -> list[Path]:
    """Version 0 (the base) and each of `versions` as an adapter on it whose B is drawn at random, seeded by the
    version (`scale`: large enough that the adapter moves the sampled tokens' logprobs far beyond the validator's
    tolerance)."""
    from jax_trainer.models import export_hf, load_hf
    from jax_trainer.models.hf import export_adapter, with_random_b
    from jax_trainer.models.lora import LoraSpec

    model = load_hf(model_dir, lora=LoraSpec(8, 16.0, ("q", "v", "o", "up", "down")))
    export_hf(model, weights / "v000000", version=0, source_dir=model_dir, dtype="float32")
    digest = model_digest(weights / "v000000")
    out = [weights / f"v{v:06d}" for v in versions]
    for version, path in zip(versions, out):
        export_adapter(with_random_b(model, scale, version), path, version=version, base_digest=digest, base_version=0)
    return out


@pytest.fixture
def lora_pool(tmp_path, tiny_model):
    p = Pool(tmp_path, tiny_model("qwen2"))
    # pacing for one honest worker beside seven cheaters: a window of 8 assignments, which fresh keys may hold all of,
    # and no bans, so that every cheater lives to be judged at both adapter versions
    config = p.config.read_text()
    for old, new in (
        ("prompts_per_step = 4", "prompts_per_step = 8"),
        ("\nbatch_size = 16", "\nbatch_size = 32"),
        ("ban_after_rejections = 2", "ban_after_rejections = 0\nunproven_share = 1.0"),
    ):
        assert old in config
        config = config.replace(old, new)
    p.config.write_text(config)
    yield p
    p.close()


def test_an_adapter_for_another_base_is_refused_by_name(tmp_path, tiny_model):
    from gpu_workers.adapters import servable

    weights = tmp_path / "weights"
    (adapter,) = export_adapter_versions(tiny_model("qwen2"), weights)
    other = tiny_model("llama")  # a held "base" that is not the adapter's
    with pytest.raises(WeightsError, match=f"trained on base model {model_digest(weights / 'v000000')}"):
        servable(adapter, tmp_path / "node", lambda _: other)


def test_adapter_versions_through_a_pool_with_forged_merges(lora_pool):
    pool = lora_pool
    adapters = export_adapter_versions(pool.model_dir, pool.weights, (1, 2))
    full = sum(p.stat().st_size for p in (pool.weights / "v000000").glob("*.safetensors"))
    assert all((a / "adapter_model.safetensors").stat().st_size < full / 4 for a in adapters)
    pool.orchestrator.start()
    origin = pool.start("origin", "shardcast", "origin", str(pool.config), "--dir", str(pool.weights))
    pool.admin.announce_policy(1, relays=[f"http://127.0.0.1:{pool.origin_port}"])
    worker, key = pool.node("worker", "worker1")
    validator, _ = pool.node("validator", "validator")
    cheaters: dict[str, str] = {}  # node key -> forge
    procs = [worker, validator, origin]
    for forge in FORGES:
        path = pool.tmp / "keys" / f"{forge}.key"
        cheaters[public_key_hex(load_or_create_key(path))] = forge
        argv = ("--forge", forge, str(pool.config), "--worker.key_path", str(path))
        procs.append(pool.start(forge, *argv, program=(str(CHEAT),)))
    seen: dict = {}  # batch id -> (status, record)

    def judged(version: int, keys) -> bool:
        for status in ("accepted", "rejected"):
            for b in pool.batches(status):
                seen[b.batch_id] = (status, b)
        honest = any(b.node_key == key and s == "accepted" and b.version == version for s, b in seen.values())
        cheated = {b.node_key for s, b in seen.values() if s == "rejected" and b.version == version}
        return honest and set(keys) <= cheated

    wait_until(lambda: judged(1, ()), 300, "an accepted honest batch at adapter version 1", procs)
    pool.admin.announce_policy(2)
    wait_until(lambda: judged(2, cheaters), 300, "an accepted honest and each forge's rejected batch at v2", procs)
    assert not [b for s, b in seen.values() if b.node_key == key and s == "rejected"]  # no honest rejection
    for s, b in seen.values():
        forge = cheaters.get(b.node_key)
        if forge is not None and b.version not in HONEST_AT.get(forge, ()):
            assert s == "rejected" and FORGES[forge] in b.failed_checks, (forge, b.version, s, b.failed_checks)
        elif forge is not None:  # the contract's merge, written by the forge's code: accepted
            assert s == "accepted", (forge, b.version, b.failed_checks)
    # each node merged each adapter into version 0 itself
    for version in (1, 2):
        assert f"merged adapter version {version} into version 0" in pool.log("worker1")
        assert f"merged adapter version {version} into version 0" in pool.log("validator")
