"""Process settings a learner makes before JAX starts: XLA flags, and how the C allocator treats freed memory.

XLA:CPU allocates the temporaries of every step afresh and frees them at the end of the step. glibc serves
blocks that large with `mmap` and hands them back with `munmap` (or trims its heap), so each step touches
the same hundreds of MiB as new pages: one page fault per 4 KiB. Measured with `benchmarks/train_step.py`
(4-layer Qwen2, seq 512, batch 8, float32) on the 2-core development VM: 293,000 minor faults per step,
0.23 of a core in the kernel, 12-20% of the step. `retain_freed_memory` tells glibc to keep what it frees
(one arena, so no per-thread heap is shrunk either; blocks below `RETAIN_BELOW` come from that heap instead of
`mmap`; the heap's top is trimmed only past 2 GiB free): over 30 steps of that model, no fault at all after the
first, and the resident size flat at 2.9 GB instead of 1.85 GB. That is the cost: memory the process freed
stays its own. `trainer.retain_host_memory = "auto"` (the default) turns it on only for models small enough
that this cannot exhaust the host (`auto_retain`); true or false force it.

Blocks of `RETAIN_BELOW` (1 GiB) and more still go through `mmap`. XLA:CPU allocates a step's temporaries as
one block, and at the real model's shapes that block is GiBs (4.1 GiB for SmolLM2-135M at 8 x 256 tokens): kept
in the heap, it was not reused by the next step but grew the heap, each step by about a block, so that
the process peaked at twice its plan and still faulted (8 of its 30 layers: 5.9 GiB and 340,000-470,000
faults a step with no mmap at all; 3.05 GiB and 405,000-470,000 faults, the same kernel time, with the
block mapped afresh; the whole model: 10.7 GiB against a 6.6 GiB plan). Below the threshold (the 4-layer
model's step) nothing changes.

Without retention, glibc still keeps much of what a step frees (blocks below its mmap threshold, spread over
per-thread arenas): a Qwen2.5-0.5B-shaped learner on 2 fake devices held 9.7 GiB between steps for 5.5 GiB of
live arrays. `release_freed_memory` (glibc's `malloc_trim`) hands that back; the learner calls it after every
step and export when retention is off, so the memory between steps is the state's, and the next step's
temporaries are the only growth.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import os
import sys
from pathlib import Path

from jax_trainer import xla_flags

log = logging.getLogger("jax_trainer.host")

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # mallopt parameters (glibc malloc.h)
RETAIN_BELOW = 1 << 30  # blocks this large or larger stay mmapped (the module docstring says why)


def retain_freed_memory() -> bool:
    """Ask glibc to keep freed memory for reuse; False where the C library is not glibc (nothing changed)."""
    try:
        mallopt = _libc().mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # each call returns 1 on success; arenas are limited first, before XLA starts its thread pools. Trimming is
    # bounded, not off: with none at all the heap's free top grew by a step's worth every few steps. A fixed
    # mmap threshold also ends glibc's own sliding one (which never rises above 32 MiB)
    return all(
        mallopt(param, value) == 1
        for param, value in ((_M_ARENA_MAX, 1), (_M_MMAP_THRESHOLD, RETAIN_BELOW), (_M_TRIM_THRESHOLD, 2**31 - 1))
    )


def release_freed_memory() -> int:
    """Return the free memory glibc holds (every arena) to the system; the resident bytes released (0 where
    the C library is not glibc)."""
    try:
        trim = _libc().malloc_trim
    except (OSError, AttributeError):
        return 0
    trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
    before = resident_bytes()
    trim(0)
    return max(before - resident_bytes(), 0)


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def resident_bytes() -> int:
    """This process's resident set now (0 where /proc cannot tell)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def auto_retain(model_dir: str | Path, physical_bytes: int | None = None) -> tuple[bool, str]:
    """Whether retaining freed memory is safe for a learner of the model in `model_dir`, and why.

    Retention keeps the process at its peak, and the peak with retention was seen near twice the peak without
    (a Qwen2.5-0.5B-shaped learner: 16.4 GB without, killed at 24.3 GB with). The learner holds about 16 bytes
    per parameter before activations (float32 weights, two AdamW moments, gradients), so retention is turned
    on only when four times that fits in physical memory; the parameter count comes from the size of the
    model's safetensors files and its config's dtype. A directory it cannot size gets no retention.
    """
    directory = Path(model_dir)
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if not files:
        return False, f"no safetensors files in {directory} to size the learner from"
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    stored = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    width = 2 if stored in ("bfloat16", "float16") else 4
    params = sum(f.stat().st_size for f in files) // width
    physical = physical_bytes or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    need = 4 * 16 * params
    if need < physical:
        return (
            True,
            f"~{params / 1e6:.0f}M parameters: 4 x 16 bytes each ({need / 2**30:.1f} GiB) fit in "
            f"{physical / 2**30:.1f} GiB",
        )
    return (
        False,
        f"~{params / 1e6:.0f}M parameters: 4 x 16 bytes each ({need / 2**30:.1f} GiB) exceed "
        f"{physical / 2**30:.1f} GiB of memory",
    )


def prepare(retain_memory: bool | str = True, model_dir: str | Path | None = None) -> dict:
    """XLA:CPU flags (`jax_trainer.xla_flags`; other backends ignore them) and, if asked, `retain_freed_memory`
    (`retain_memory = "auto"`: as `auto_retain` decides for `model_dir`, logged). Without retention, memory is
    what counts: the lean flags (no YNNPACK fusion, whose buffers no memory plan sees). Call before the first
    JAX computation; returns what was done."""
    if retain_memory == "auto":
        retain_memory, why = auto_retain(model_dir) if model_dir is not None else (False, "no model to size")
        log.info("host memory retention %s: %s", "on" if retain_memory else "off", why)
    if "jax" in sys.modules:
        log.debug("jax is already imported: XLA flags apply only if no backend has started yet")
    done = {"xla_flags": xla_flags.apply("cpu", lean=not retain_memory), "retain_freed_memory": False}
    if retain_memory:
        done["retain_freed_memory"] = retain_freed_memory()
    return done
