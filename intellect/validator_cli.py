"""`intellect validator CONFIG [--section.key value ...]`: a validator (`gpu_workers.validator`).

Judges batches against the pool's own settings: the tasks and length targets of `[data]`, the sampling
parameters of `[worker]` (temperature, top_p, max tokens), the TOPLOC thresholds and prefill dtype of
`[validator]`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from intellect.worker_cli import client_servers, max_tokens, node_dir, setup_logging, store_location


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", type=Path, nargs="?", default=None, help="TOML recipe")


def run(args: argparse.Namespace) -> int:
    from intellect.cli import config_from_args

    cfg = config_from_args(args)
    setup_logging(cfg, "validator")

    from gpu_workers.checks import Declared
    from gpu_workers.node import NodeBanned, NodeRefused
    from gpu_workers.rewards import code
    from gpu_workers.toploc import Thresholds
    from gpu_workers.validator import Validator, ValidatorSettings
    from intellect.tasks_setup import training_tasks

    v, d = cfg.validator, cfg.data
    key_path = v.key_path or cfg.run.keys_dir / "validator.key"
    declared = Declared(temperature=cfg.worker.temperature, top_p=cfg.worker.top_p, max_tokens=max_tokens(cfg),
                        stop_token_ids=frozenset(), max_model_len=d.max_prompt_len + max_tokens(cfg),
                        thresholds=Thresholds(v.max_exp_mismatches, v.max_mantissa_err_mean,
                                              v.max_mantissa_err_median),
                        sampler=cfg.worker.sampler, dtype=cfg.worker.dtype)
    settings = ValidatorSettings(
        orchestrator_url=v.orchestrator_url, key_path=key_path,
        weights_dir=v.weights_dir or node_dir(cfg, "validator", key_path) / "weights", store=store_location(cfg),
        declared=declared, samples_per_prompt=d.samples_per_prompt, length_targets=tuple(d.length_targets),
        length_penalty=d.length_penalty, length_mode=d.length_mode, system_prompt=d.system_prompt,
        servers=client_servers(cfg), dtype=v.dtype, cache_versions=v.cache_versions, lease_s=v.lease_s,
        health_file=v.health_file, fetch_timeout_s=cfg.shardcast.timeout_s,
        fetch_direct_io=cfg.shardcast.direct_io, fetch_buffer_mib=cfg.shardcast.buffer_mib)
    tasks = training_tasks(d)
    try:
        code.prepare(tasks, d.allow_unsandboxed_code)
    except code.SandboxUnavailable as err:
        print(f"intellect validator: {err}", file=sys.stderr)
        return 2
    try:
        return Validator(settings, tasks).run()
    except (NodeBanned, NodeRefused) as err:
        print(f"intellect validator: {err}")
        return 3
