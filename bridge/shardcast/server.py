"""The HTTP side of an origin or a relay (docs/design.md section 5), on aiohttp's low-level server.

Routes: `GET /versions[?after=N&wait=S[&partial=1]]` (long-poll), `GET /v/{version}/manifest.json`,
`GET /v/{version}/{file}` (`Range` honoured, bytes sent with `sendfile`), `GET /healthz`; HEAD works where
GET does. A URL's segments are matched as raw text against validated versions and against the names in the
version's manifest, so nothing outside a version directory can ever be named.

A version a relay is still receiving (`VersionStore.arriving`: its manifest has part hashes) is listed under
`partial` in `/versions`, and `partial=1` lets a long-poll return for one. Its manifest and files are served
only to a request with the header `X-Shardcast-Partial: WAIT` (others get 404, as for a version not held), and
of its files only bytes in parts the relay has checked against their sha256: a range that reaches into a part
not checked yet is held until it is (at most WAIT seconds, capped at `MAX_PARTIAL_WAIT`), then answered 503
with `Retry-After`. Unchecked bytes are never sent.

Bounds against hostile clients (`ServerLimits`; the recipe's `[shardcast]` section sets them):
- connections: at most `max_connections` in all and `max_per_ip` from one client address (an IPv6 client is
  its /64). A new connection beyond either cap first displaces a connection of the fullest address that is
  doing nothing useful (idle, or sending its request head for over `EVICT_AFTER_S`, or waiting in a
  long-poll), oldest first; only when none is displaceable is the new one refused (closed at once). So idle
  or trickling sockets cannot lock an address's other clients out: they lose their place to the next
  connection from that address.
- request heads: at most `max_header_bytes` (request line and headers; 431 and close) and `header_timeout`
  seconds from a head's first byte to its last (408 and close); a connection with no request in progress is
  closed after `keepalive` seconds (before its first request and between requests).
- bodies: GET and HEAD carry none; a request with a body gets 413 and the connection is closed without the
  body being read.
- responses: a client that takes more than `timeout` seconds to accept the next `SEND_CHUNK` bytes is
  dropped (sendfile keeps nothing in memory meanwhile); long-polls are capped at `MAX_WAIT` seconds.
- `Range`: one range of `bytes=` only; anything that selects no byte (`bytes=-0`, a start past the end) is 416.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import os
import re
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from bridge.shardcast.errors import ShardcastError
from bridge.shardcast.manifest import DeltaEntry
from bridge.shardcast.names import MANIFEST_FILE, check_file_name, parse_version
from bridge.shardcast.store import VersionStore

log = logging.getLogger("shardcast.server")

SEND_CHUNK = 4 << 20
MAX_WAIT = 60.0
MAX_PARTIAL_WAIT = 10.0  # the longest a request for a part still arriving is held
PARTIAL_HEADER = "X-Shardcast-Partial"
EVICT_AFTER_S = 1.0  # a connection may be displaced once it has done nothing useful for this long
LINGER_S = 1.0  # a refused connection's input is dropped for this long after its answer, then it closes
_JSON = "application/json"
_RANGE = re.compile(r"bytes=([0-9]{0,19})-([0-9]{0,19})", re.ASCII | re.IGNORECASE)


@dataclass(frozen=True)
class ServerLimits:
    """What one server grants its clients; the defaults suit a server on the internet."""

    max_connections: int = 1024
    max_per_ip: int = 64
    header_timeout: float = 10.0
    keepalive: float = 15.0
    max_header_bytes: int = 16 << 10


def client_group(ip: str) -> str:
    """The address a connection counts against: the IPv4 address, or the /64 of an IPv6 one (one host
    commonly holds a whole /64)."""
    try:
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
    except ValueError:
        return ip
    if addr.version == 6:
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return str(ipaddress.IPv6Network((addr, 64), strict=False))
    return str(addr)


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(start, count) of a `Range` header on a file of `size` bytes; None without one. ValueError for a
    malformed header or a range that selects no byte (both answered 416)."""
    if header is None:
        return None
    m = _RANGE.fullmatch(header.strip())
    if m is None:
        raise ValueError("expected one range 'bytes=FIRST-[LAST]' or 'bytes=-SUFFIX'")
    first, last = m.groups()
    if not first and not last:
        raise ValueError("a range needs a first byte or a suffix length")
    if not first:  # the last `last` bytes
        suffix = int(last)
        if suffix == 0 or size == 0:
            raise ValueError("the range selects no byte")
        return max(0, size - suffix), min(suffix, size)
    start = int(first)
    stop = size if not last else min(int(last) + 1, size)
    if last and int(last) < start:
        raise ValueError("the range ends before it starts")
    if start >= stop:
        raise ValueError(f"the range starts past the file's {size} bytes")
    return start, stop - start


