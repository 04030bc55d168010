"""`intellect validator CONFIG [--section.key value ...]`: a validator (`gpu_workers.validator`).

Judges batches against the pool's own settings: the tasks and length targets of `[data]`, the sampling
parameters of `[worker]` (temperature, top_p, max tokens), the TOPLOC thresholds and prefill dtype of
`[validator]`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from intellect.worker_cli import client_servers, limit_cpu_threads, node_dir, setup_logging


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", type=Path, nargs="?", default=None, help="TOML recipe")


def build_validator(cfg, tasks, stop=None):
    """The validator of a resolved config: its `[validator]` section, the pool's `[worker]` sampling, `[data]`
    and `[shardcast]` as they are, and the locations whose defaults lie under run.dir."""
    from gpu_workers.validator import Validator
    from intellect.config import rollout_store

    key_path = cfg.validator.key_path or cfg.run.keys_dir / "validator.key"
    return Validator(
        cfg.validator,
        cfg.worker,
        cfg.data,
        cfg.shardcast,
        tasks,
        model_dir=Path(cfg.model.path),
        key_path=key_path,
        weights_dir=cfg.validator.weights_dir or node_dir(cfg, "validator", key_path) / "weights",
        store=rollout_store(cfg, "validator"),
        servers=client_servers(cfg),
        stop=stop,
    )


def run(args: argparse.Namespace) -> int:
    from intellect.cli import config_from_args

    cfg = config_from_args(args)
    setup_logging(cfg, "validator")
    limit_cpu_threads(cfg.validator.cpu_threads)
    from gpu_workers.prefill import resolve_device
    from intellect.config import ConfigError

    try:  # a GPU the machine lacks is a config error, printed as one (the Validator checks it again)
        resolve_device(cfg.validator.device)
    except ValueError as err:
        raise ConfigError(str(err)) from None

    from gpu_workers.node import NodeBanned, NodeRefused
    from gpu_workers.rewards import code
    from intellect.tasks_setup import training_tasks

    tasks = training_tasks(cfg.data)
    try:
        code.prepare(tasks, cfg.data.allow_unsandboxed_code)
        if cfg.data.env is not None:  # an environment whose tools run model-written code needs the sandbox too
            from gpu_workers.envs.loading import load_environment, prepare

            prepare(load_environment(cfg.data.env, cfg.data.env_config), cfg.data.allow_unsandboxed_code)
    except code.SandboxUnavailable as err:
        print(f"intellect validator: {err}", file=sys.stderr)
        return 2
    from gpu_workers.calibration import CalibrationError, calibration_problem

    problem = calibration_problem(cfg.validator, cfg.worker, Path(cfg.model.path), cfg.orchestrator.near_tie_rate)
    if problem is not None:  # the validator checks the model again; the ledger is the recipe's to set
        raise ConfigError(problem)
    try:
        validator = build_validator(cfg, tasks)
    except CalibrationError as err:
        raise ConfigError(str(err)) from None
    try:
        return validator.run()
    except (NodeBanned, NodeRefused) as err:
        print(f"intellect validator: {err}")
        return 3
