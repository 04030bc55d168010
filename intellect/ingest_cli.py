"""`intellect ingest CONFIG`: a process that takes batch uploads beside the orchestrator (`orchestrator.ingest`).

It listens on [ingest] host:port, asks the orchestrator at `ingest.orchestrator_url` (with `ingest.token`, else
the admin token: e.g. INTELLECT_INGEST__TOKEN) whether each upload may proceed, and writes the batches to
`ingest.store_url` with the credentials of its own environment. Run as many as the uploads need, behind the same
orchestrator, and list their public URLs in `ingest.urls`: workers spread their uploads over them.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", type=Path, help="TOML recipe (default: the defaults only)")
    parser.epilog = (
        "Writes to ingest.store_url (else <run.dir>/rollouts); the orchestrator is ingest.orchestrator_url. "
        "Secrets: INTELLECT_INGEST__TOKEN (or the admin token), and the store's credentials (e.g. AWS_*)."
    )


def build_app(cfg):
    """The ingest's ASGI application for the whole config `cfg`."""
    from bridge.rollouts import RolloutStore
    from intellect.config import ConfigError, rollout_store
    from orchestrator.ingest import IngestApp, UploadIngest
    from orchestrator.uploads import RemoteGate

    token = cfg.ingest.token or cfg.orchestrator.admin_token
    if not token:
        raise ConfigError("intellect ingest: set ingest.token (or orchestrator.admin_token) to reach the orchestrator")
    store = RolloutStore.open(rollout_store(cfg, "ingest"), compression=cfg.ingest.compression)
    return IngestApp(UploadIngest(store, RemoteGate(cfg.ingest.orchestrator_url, token), cfg.ingest)), store


def run(args: argparse.Namespace) -> int:
    import logging

    from intellect.cli import config_from_args
    from intellect.orchestrator_cli import server_limits
    from orchestrator.guards import bound_log_lines
    from orchestrator.server import serve

    cfg = config_from_args(args)
    logging.basicConfig(level=cfg.run.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    bound_log_lines()
    app, store = build_app(cfg)
    ic = cfg.ingest
    print(f"ingest: http://{ic.host}:{ic.port}/ writing to {store.url}, orchestrator {ic.orchestrator_url}", flush=True)
    serve(app, ic.host, ic.port, server_limits(cfg), cfg.run.log_level.lower(), cfg.orchestrator.trusted_proxies)
    return 0
