"""The origin: serves the learner's weights directory, advertising each version the moment its STABLE appears.

The directory is rescanned every `poll_s` (50 ms: a `scandir` and a `stat` per version still being written),
so a new version is offered within a tick of the learner writing STABLE, and long-polls return at once.
The origin never deletes anything: the directory belongs to the learner. A version whose manifest is broken
or whose files do not have the listed sizes is not served, and the reason is logged once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from bridge.shardcast.server import ServerLimits, ShardcastServer
from bridge.shardcast.store import VersionStore


async def serve_origin(
    root: Path,
    *,
    host: str,
    port: int,
    ready: Callable[[str], None],
    timeout: float = 30.0,
    limits: ServerLimits = ServerLimits(),
    poll_s: float = 0.05,
) -> None:
    """Serve until cancelled; `ready(url)` is called once the port is bound."""
    store = VersionStore(Path(root))
    store.scan()
    server = ShardcastServer(store, role="origin", host=host, port=port, timeout=timeout, limits=limits)
    ready(await server.start())
    try:
        while True:
            await asyncio.sleep(poll_s)
            store.scan()
    finally:
        await server.stop()
