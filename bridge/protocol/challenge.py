"""The registration compute challenge (docs/design.md section 8): a node proves it can multiply two seeded
matrices in time; the service checks the answer with the same function.
"""

from __future__ import annotations

import hashlib

import numpy as np


def challenge_matrices(seed: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Two `size` x `size` int64 matrices with entries in [0, 2**16), from numpy's PCG64 stream of `seed`."""
    rng = np.random.Generator(np.random.PCG64(seed))
    return rng.integers(0, 1 << 16, (size, size), dtype=np.int64), rng.integers(
        0, 1 << 16, (size, size), dtype=np.int64
    )


def solve_challenge(seed: int, size: int) -> str:
    """sha256 hex of the product's little-endian int64 bytes. Every entry is below 2**32 * size <= 2**44, so the
    product is exact in int64 and in float64 alike (every partial sum is an integer below 2**53): computed here
    with float64 BLAS (size 512: ~35 ms on one core, against ~0.9 s for numpy's int64 loop); a GPU may do the same."""
    a, b = challenge_matrices(seed, size)
    product = a.astype(np.float64) @ b.astype(np.float64)
    return hashlib.sha256(product.astype("<i8").tobytes()).hexdigest()
