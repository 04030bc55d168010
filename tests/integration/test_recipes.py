"""Every shipped recipe trains: `intellect train` on each `configs/*.toml` with its own learner settings.

Each recipe keeps its `[model]` flags (dtypes, remat), `[loss]`, `[optim]` and `[trainer]` choices that shape the
step (steps_per_batch, logprob chunking); only what cannot exist on this machine is replaced: the base model is
a tiny random model of the recipe's family, the mesh is the test mesh, the batch is small, the rollouts are
stored batches. Two learner steps and their exports must succeed with finite losses, whatever combination of
settings a recipe uses (a recipe whose remat + recompute could not step once shipped unnoticed). Recipes with
the same learner settings as an earlier one are tested once.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bridge.rollouts import BatchMeta, RolloutBatch, RolloutStore
from intellect.config_io import load_config


def _learner_settings(recipe: Path) -> str:
    """What of a recipe this test exercises: its [model] flags (not the path), [trainer], [loss] and [optim]."""
    cfg = load_config(recipe)
    parts = [cfg.model.model_dump(mode="json", exclude={"path"})]
    parts += [getattr(cfg, section).model_dump(mode="json") for section in ("trainer", "loss", "optim")]
    return json.dumps(parts, sort_keys=True)


def _distinct(recipes: list[Path]) -> list[Path]:
    """Each learner setting once: a recipe that differs from an earlier one only in its data or roles (the
    length-target recipe and the demo) trains the same step, so it adds time and nothing to check."""
    seen: set[str] = set()
    keep = []
    for recipe in recipes:
        key = _learner_settings(recipe)
        if key not in seen:
            seen.add(key)
            keep.append(recipe)
    return keep


RECIPES = _distinct(sorted(Path("configs").glob("*.toml")))
FAMILIES = (("qwen3", "qwen3"), ("qwq", "qwen2"), ("qwen2", "qwen2"), ("llama", "llama"), ("smollm", "llama"))


def _family(model_path: str) -> str:
    """The model family a recipe's base model belongs to, from its name (the weights are not here)."""
    name = model_path.lower()
    return next((family for key, family in FAMILIES if key in name), "qwen2")


def _write_batches(store_dir: Path, count: int, samples: int, group: int, vocab: int) -> None:
    store = RolloutStore.open(str(store_dir))
    rng = np.random.default_rng(0)
    for b in range(count):
        tokens, prompt_lens, logprobs, proofs = [], [], [], []
        for _ in range(samples):
            length, prompt = int(rng.integers(20, 40)), int(rng.integers(4, 10))
            tokens.append(rng.integers(3, vocab, length))
            prompt_lens.append(prompt)
            logprobs.append(np.r_[np.zeros(prompt), -rng.random(length - prompt) * 2])
            proofs.append(bytes(258 * math.ceil((length - prompt) / 32)))
        meta = BatchMeta(
            f"b{b}", "ab" * 32, version=0, assignment_id=b, sampling={"temperature": 1.0}, model_dtype="float32"
        )
        store.write(
            RolloutBatch.from_samples(
                meta,
                tokens=tokens,
                prompt_lens=prompt_lens,
                logprobs=logprobs,
                task_ids=list(range(samples)),
                group_ids=[i // group for i in range(samples)],
                seeds=list(range(samples)),
                finish=[0] * samples,
                rewards=rng.random(samples).tolist(),
                proofs=proofs,
            )
        )


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_trains_two_steps_and_exports(recipe, tiny_model, tmp_path):
    cfg = load_config(recipe)
    base = tiny_model(family=_family(cfg.model.path))
    steps_per_batch = cfg.trainer.steps_per_batch
    group = 4
    _write_batches(tmp_path / "rollouts", 4, 2 * group, group, vocab=500)
    flags = {
        "run.dir": tmp_path,
        "model.path": base,
        "model.max_seq_len": 64,
        "data.max_prompt_len": 16,
        "data.max_new_tokens": 48,
        "trainer.data": 1,
        "trainer.fsdp": -1,
        "trainer.tensor": min(cfg.trainer.tensor, 2),
        "trainer.batch_size": 2 * group,
        "data.prompts_per_step": 2,
        "data.samples_per_prompt": group,
        "trainer.micro_batch_size": 4,
        "trainer.micro_batches": 2 * steps_per_batch,
        "trainer.steps": 2,
        "trainer.export_interval": 1,
        "trainer.checkpoint_interval": 0,
        "trainer.accepted_from": "store",
        "trainer.rollout_store": tmp_path / "rollouts",
        "trainer.async_level": 2,
        "trainer.batch_timeout_s": 120,
        "trainer.retain_host_memory": False,
        "trainer.coordinator_address": "none",
        "trainer.num_processes": "none",
        "trainer.process_id": "none",
        "data.online_filter": False,
        "data.dynamic_sampling": False,  # (it needs the online filter) every stored sample trains
        "data.length_targets": "[]",
        "data.max_episode_tokens": 64,  # a multi-turn recipe's episodes in the test's rows
    }
    if cfg.loss.logprob_source == "validator":  # a pool's pi_old; from the store (no validators) the same numbers
        flags["loss.logprob_source"] = "inference"  # are the batch's engine logprobs
    cmd = [sys.executable, "-m", "intellect", "train", str(recipe)]
    for key, value in flags.items():
        cmd += [f"--{key}", str(value)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{recipe} cannot train:\n{result.stderr[-4000:]}"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "loss" in r]
    assert [r["step"] for r in trained] == [steps_per_batch, 2 * steps_per_batch] or [r["step"] for r in trained] == [
        1,
        2,
    ], records
    assert all(np.isfinite(r["loss"]) and r.get("skipped", 0) == 0 for r in trained), trained
    exported = sorted(p.name for p in (tmp_path / "weights").iterdir())
    assert exported[-1] == f"v{trained[-1]['step']:06d}", exported
    assert (tmp_path / "weights" / exported[-1] / "STABLE").exists()
    if cfg.model.lora is not None:  # the adapter alone, naming the base it needs: beside the merged version, or
        from bridge.adapters import verify_adapter  # in its place (ship = "adapter", on version 0)
        from bridge.weights import model_digest

        if cfg.model.lora.ship == "adapter":
            manifest = verify_adapter(
                tmp_path / "weights" / exported[-1], model_digest(tmp_path / "weights" / "v000000")
            )
            assert manifest["base_version"] == 0
        else:
            verify_adapter(tmp_path / "adapters" / exported[-1], model_digest(base))
