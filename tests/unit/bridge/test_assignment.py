"""The deterministic assignment: reproducible from (key, version, k) alone, different otherwise."""

import hashlib
import subprocess
import sys

import numpy as np
import pytest

from bridge.assignment import assigned_sample_seeds, assigned_task_ids, assignment_seed

KEY = "ab" * 32


def test_seed_is_sha256_of_the_documented_string():
    expected = int.from_bytes(hashlib.sha256(f"intellect-assignment/v1|{KEY}|7|3".encode()).digest()[:8], "big")
    assert assignment_seed(KEY, 7, 3) == expected
    assert assignment_seed(KEY.upper(), 7, 3) == expected  # hex case does not matter


def test_task_ids_match_numpy_pcg64_and_differ_across_inputs():
    ids = assigned_task_ids(KEY, 5, 2, num_tasks=1000, count=16)
    rng = np.random.Generator(np.random.PCG64(assignment_seed(KEY, 5, 2)))
    assert ids == rng.choice(1000, size=16, replace=False).tolist()
    assert len(set(ids)) == 16 and all(0 <= i < 1000 for i in ids)
    others = [
        assigned_task_ids(KEY, 6, 2, 1000, 16),
        assigned_task_ids(KEY, 5, 3, 1000, 16),
        assigned_task_ids("cd" * 32, 5, 2, 1000, 16),
    ]
    assert all(o != ids for o in others)


def test_same_in_another_process():
    code = f"from bridge.assignment import assigned_task_ids as f; print(f('{KEY}', 9, 1, 50, 8))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(assigned_task_ids(KEY, 9, 1, 50, 8))


def test_more_samples_than_tasks_repeats_and_seeds_are_distinct():
    assert len(assigned_task_ids(KEY, 0, 0, num_tasks=3, count=10)) == 10
    seeds = assigned_sample_seeds(KEY, 0, 0, 64)
    assert len(set(seeds)) == 64 and all(0 <= s < 2**63 for s in seeds)


@pytest.mark.parametrize("args", [(-1, 0, 10, 1), (0, -1, 10, 1), (0, 0, 0, 1), (0, 0, 10, 0)])
def test_bad_arguments_are_refused(args):
    v, k, n, c = args
    with pytest.raises(ValueError, match="assignment"):
        assigned_task_ids(KEY, v, k, n, c)
