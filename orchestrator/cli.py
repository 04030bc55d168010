"""`intellect orchestrator CONFIG`: run the coordination service on [orchestrator] host:port until interrupted."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", type=Path, help="TOML recipe (default: the defaults only)")
    parser.epilog = ("Storage: orchestrator.database_url, else SQLite at <run.dir>/orchestrator.db. Admin routes "
                     "(and the learner) need orchestrator.admin_token, e.g. INTELLECT_ORCHESTRATOR__ADMIN_TOKEN.")


def run(args: argparse.Namespace) -> int:
    import gc
    import logging

    import uvicorn

    from intellect.cli import config_from_args
    from orchestrator.app import create_app
    from orchestrator.db import SchemaError

    cfg = config_from_args(args)
    logging.basicConfig(level=cfg.run.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        app = create_app(cfg)
    except SchemaError as exc:
        print(f"intellect orchestrator: {exc}", flush=True)
        return 1
    oc = cfg.orchestrator
    if oc.admin_token is None:
        logging.getLogger("orchestrator").warning(
            "orchestrator.admin_token is not set: admin routes and policy announcements are refused")
    print(f"orchestrator: http://{oc.host}:{oc.port}/ (dashboard), API docs at /docs", flush=True)
    # What exists now (the application, its modules, the registry's nodes) lives as long as the service: frozen
    # out of the garbage collector's view, so that its full collections do not walk it again and again (they
    # stalled every request for 50-80 ms at 1,000 nodes).
    gc.collect()
    gc.freeze()
    # No X-Forwarded-For handling: nothing here depends on a client's address (nodes are known by their keys).
    # Idle keep-alive connections are kept longer than clients keep theirs (aiohttp: 15 s, httpx: 5 s), so that a
    # client never sends on a connection the server is closing at that moment.
    uvicorn.run(app, host=oc.host, port=oc.port, log_level=cfg.run.log_level.lower(), access_log=False, proxy_headers=False,
                timeout_keep_alive=75)
    return 0
