"""`intellect train CONFIG` as a user starts it: rollouts in a store, a learner process, exported versions."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np

from bridge.rollouts import BatchMeta, RolloutBatch, RolloutStore

ROOT_FLAGS = [
    "--trainer.accepted_from",
    "store",
    "--trainer.steps",
    "2",
    "--trainer.export_interval",
    "1",
    "--trainer.checkpoint_interval",
    "2",
    "--trainer.export_dtype",
    "float32",
    "--trainer.micro_batches",
    "2",
    "--trainer.micro_batch_size",
    "4",
    "--data.prompts_per_step",
    "2",
    "--data.samples_per_prompt",
    "4",
    "--trainer.batch_size",
    "8",
]


def _write_batches(store_dir, count: int) -> None:
    store = RolloutStore.open(str(store_dir))
    rng = np.random.default_rng(0)
    for b in range(count):
        n = 8
        tokens, prompt_lens, logprobs, proofs = [], [], [], []
        for _ in range(n):
            length, prompt = int(rng.integers(20, 40)), int(rng.integers(4, 10))
            tokens.append(rng.integers(3, 500, length))
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
                task_ids=list(range(n)),
                group_ids=[i // 4 for i in range(n)],
                seeds=list(range(n)),
                finish=[0] * n,
                rewards=rng.random(n).tolist(),
                proofs=proofs,
            )
        )


def test_train_command_trains_exports_and_resumes(tiny_model, tmp_path):
    base = tiny_model(family="qwen2")
    _write_batches(tmp_path / "rollouts", 4)
    flags = ["--run.dir", str(tmp_path), "--model.path", str(base), *ROOT_FLAGS]
    cmd = [sys.executable, "-m", "intellect", "train", "configs/demo.toml", *flags]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    weights = sorted(p.name for p in (tmp_path / "weights").iterdir())
    assert weights == ["v000000", "v000001", "v000002"]
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    again = subprocess.run(
        cmd[: -len(ROOT_FLAGS)] + [*ROOT_FLAGS[:2], "--trainer.steps", "3", *ROOT_FLAGS[4:]],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]  # resumed at 2: no step trained twice