class _Connection(RequestHandler):
    """aiohttp's connection handler, watched: when the current request head started arriving and how many
    bytes it has taken, and whether a request is being answered (and whether that answer is a long-poll)."""

    def __init__(self, manager: _LimitedServer, **kwargs):
        super().__init__(manager, **kwargs)
        self.limits = manager.limits
        self.group = "?"
        self.last_active = self._loop.time()
        self.head_started: float | None = None
        self.head_bytes = 0  # bytes since the end of the last head
        self._tail = b""  # the last bytes received, up to 3, after the last head's end (a terminator may straddle)
        self.busy = False
        self.long_poll = False
        self.lingering = False  # refused: the answer and a FIN sent, the socket closes after LINGER_S

    def data_received(self, data: bytes) -> None:
        if self.lingering:  # refused: dropped unread until the socket closes
            return
        if data and not self._force_close:
            if not self.busy and self.head_started is None:
                self._head_begins()
            if not self._heads_fit(data):
                if self.busy:  # junk sent while its answer is going out: no room for a status line
                    self.force_close()
                else:
                    self.refuse(431, "Request Header Fields Too Large")
                return
        parsed = self._request_count
        super().data_received(data)
        if self._request_count != parsed:  # a complete head was parsed
            self.head_started = None

    def _heads_fit(self, data: bytes) -> bool:
        """Count `data` into the request heads it belongs to (every head ends with an empty line); False once
        one is longer than `max_header_bytes`, whether or not it is complete."""
        limit = self.limits.max_header_bytes
        view = self._tail + data
        base, consumed, search = len(self._tail), 0, 0
        while (end := view.find(b"\r\n\r\n", search)) >= 0:
            through = end + 4 - base  # bytes of `data` up to the end of this head
            if self.head_bytes + through - consumed > limit:
                return False
            self.head_bytes, consumed, search = 0, through, end + 4
        self.head_bytes += len(data) - consumed
        self._tail = view[max(search, len(view) - 3) :]
        return self.head_bytes <= limit

    def _head_begins(self) -> None:
        self.head_started = started = self._loop.time()
        self._loop.call_at(started + self.limits.header_timeout, self._head_deadline, started)

    def _head_deadline(self, started: float) -> None:
        if self.head_started == started and not self.busy and self.transport is not None:
            self.refuse(408, "Request Timeout")

    def refuse(self, status: int, reason: str) -> None:
        """Answer `status` without parsing further, and close. The answer goes out, then this end of the
        connection (FIN); whatever the client still sends is dropped unread for up to `LINGER_S` before the
        socket closes. Closing at once would close a socket with unread input, which the kernel answers with a
        reset that can destroy the answer before the client reads it (a trickling client lost its 408 that
        way on a loaded machine)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            self.force_close()
            return
        transport.write(f"HTTP/1.1 {status} {reason}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode())
        if not transport.can_write_eof():
            self.force_close()
            return
        transport.write_eof()
        self.lingering = True
        self._loop.call_later(LINGER_S, self.force_close)

    def begin(self, long_poll: bool = False) -> None:
        self.busy, self.long_poll = True, long_poll

    def end(self) -> None:
        self.busy = self.long_poll = False
        self.last_active = self._loop.time()
        if self.head_bytes and self.head_started is None:  # bytes of a pipelined head came meanwhile
            self._head_begins()

    def displaceable(self, now: float) -> tuple[int, float] | None:
        """Sort key among connections that may be closed to make room (idle ones first, oldest first); None
        for one doing useful work (answering a request, or a head that only just started)."""
        if self.transport is None or self.transport.is_closing():
            return None
        if self.lingering:  # its answer is out: the first to go
            return (-1, self.last_active)
        if self.busy:
            return (2, self.last_active) if self.long_poll and now - self.last_active > EVICT_AFTER_S else None
        if self.head_started is not None:
            return (1, self.head_started) if now - self.head_started > EVICT_AFTER_S else None
        return (0, self.last_active) if now - self.last_active > EVICT_AFTER_S else None


class _LimitedServer(web.Server):
    """aiohttp's server with caps on connections, in all and per client address (see the module docstring)."""

    def __init__(self, handler, *, limits: ServerLimits, **kwargs):
        super().__init__(handler, **kwargs)
        self.limits = limits
        self._groups: dict[str, set[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._refused: Counter[str] = Counter()
        self.displaced = 0

    def __call__(self) -> _Connection:
        return _Connection(self, loop=self._loop, **self._kwargs)

    def connection_made(self, handler: _Connection, transport) -> None:
        super().connection_made(handler, transport)
        peer = transport.get_extra_info("peername")
        group = client_group(str(peer[0])) if peer else "?"
        mine = self._groups.get(group, set())
        full = len(mine) >= self.limits.max_per_ip
        if full or len(self._open) >= self.limits.max_connections:
            victim = self._victim(mine if full else self._open)
            if victim is None:
                self._refused[group] += 1
                if self._refused[group] & (self._refused[group] - 1) == 0:  # 1, 2, 4, 8...: bounded logging
                    log.warning(
                        "refused %d connection(s) from %s so far (%d open from it, %d in all)",
                        self._refused[group],
                        group,
                        len(mine),
                        len(self._open),
                    )
                # after aiohttp has started the connection's task (on Python 3.11 a connection lost before it
                # runs makes that task fail with an AssertionError, logged with a traceback)
                self._loop.call_soon(transport.abort)
                return
            self.displaced += 1
            self._forget(victim)
            victim.force_close()
        handler.group = group
        self._groups.setdefault(group, set()).add(handler)
        self._open.add(handler)

    def _victim(self, among: set[_Connection]) -> _Connection | None:
        """The connection to close for a newcomer: among the displaceable ones, one of the fullest address,
        idle before trickling before long-polling, oldest first."""
        now = self._loop.time()
        best, best_key = None, None
        for conn in among:
            rank = conn.displaceable(now)
            if rank is not None:
                key = (-len(self._groups.get(conn.group, ())), *rank)
                if best_key is None or key < best_key:
                    best, best_key = conn, key
        return best

    def _forget(self, handler: _Connection) -> None:
        if handler in self._open:
            self._open.discard(handler)
            mine = self._groups.get(handler.group)
            if mine is not None:
                mine.discard(handler)
                if not mine:
                    del self._groups[handler.group]

    def connection_lost(self, handler, exc=None) -> None:
        self._forget(handler)
        super().connection_lost(handler, exc)


def _error(status: int, message: str, headers: dict | None = None, close: bool = False) -> web.Response:
    resp = web.json_response({"error": message}, status=status, headers=headers)
    if close:
        resp.force_close()
    return resp


class ShardcastServer:
    """Serves a `VersionStore` over HTTP; `start()` binds and returns the base URL (port 0 picks a free one)."""

    def __init__(
        self,
        store: VersionStore,
        *,
        role: str,
        host: str,
        port: int,
        timeout: float = 30.0,
        limits: ServerLimits = ServerLimits(),
        missing: Callable[[int, DeltaEntry], Awaitable[bool]] | None = None,
    ):
        """`missing(version, entry)`: lands a delta file of a complete version that is not on disk (a relay's
        `LazyDeltas`), returning whether it now is; None: such a file is answered 404."""
        self.store, self.role, self.host, self.port = store, role, host, port
        self.missing = missing
        self.timeout, self.limits = timeout, limits
        line = min(8190, limits.max_header_bytes)
        # lingering_time 0: a request body is never read (413 closes the connection instead)
        self._server = _LimitedServer(
            self._handle,
            limits=limits,
            keepalive_timeout=limits.keepalive,
            lingering_time=0,
            max_line_size=line,
            max_field_size=line,
            access_log=None,
        )
        self._runner: web.ServerRunner | None = None
        self.url = ""

    async def start(self) -> str:
        self._runner = web.ServerRunner(self._server, shutdown_timeout=2.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True, backlog=1024)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        conn = request.protocol
        watched = isinstance(conn, _Connection)
        if watched:
            conn.begin(long_poll=request.rel_url.raw_path == "/versions" and "wait" in request.rel_url.query)
        try:
            return await self._route(request)
        finally:
            if watched:
                conn.end()

    async def _route(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.method not in ("GET", "HEAD"):
            return _error(405, f"{request.method} is not served; only GET and HEAD", {"Allow": "GET, HEAD"}, close=True)
        if request.body_exists:
            return _error(413, "GET and HEAD requests carry no body here", close=True)
        parts = request.rel_url.raw_path.split("/")[1:]
        try:
            if parts == ["healthz"]:
                return web.json_response({"ok": True, "role": self.role, "latest": self.store.latest})
            if parts == ["versions"]:
                return await self._versions(request)
            if len(parts) == 3 and parts[0] == "v":
                version = parse_version(parts[1], "version in the URL")
                if parts[2] == MANIFEST_FILE:
                    return self._manifest(request, version)
                return await self._file(request, version, check_file_name(parts[2], "file in the URL"))
        except ShardcastError as e:
            return _error(400, str(e))
        return _error(
            404,
            f"no route {request.rel_url.raw_path[:100]!r}; routes: /versions, /healthz, "
            "/v/{version}/manifest.json, /v/{version}/{file}",
        )

    async def _versions(self, request: web.BaseRequest) -> web.Response:
        query = request.rel_url.query
        after = parse_version(query["after"], "query 'after'") if "after" in query else None
        wait = 0.0
        if "wait" in query:
            try:
                wait = float(query["wait"])
            except ValueError:
                wait = math.nan
            if not 0 <= wait <= MAX_WAIT:
                raise ShardcastError(
                    f"query 'wait': {query['wait'][:20]!r} is not a number of seconds in 0..{MAX_WAIT:g}"
                )
        if wait > 0:
            partial = query.get("partial") == "1"
            await self.store.wait_newer(-1 if after is None else after, wait, partial=partial)
        return web.json_response(self.store.listing())

    def _not_served(self, version: int) -> web.Response:
        arriving = f"; still arriving: {sorted(self.store.arriving)}" if self.store.arriving else ""
        return _error(404, f"version {version} is not served here (serving {sorted(self.store.advertised)}{arriving})")

    def _manifest(self, request: web.BaseRequest, version: int) -> web.Response:
        manifest = self.store.lookup(version)
        if manifest is None:
            arriving = self.store.arriving.get(version)
            if arriving is None or PARTIAL_HEADER not in request.headers:
                return self._not_served(version)
            return web.Response(body=arriving.manifest.raw, content_type=_JSON)
        self.store.touch(version)
        return web.Response(body=manifest.raw, content_type=_JSON)

    async def _file(self, request: web.BaseRequest, version: int, name: str) -> web.StreamResponse:
        manifest = self.store.lookup(version)
        partial = manifest is None
        if partial:
            if version not in self.store.arriving or PARTIAL_HEADER not in request.headers:
                return self._not_served(version)
            manifest = self.store.arriving[version].manifest
        entry = manifest.served.get(name)  # a file of the version or one of its deltas
        if entry is None:
            return _error(404, f"version {version} has no file {name!r}")
        size = entry.size
        try:
            rng = parse_range(request.headers.get("Range"), size)
        except ValueError as e:
            return _error(
                416, f"Range {request.headers.get('Range', '')[:60]!r}: {e}", {"Content-Range": f"bytes */{size}"}
            )
        if rng is None:
            start, count, status = 0, size, 200
        else:
            (start, count), status = rng, 206
        if partial:
            state = await self._await_checked(request, version, name, start, count)
            if isinstance(state, web.Response):
                return state
            if state == "complete":  # it landed meanwhile: served as any complete version
                return await self._file(request, version, name)
        with self.store.pinned(version):
            if (
                not partial
                and isinstance(entry, DeltaEntry)
                and self.missing is not None
                and not (self.store.path(version) / name).exists()
                and not await self.missing(version, entry)
            ):
                return _error(404, f"version {version}: delta file {name!r} is not held here nor upstream")
            try:
                f = self._open(version, name, partial)
            except OSError as e:
                log.error("version %d, file %s: %s", version, name, e)
                return _error(404, f"version {version}, file {name!r}: no longer readable here")
            with f:
                if os.fstat(f.fileno()).st_size != size:
                    log.error("version %d, file %s changed on disk; not serving it", version, name)
                    return _error(500, f"version {version}, file {name!r} changed on the server's disk")
                resp = web.StreamResponse(
                    status=status,
                    headers={
                        "Accept-Ranges": "bytes",
                        "Content-Type": "application/octet-stream",
                        "ETag": f'"{entry.sha256}"',
                    },
                )
                if status == 206:
                    resp.headers["Content-Range"] = f"bytes {start}-{start + count - 1}/{size}"
                resp.content_length = count
                await resp.prepare(request)
                if request.method == "HEAD" or count == 0:
                    await resp.write_eof()
                    return resp
                try:
                    await self._send(request, resp, f, start, count)
                except (ConnectionError, TimeoutError) as e:
                    log.info(
                        "dropped %s during version %d, file %s: %s",
                        request.remote,
                        version,
                        name,
                        e or "no progress for %.0f s" % self.timeout,
                    )
                    if request.transport is not None:
                        request.transport.abort()
                    return resp
                await resp.write_eof()
                return resp

    def _open(self, version: int, name: str, partial: bool):
        """The file of a complete version, or of one still arriving (in the relay's partial directory, or in
        the version directory if it landed a moment ago: the same file, renamed with its directory)."""
        if not partial:
            return open(self.store.path(version) / name, "rb")
        try:
            return open(self.store.partial_path(version) / name, "rb")
        except FileNotFoundError:
            return open(self.store.path(version) / name, "rb")

    async def _await_checked(self, request: web.BaseRequest, version: int, name: str, start: int, count: int):
        """Hold a request on a version still arriving until its bytes are all in checked parts: None when they
        are, "complete" when the version landed meanwhile, else the answer to give (404 dropped, 503 not yet)."""
        text = request.headers.get(PARTIAL_HEADER, "")
        try:
            wait = float(text)
        except ValueError:
            wait = math.nan
        if not 0 <= wait <= MAX_WAIT:
            return _error(400, f"header {PARTIAL_HEADER}: {text[:20]!r} is not a number of seconds in 0..{MAX_WAIT:g}")
        deadline = asyncio.get_running_loop().time() + min(wait, MAX_PARTIAL_WAIT)
        while True:
            if self.store.lookup(version) is not None:
                return "complete"
            arriving = self.store.arriving.get(version)
            if arriving is None:
                return _error(404, f"version {version} is no longer arriving here (its fetch failed)")
            if arriving.checked(name, start, count):
                return None
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return _error(
                    503,
                    f"version {version}, file {name!r}: bytes {start}-{start + count - 1} are not all checked "
                    "here yet; retry",
                    {"Retry-After": "1"},
                )
            await self.store.wait_checked(left)

    async def _send(self, request, resp, f, offset: int, count: int) -> None:
        loop = asyncio.get_running_loop()
        while count:
            n = min(count, SEND_CHUNK)
            if request.transport is None:
                raise ConnectionResetError("client went away")
            await asyncio.wait_for(loop.sendfile(request.transport, f, offset, n), self.timeout)
            offset += n
            count -= n
