"""`intellect orchestrator CONFIG`: run the coordination service (`orchestrator`) on [orchestrator] host:port
until interrupted. The service takes its own section and the few values of the other sections it needs
(`service_values`)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from bridge.curriculum import Curriculum

if TYPE_CHECKING:
    from fastapi import FastAPI

    from intellect.config import Config
    from orchestrator.service import RunValues


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", type=Path, help="TOML recipe (default: the defaults only)")
    parser.epilog = (
        "Storage: orchestrator.database_url, else SQLite at <run.dir>/orchestrator.db. Admin routes "
        "(and the learner) need orchestrator.admin_token, e.g. INTELLECT_ORCHESTRATOR__ADMIN_TOKEN."
    )


def service_values(cfg: Config, database_url: str | None = None) -> RunValues:
    """The values of `cfg`'s other sections the service needs; storage: `database_url`, else
    orchestrator.database_url, else SQLite at <run.dir>/orchestrator.db (run.dir is created)."""
    from gpu_workers.config import sample_caps
    from intellect.config import rollout_store
    from orchestrator.db import sqlite_url
    from orchestrator.service import RunValues

    url = database_url or cfg.orchestrator.database_url
    if url is None:
        Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
        url = sqlite_url(cfg.run.db_path)
    sc = cfg.shardcast
    # a sample's sampled tokens (a completion; an episode's model turns) and the rest (a prompt; an episode's prompt
    # and environment turns): they size the deadline, and together bound an uploaded batch's samples
    sampled, total = sample_caps(cfg.worker, cfg.data)
    return RunValues(
        name=cfg.run.name,
        database_url=url,
        async_level=cfg.trainer.async_level,
        prompts_per_step=cfg.data.prompts_per_step,
        samples_per_prompt=cfg.data.samples_per_prompt,
        max_tokens=sampled,
        relays=tuple(sc.relays or [f"http://{sc.host}:{sc.port}"]),
        max_prompt_len=total - sampled,
        rollout_store=rollout_store(cfg, "ingest") if cfg.ingest.in_process else None,
        curriculum=curriculum_of(cfg.data),
    )


def curriculum_of(data) -> Curriculum | None:
    """The pool's curriculum rule (`bridge.curriculum`) from `[data]`; None without levels."""
    if not data.curriculum:
        return None
    return Curriculum(len(data.curriculum), data.curriculum_promote, data.curriculum_demote, data.curriculum_window)


def build_app(cfg: Config, clock: Callable[[], float] = time.time, database_url: str | None = None) -> FastAPI:
    """The service's FastAPI application for the whole config `cfg` (see `service_values` for the storage)."""
    from orchestrator.app import create_app

    return create_app(cfg.orchestrator, service_values(cfg, database_url), clock, cfg.ingest)


def run(args: argparse.Namespace) -> int:
    import logging

    from intellect.cli import config_from_args
    from orchestrator.db import SchemaError
    from orchestrator.guards import bound_log_lines
    from orchestrator.server import serve

    cfg = config_from_args(args)
    logging.basicConfig(level=cfg.run.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    bound_log_lines()  # no request makes a log record longer than a few kB
    try:
        app = build_app(cfg)
    except SchemaError as exc:
        print(f"intellect orchestrator: {exc}", flush=True)
        return 1
    oc = cfg.orchestrator
    from gpu_workers.calibration import needs_calibration

    if not needs_calibration(cfg.worker):
        logging.getLogger("orchestrator").info(
            "a %s pool with the %s sampler: no near-tie ledger needed%s",
            cfg.worker.dtype,
            cfg.worker.sampler,
            "" if oc.near_tie_rate is None else f" (orchestrator.near_tie_rate {oc.near_tie_rate:g} kept anyway)",
        )
    elif oc.near_tie_rate is None:
        logging.getLogger("orchestrator").warning(
            "a %s replay pool without orchestrator.near_tie_rate: the workers' near-tie ledger is off and a near-tie "
            "cheater meets only each batch's budget; `intellect calibrate CONFIG` writes the rate (validators of "
            "this recipe refuse to start without it unless validator.allow_uncalibrated)",
            cfg.worker.dtype,
        )
    if oc.admin_token is None:
        logging.getLogger("orchestrator").warning(
            "orchestrator.admin_token is not set: admin routes and policy announcements are refused"
        )
    print(f"orchestrator: http://{oc.host}:{oc.port}/ (dashboard), API docs at /docs", flush=True)
    # Idle keep-alive connections are kept (keepalive_s, 20 s) longer than clients keep theirs (aiohttp: 15 s,
    # httpx: 5 s), so that a client never sends on a connection the server is closing at that moment.
    limits = server_limits(cfg)
    serve(app, oc.host, oc.port, limits, cfg.run.log_level.lower(), oc.trusted_proxies)
    return 0


def server_limits(cfg: Config):
    """The connection limits of [orchestrator] (the orchestrator's and `intellect ingest`'s servers)."""
    from orchestrator.guards import address_group
    from orchestrator.server import Limits

    oc = cfg.orchestrator
    return Limits(
        max_connections=oc.max_connections,
        max_connections_per_ip=oc.max_connections_per_ip,
        max_header_bytes=oc.max_header_kib << 10,
        header_timeout_s=oc.header_timeout_s,
        body_timeout_s=oc.body_timeout_s,
        keepalive_s=oc.keepalive_s,
        exempt=frozenset(address_group(a) for a in oc.trusted_proxies),
        upload_timeout_s=cfg.ingest.upload_timeout_s,
    )
