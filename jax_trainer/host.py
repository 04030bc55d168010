"""Process settings a learner makes before JAX starts: XLA flags, and how the C allocator treats freed memory.

XLA:CPU allocates the temporaries of every step afresh and frees them at the end of the step. glibc serves
blocks that large with `mmap` and hands them back with `munmap` (or trims its heap), so each step touches
the same hundreds of MiB as new pages: one page fault per 4 KiB. Measured with `benchmarks/train_step.py`
(4-layer Qwen2, seq 512, batch 8, float32) on the 2-core development VM: 293,000 minor faults per step,
0.23 of a core in the kernel, 12-20% of the step. `retain_freed_memory` tells glibc to keep what it frees
(no mmap for large blocks, one arena, so no per-thread heap is shrunk either, and the heap's top is trimmed
only past 2 GiB free): over 30 steps, no fault at all after the first, and the resident size flat at 2.9 GB
instead of 1.85 GB. That is the cost: memory the process freed stays its own. `trainer.retain_host_memory =
false` turns it off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

from jax_trainer import xla_flags

log = logging.getLogger("jax_trainer.host")

_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8  # mallopt parameters (glibc malloc.h)


def retain_freed_memory() -> bool:
    """Ask glibc to keep freed memory for reuse; False where the C library is not glibc (nothing changed)."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # each call returns 1 on success; arenas are limited first, before XLA starts its thread pools. Trimming is
    # bounded, not off: with none at all the heap's free top grew by a step's worth every few steps
    return all(mallopt(param, value) == 1 for param, value in (
        (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1)))


def prepare(retain_memory: bool = True) -> dict:
    """XLA:CPU flags (`jax_trainer.xla_flags`; other backends ignore them) and, if asked, `retain_freed_memory`.
    Call before the first JAX computation; returns what was done."""
    if "jax" in sys.modules:
        log.debug("jax is already imported: XLA flags apply only if no backend has started yet")
    done = {"xla_flags": xla_flags.apply("cpu"), "retain_freed_memory": False}
    if retain_memory:
        done["retain_freed_memory"] = retain_freed_memory()
    return done
