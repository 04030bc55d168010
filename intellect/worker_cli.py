"""`intellect worker CONFIG [--section.key value ...]`: a rollout worker (`gpu_workers.worker`).

Joins the pool at `worker.orchestrator_url` with the key `worker.key_path` (created if missing), fetches policy
versions through the relays the orchestrator names (or `shardcast.relays`, else the origin), generates from the
tasks of `[data]` and uploads its batches to the pool (it holds no storage credentials) until SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", type=Path, nargs="?", default=None, help="TOML recipe")


def node_dir(cfg, role: str, key_path: Path) -> Path:
    """<run.dir>/nodes/<role>-<first 16 hex digits of the public key>: this node's own files."""
    from bridge.protocol import load_or_create_key, public_key_hex

    return Path(cfg.run.dir) / "nodes" / f"{role}-{public_key_hex(load_or_create_key(key_path))[:16]}"


def client_servers(cfg) -> tuple[str, ...]:
    """SHARDCAST servers to fetch from when the policy names no relays: shardcast.relays, else the origin."""
    from intellect.shardcast_cli import origin_url

    return tuple(cfg.shardcast.relays) or (origin_url(cfg.shardcast),)


def build_worker(cfg, tasks, stop=None):
    """The worker of a resolved config: its `[worker]`, `[data]` and `[shardcast]` sections as they are, and
    the locations whose defaults lie under run.dir (key file, weights directory, outbox, servers)."""
    from gpu_workers.worker import Worker

    key_path = cfg.worker.key_path or cfg.run.keys_dir / "worker.key"
    return Worker(
        cfg.worker,
        cfg.data,
        cfg.shardcast,
        tasks,
        key_path=key_path,
        weights_dir=cfg.worker.weights_dir or node_dir(cfg, "worker", key_path) / "weights",
        outbox=cfg.worker.outbox_dir or node_dir(cfg, "worker", key_path) / "outbox",
        servers=client_servers(cfg),
        stop=stop,
    )


def limit_cpu_threads(threads: int) -> None:
    """OMP_NUM_THREADS for this process's torch and vLLM (`[worker]`/`[validator]` cpu_threads; 0 leaves the
    libraries' default). Set before torch is imported, since OpenMP reads it once."""
    if threads > 0:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(threads)


def setup_logging(cfg, role: str) -> None:
    logging.basicConfig(level=cfg.run.log_level, format=f"%(asctime)s {role} %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would drown the log


def run(args: argparse.Namespace) -> int:
    from intellect.cli import config_from_args

    cfg = config_from_args(args)
    setup_logging(cfg, "worker")
    limit_cpu_threads(cfg.worker.cpu_threads)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(cfg.worker.kv_cache_gib))))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the TOPLOC capture hooks the model in process

    from gpu_workers.rewards import code
    from intellect.tasks_setup import training_tasks

    tasks = training_tasks(cfg.data)
    try:  # before anything heavy: a node that cannot run its tasks' rewards safely says so at once
        code.prepare(tasks, cfg.data.allow_unsandboxed_code)
    except code.SandboxUnavailable as err:
        print(f"intellect worker: {err}", file=sys.stderr)
        return 2

    from gpu_workers.node import NodeBanned, NodeRefused

    try:
        return build_worker(cfg, tasks).run()
    except (NodeBanned, NodeRefused) as err:
        print(f"intellect worker: {err}")
        return 3
