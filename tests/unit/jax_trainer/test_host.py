"""`jax_trainer.host`: glibc keeps freed memory when asked, so a buffer freed and allocated again is not faulted
in afresh (what XLA:CPU does with its per-step temporaries)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from jax_trainer import host

PROGRAM = r"""
import ctypes, resource, sys
from jax_trainer import host
if sys.argv[1] == "retain":
    assert host.retain_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
faults = []
for _ in range(3):  # 256 MiB written, freed, and again: the size of a step's temporaries
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(256 << 20)
    ctypes.memset(p, 1, 256 << 20)
    libc.free(p)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(faults)
"""


def _faults(mode: str) -> list[int]:
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM, mode],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert out.returncode == 0, out.stderr
    return eval(out.stdout)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_freed_memory_is_reused_without_page_faults():
    pages = (256 << 20) // os.sysconf("SC_PAGE_SIZE")
    default = _faults("default")
    assert all(f > pages // 2 for f in default)  # glibc maps and unmaps a block this large every time
    retained = _faults("retain")
    assert retained[0] > pages // 2  # the first touch is paid once
    assert all(f < pages // 100 for f in retained[1:])  # then the same pages are reused


HUGE = r"""
import ctypes
from jax_trainer import host
assert host.retain_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
size = host.RETAIN_BELOW + (64 << 20)
p = libc.malloc(size)
ctypes.memset(p, 1, size)
held = host.resident_bytes()
libc.free(p)
print(held, host.resident_bytes())
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_retention_hands_back_a_block_the_size_of_a_real_models_step():
    # XLA:CPU's temporaries of a step are one block; GiBs at real shapes, which the heap did not reuse
    out = subprocess.run(
        [sys.executable, "-c", HUGE],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert out.returncode == 0, out.stderr
    held, after = map(int, out.stdout.split())
    assert held - after > host.RETAIN_BELOW - (64 << 20), (held, after)  # unmapped when freed, not kept


TRIM = r"""
import ctypes, sys
from jax_trainer import host
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
def resident():
    return host.resident_bytes()
# 192 MiB in 64 KiB blocks (below glibc's mmap threshold: they live in the heap), the last one kept so that
# glibc's own trimming of the heap's top cannot return the rest
blocks = [libc.malloc(64 << 10) for _ in range(3072)]
for b in blocks:
    ctypes.memset(b, 1, 64 << 10)
for b in blocks[:-1]:
    libc.free(b)
held = resident()
released = host.release_freed_memory()
print(held, resident(), released)
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_release_hands_back_what_glibc_holds():
    out = subprocess.run(
        [sys.executable, "-c", TRIM],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert out.returncode == 0, out.stderr
    held, after, released = map(int, out.stdout.split())
    assert held - after > 150 << 20, (held, after)  # the freed 192 MiB were resident until the release
    assert abs(released - (held - after)) < 16 << 20


def test_prepare_applies_the_xla_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    done = host.prepare(retain_memory=False)
    assert done["retain_freed_memory"] is False
    assert os.environ["XLA_FLAGS"].split()[0] == "--xla_cpu_enable_fast_math=false"
    assert all(flag in os.environ["XLA_FLAGS"] for flag in done["xla_flags"])
    # without retention memory is tight: no YNNPACK fusion (its buffers are outside XLA's plan); with it, the
    # default flags, which hold no experimental fusion the real model's step fails with (test_real_shapes.py)
    assert "--xla_cpu_experimental_ynn_fusion_type=" in done["xla_flags"]
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setattr(host, "retain_freed_memory", lambda: True)
    with_retention = host.prepare(True)["xla_flags"]
    assert "--xla_cpu_experimental_ynn_fusion_type=" not in with_retention
    assert not any("eltwise" in flag for flag in with_retention)


def test_safety_flags_keep_the_users_value_and_start_jax(tmp_path):
    from jax_trainer import xla_flags

    env = {"XLA_FLAGS": "--xla_cpu_collective_timeout_seconds=5"}
    added = xla_flags.apply_safety(env)
    assert "--xla_cpu_collective_timeout_seconds=5" in env["XLA_FLAGS"].split()
    assert all(not flag.startswith("--xla_cpu_collective_timeout_seconds") for flag in added) and added
    # XLA aborts on a flag it does not know: a fresh process with every flag we add must compute
    for lean in (False, True):
        full = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
        xla_flags.apply("cpu", full, lean=lean)
        code = "import jax, jax.numpy as jnp; print(float(jax.jit(lambda x: x.sum())(jnp.ones(3))))"
        result = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0 and result.stdout.strip() == "3.0", result.stderr[-2000:]


def test_auto_retention_only_where_the_model_leaves_room(tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # prepare() appends to it
    small, large = tmp_path / "small", tmp_path / "large"
    for directory, size in ((small, 4 << 20), (large, 1 << 30)):
        directory.mkdir()
        (directory / "config.json").write_text('{"torch_dtype": "bfloat16"}')
        with open(directory / "model.safetensors", "wb") as f:
            f.truncate(size)  # sparse: the size is what counts
    on, why = host.auto_retain(small, physical_bytes=24 << 30)
    assert on and "2M parameters" in why
    off, why = host.auto_retain(large, physical_bytes=24 << 30)  # 0.5B bf16 parameters: 32 GiB > 24 GiB
    assert not off and "537M parameters" in why and "exceed" in why
    assert host.auto_retain(tmp_path / "missing")[0] is False
    assert host.prepare("auto", large)["retain_freed_memory"] is False
