"""The curriculum's rule and its task slices (`bridge.curriculum`, `bridge.assignment`), against plain numpy."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from bridge.assignment import assigned_task_ids
from bridge.curriculum import Curriculum, solve_rate

KEY, SALT = "0f" * 32, "ab" * 32


def test_a_level_moves_after_a_full_window_of_its_batches_and_only_then():
    c = Curriculum(levels=3, promote=0.6, demote=0.1, window=3)
    assert c.next_level(0, [1.0, 1.0]) == 0  # two batches: the window is not full yet
    assert c.next_level(0, [1.0, 0.5, 0.2]) == 0  # mean 0.567 < 0.6: stays
    assert c.next_level(0, [0.7, 0.6, 0.5]) == 1  # mean 0.6: up
    assert c.next_level(0, [0.0, 0.7, 0.6, 0.5]) == 1  # the last `window` count
    assert c.next_level(2, [1.0, 1.0, 1.0]) == 2  # the top stays the top
    assert c.next_level(1, [0.1, 0.0, 0.1]) == 0  # mean 0.067 < 0.1: down
    assert c.next_level(0, [0.0, 0.0, 0.0]) == 0  # the bottom stays the bottom
    assert c.next_level(1, [0.3, 0.3, 0.3]) == 1
    never_down = Curriculum(levels=2, promote=0.5, demote=0.0, window=1)
    assert never_down.next_level(1, [0.0]) == 1
    with pytest.raises(ValueError, match="level 3 is not one of 0..2"):
        c.next_level(3, [])
    for bad in (dict(levels=0), dict(window=0), dict(demote=0.7), dict(promote=1.5)):
        with pytest.raises(ValueError, match="curriculum"):
            Curriculum(**{**dict(levels=2, promote=0.6, demote=0.1, window=2), **bad})


def test_solve_rate_counts_rewards_of_at_least_one():
    assert solve_rate([1.0, 0.0, 0.99, 1.5]) == 0.5
    assert solve_rate([]) == 0.0


def _reference_draw(version, k, size, count, level):
    """The salted seed of bridge.assignment (its docstring), then numpy's choice, shifted to the level's slice."""
    text = f"intellect-assignment/v2|{KEY}|{version}|{k}|{SALT}"
    seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")
    rng = np.random.Generator(np.random.PCG64(seed))
    return [level * size + int(i) for i in rng.choice(size, size=count, replace=count > size)]


def test_an_assignment_draws_from_its_levels_slice_and_one_level_draws_as_before():
    for level in range(3):
        ids = assigned_task_ids(KEY, 4, 2, 300, 8, SALT, level=level, levels=3)
        assert ids == _reference_draw(4, 2, 100, 8, level)
        assert all(100 * level <= i < 100 * (level + 1) for i in ids)
    assert assigned_task_ids(KEY, 4, 2, 300, 8, SALT) == _reference_draw(4, 2, 300, 8, 0)
    assert assigned_task_ids(KEY, 4, 2, 300, 8, SALT, level=0, levels=1) == _reference_draw(4, 2, 300, 8, 0)
    for level, levels, n in ((3, 3, 300), (-1, 3, 300), (0, 0, 300), (0, 7, 300)):
        with pytest.raises(ValueError, match="equal slices"):
            assigned_task_ids(KEY, 4, 2, n, 8, SALT, level=level, levels=levels)
