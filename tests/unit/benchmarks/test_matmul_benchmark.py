"""benchmarks/matmul.py: the step's matmuls through JAX and torch, on all cores and on one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import matmul  # noqa: E402

TINY = "--tokens 64 --hidden 32 --intermediate 48 --vocab 80 --square 64 --rounds 1 --reps 1".split()


def test_both_frameworks_multiply_the_same_matrices_on_all_cores_and_on_one(run_benchmark):
    out = json.loads(run_benchmark("matmul.py", TINY, env={"XLA_FLAGS": None}).stdout)
    assert out["agree"] is True
    names = {"proj", "up", "down", "down_dx", "up_dw", "head", "square"}
    assert set(out["shapes"]) == names and out["shapes"]["up_dw"] == "[64, 32] x [64, 48], contracting dim 0 with 0"
    assert set(out["threads"]) == {"all", "1"} and out["threads"]["1"]["cores"] == 1
    for setting in ("all", "1"):
        for name in names:
            figures = out["threads"][setting][name]
            assert figures["jax_gflops"]["median"] > 0 and figures["torch_gflops"]["median"] > 0, figures
            assert figures["jax_over_torch"] > 0
    assert set(out["scaling"]) == names and all(s["jax"] > 0 and s["torch"] > 0 for s in out["scaling"].values())


def test_a_bad_thread_setting_is_refused_by_name():
    done = subprocess.run(
        [sys.executable, str(Path(matmul.__file__)), "--threads", "all,4"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "--threads" in done.stderr and "'all,4'" in done.stderr


def test_fingerprints_tell_a_different_product_from_a_reordered_sum():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((96, 80), np.float32), rng.standard_normal((80, 80), np.float32)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    f32 = matmul.fingerprint(a @ b)  # float32 accumulation, another order than float64's
    assert matmul.agree(matmul.fingerprint(exact), f32)
    # the other contraction of the same operands (what a wrong dimension number would multiply)
    assert not matmul.agree(matmul.fingerprint(exact), matmul.fingerprint(a @ b.T))
    # one wrong entry in the first row
    wrong = exact.copy()
    wrong[0, 3] += 0.05 * np.sqrt(np.mean(exact**2)) * np.sqrt(exact.shape[1])
    assert not matmul.agree(matmul.fingerprint(exact), matmul.fingerprint(wrong))
