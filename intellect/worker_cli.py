"""`intellect worker CONFIG [--section.key value ...]`: a rollout worker (`gpu_workers.worker`).

Joins the pool at `worker.orchestrator_url` with the key `worker.key_path` (created if missing), fetches policy
versions through the relays the orchestrator names (or `shardcast.relays`, else the origin), writes batches to
`worker.store_url` and generates from the tasks of `[data]` until SIGTERM.
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


def store_location(cfg) -> str:
    return cfg.worker.store_url or str(Path(cfg.run.dir) / "rollouts")


def max_tokens(cfg) -> int:
    return cfg.worker.max_tokens or cfg.data.max_new_tokens


def setup_logging(cfg, role: str) -> None:
    logging.basicConfig(level=cfg.run.log_level, format=f"%(asctime)s {role} %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would drown the log


def run(args: argparse.Namespace) -> int:
    from intellect.cli import config_from_args

    cfg = config_from_args(args)
    setup_logging(cfg, "worker")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(cfg.worker.kv_cache_gib))))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the TOPLOC capture hooks the model in process

    from gpu_workers.rewards import code
    from intellect.tasks_setup import training_tasks

    w, d = cfg.worker, cfg.data
    tasks = training_tasks(d)
    try:  # before anything heavy: a node that cannot run its tasks' rewards safely says so at once
        code.prepare(tasks, d.allow_unsandboxed_code)
    except code.SandboxUnavailable as err:
        print(f"intellect worker: {err}", file=sys.stderr)
        return 2

    from gpu_workers.engine import EngineSettings
    from gpu_workers.node import NodeBanned, NodeRefused
    from gpu_workers.worker import Sampling, Worker, WorkerSettings

    key_path = w.key_path or cfg.run.keys_dir / "worker.key"
    settings = WorkerSettings(
        orchestrator_url=w.orchestrator_url, key_path=key_path,
        weights_dir=w.weights_dir or node_dir(cfg, "worker", key_path) / "weights", store=store_location(cfg),
        sampling=Sampling(temperature=w.temperature, top_p=w.top_p, max_tokens=max_tokens(cfg),
                          length_targets=tuple(d.length_targets), length_penalty=d.length_penalty,
                          length_mode=d.length_mode, system_prompt=d.system_prompt),
        engine=EngineSettings(dtype=w.dtype, max_model_len=d.max_prompt_len + max_tokens(cfg), seed=w.seed,
                              verify_swaps=w.verify_swaps > 0, verify_every=max(1, w.verify_swaps),
                              sampler=w.sampler),
        servers=client_servers(cfg), keep_versions=w.keep_versions, health_file=w.health_file,
        fetch_timeout_s=cfg.shardcast.timeout_s, fetch_patience_s=cfg.shardcast.patience_s,
        fetch_direct_io=cfg.shardcast.direct_io, fetch_buffer_mib=cfg.shardcast.buffer_mib)
    try:
        return Worker(settings, tasks).run()
    except (NodeBanned, NodeRefused) as err:
        print(f"intellect worker: {err}")
        return 3
