"""SHARDCAST's config section, `[shardcast]`: the origin's address, the relays, and how clients and servers
fetch, serve and keep versions. `intellect.config.Config` composes it with the other sections; the workers
and validators read its client settings (`timeout_s`, `patience_s`, `direct_io`, `buffer_mib`).
"""

from __future__ import annotations

from pydantic import Field

from bridge.config import Section


class ShardcastConfig(Section):
    """[shardcast]: the weight broadcast tree from the learner's origin through relays to the workers."""

    host: str = "127.0.0.1"
    """Address the SHARDCAST origin listens on."""
    port: int = Field(8100, ge=1, le=65535)
    """Port of the SHARDCAST origin (local relays take the following ports)."""
    relays: list[str] = []
    """Relay URLs the orchestrator tells workers to fetch weights from (empty: the origin itself)."""
    servers: list[str] = []
    """Upstream servers a relay mirrors (empty: the origin at http://host:port)."""
    keep_versions: int = Field(3, gt=0)
    """Newest policy versions each server keeps; at least trainer.async_level + 1."""
    keep_anchor: bool = True
    """Relays and workers also keep the newest anchor version (delta base; at most keep_versions + 1 on disk)."""
    parallel: int = Field(0, ge=0, le=64)
    """Concurrent part downloads of one client or relay, each from any server; 0: one per CPU core, at most 4."""
    part_mib: int = Field(64, gt=0)
    """Files are fetched in parts of this many MiB; a broken part resumes with Range from any server."""
    timeout_s: float = Field(30.0, gt=0)
    """Seconds a peer may take to connect, answer, or move 1 MiB before the connection is dropped (both sides)."""
    patience_s: float = Field(300.0, gt=0)
    """Seconds a fetch keeps retrying without receiving a byte before it gives up."""
    retire_grace_s: float = Field(60.0, ge=0)
    """Seconds a relay keeps a version it no longer advertises after its last request, for clients mid-fetch."""
    max_connections: int = Field(1024, gt=0)
    """Connections a server holds at once; a newcomer displaces an idle one of the fullest address, else is closed."""
    max_connections_per_ip: int = Field(64, gt=0)
    """Connections a server holds at once from one client address (IPv6: one /64); beyond it, as above."""
    header_timeout_s: float = Field(10.0, gt=0)
    """Seconds a server gives a request head from its first byte to its last; slower ones get 408 and are closed."""
    keepalive_s: float = Field(15.0, gt=0)
    """Seconds a server keeps a connection with no request in progress (before the first and between requests)."""
    max_header_kib: int = Field(16, gt=0, le=1024)
    """Largest request head (request line and headers) a server reads, in KiB; larger get 431 and are closed."""
    pin_manifests: bool = True
    """Relays mirror a version only under the manifest sha256 the orchestrator (worker.orchestrator_url) announced."""
    max_version_gib: float = Field(4096.0, gt=0)
    """Largest version (sum of its files) a client or relay accepts, in GiB; a manifest claiming more is refused."""
    fsync: bool = True
    """Flush fetched files to disk before a version is marked STABLE."""
    direct_io: bool = True
    """Clients (not relays) land files with O_DIRECT from a few reusable buffers instead of the page cache."""
    buffer_mib: int = Field(32, gt=0, le=1024)
    """Size of each direct I/O buffer (a client holds 2 * parallel + 2 of them); parts are at most this long."""
