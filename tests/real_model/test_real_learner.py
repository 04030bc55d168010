"""The learner on real weights (a 2-layer cut of SmolLM2-135M-Instruct: Llama, 9/3 heads of 64, tied embeddings,
vocabulary 49,152): `intellect train` as a user starts it trains two steps from rollouts in a store, exports
every version, resumes from its checkpoint for a third, and the SHARDCAST origin serves those versions to a
client byte for byte. The store and flags are tests/integration/test_train_cli.py's; the SHARDCAST processes
tests/integration/test_shardcast.py's."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
from integration import test_shardcast as shardcast
from integration.test_train_cli import ROOT_FLAGS, _write_batches
from safetensors.numpy import load_file

cluster = shardcast.cluster  # the fixture: every SHARDCAST process killed at the end


def _train(tmp_path, base, steps: int) -> subprocess.CompletedProcess:
    flags = ["--run.dir", str(tmp_path), "--model.path", str(base), *ROOT_FLAGS, "--trainer.steps", str(steps)]
    return subprocess.run(
        [sys.executable, "-m", "intellect", "train", "configs/demo.toml", *flags],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_train_resume_and_serve_the_real_models_versions(real_model, tmp_path, cluster):
    base = real_model(2)
    _write_batches(tmp_path / "rollouts", 3)
    first = _train(tmp_path, base, 2)
    assert first.returncode == 0, first.stderr[-3000:]
    again = _train(tmp_path, base, 3)
    assert again.returncode == 0, again.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]  # resumed at 2: no step trained twice
    assert all(math.isfinite(r["loss"]) for r in records), records

    weights = tmp_path / "weights"
    assert sorted(p.name for p in weights.iterdir()) == [f"v{v:06d}" for v in range(4)]
    original = load_file(str(base / "model.safetensors"))
    exported = [{} for _ in range(4)]
    for v in (0, 3):
        for shard in sorted((weights / f"v{v:06d}").glob("*.safetensors")):
            exported[v].update(load_file(str(shard)))
    assert set(exported[0]) == set(original)
    for name, tensor in original.items():  # version 0 is the base model, exactly
        np.testing.assert_array_equal(exported[0][name], tensor, err_msg=name)
    moved = [n for n in original if not np.array_equal(exported[3][n], original[n])]
    assert len(moved) >= len(original) // 2, moved  # three steps changed the weights

    origin = cluster.origin(weights)
    fetched = cluster.fetch(origin, tmp_path / "client", *shardcast.FAST, name="client").result(timeout=120)
    assert fetched["version"] == 3
    v3 = weights / "v000003"
    listed = [f["name"] for f in json.loads((v3 / "manifest.json").read_text())["files"]]
    files = {name: (v3 / name).read_bytes() for name in listed}
    shardcast.assert_landed(tmp_path / "client", 3, files, weights)
