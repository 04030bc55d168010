"""The rollout-store pipeline as the learner loop's source (jax_trainer/learner.py): train, checkpoint the
cursor, resume in a new learner, and check from metrics.jsonl which batch each step trained on."""

from __future__ import annotations

import json

import numpy as np
from flax import nnx
from test_data_pipeline import write

from bridge.rollouts import RolloutStore
from jax_trainer.config import LossConfig, OptimConfig, TrainerConfig
from jax_trainer.data import RolloutPipeline, StoreListing
from jax_trainer.learner import Learner
from jax_trainer.models import load_hf
from jax_trainer.sharding import make_mesh
from jax_trainer.train_step import GRPOTrainer


def test_learner_trains_from_the_store_and_resumes_from_the_checkpointed_cursor(tiny_model, tmp_path):
    base = tiny_model(family="qwen2")
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    store = RolloutStore.open(tmp_path / "rollouts")
    rewards = {}
    for version in range(4):  # a<v> and b<v> at every version: step n takes them in version order
        for bid in ("a", "b"):
            write(store, version, f"{bid}{version}", vocab=vocab)
            rewards[f"{bid}{version}"] = np.random.default_rng(version).random(8)
    mesh = make_mesh(fsdp=-1)

    def learner(steps: int) -> tuple[Learner, RolloutPipeline, object]:
        model = load_hf(base, mesh=mesh)
        trainer = GRPOTrainer(model, mesh, LossConfig(), OptimConfig(lr=1e-3, warmup_steps=0))
        source = RolloutPipeline(
            store,
            StoreListing(store, rewards=rewards),
            samples_per_step=8,
            rows=4,
            seq_len=64,
            micro_batches=2,
            async_level=2,
            vocab_size=vocab,
            poll_interval=0.02,
        )
        settings = TrainerConfig(
            steps=steps, export_interval=100, checkpoint_interval=1, export_dtype="float32", batch_timeout_s=60
        )
        return Learner(trainer, source, tmp_path / "run", base, settings, progress=False), source, nnx.split(model)[1]

    first, source, params = learner(steps=2)
    with source:
        assert int(first.run(params).step) == 2
    resumed, source, params = learner(steps=4)  # what a restarted process does: newest checkpoint, its cursor
    with source:
        assert int(resumed.run(params).step) == 4
        assert source.cursor()["consumed"] == [[0, "a0"], [0, "b0"], [1, "a1"], [1, "b1"]]
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    # step 0: a0, step 1: b0, then (after the restart) step 2: a1, step 3: b1 -- nothing retrained or skipped
    assert [r["staleness_hist"] for r in lines] == [{"0": 8}, {"1": 8}, {"1": 8}, {"2": 8}]
    assert all(r["batches"] == 1 and r["samples"] == 8 and "stale_batches" not in r for r in lines)
