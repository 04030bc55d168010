"""The HTTP side of an origin or a relay (DESIGN section 5), on aiohttp's low-level server.

Routes: `GET /versions[?after=N&wait=S]` (long-poll), `GET /v/{version}/manifest.json`,
`GET /v/{version}/{file}` (`Range` honoured, bytes sent with `sendfile`), `GET /healthz`; HEAD works where
GET does. A URL's segments are matched as raw text against validated versions and against the names in the
version's manifest, so nothing outside a version directory can ever be named.

Bounds against hostile clients: at most `max_connections` connections, `max_per_ip` from one address (more
are closed at once); a connection idle for `timeout` seconds before or between requests is closed; a response
whose client takes more than `timeout` seconds to accept the next `SEND_CHUNK` bytes is aborted (sendfile
keeps nothing in memory meanwhile); long-polls are capped at `MAX_WAIT` seconds.

`test_fault` exists for the tests only: "corrupt" flips one byte in every MiB a file response carries;
"slow:RATE" sends file bytes at RATE bytes/s. Neither is reachable from a recipe, only from the command line.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections import Counter

from aiohttp import web

from bridge.shardcast.errors import ShardcastError
from bridge.shardcast.names import MANIFEST_FILE, check_file_name, parse_version
from bridge.shardcast.store import VersionStore

log = logging.getLogger("shardcast.server")

SEND_CHUNK = 4 << 20
MAX_WAIT = 60.0
FAULT_BLOCK = 1 << 20
_JSON = "application/json"


def parse_test_fault(text: str | None) -> tuple[str, float] | None:
    """`corrupt` or `slow:BYTES_PER_S` -> (kind, rate); None -> None."""
    if text is None:
        return None
    kind, _, rate = text.partition(":")
    if kind == "corrupt" and not rate:
        return ("corrupt", 0.0)
    if kind == "slow":
        try:
            value = float(rate)
        except ValueError:
            value = 0.0
        if value > 0:
            return ("slow", value)
    raise ShardcastError(f"--test-fault {text!r}: expected 'corrupt' or 'slow:BYTES_PER_S'")


class _LimitedServer(web.Server):
    """aiohttp's server with a cap on connections, in all and per client address."""

    def __init__(self, handler, *, max_connections: int, max_per_ip: int, **kwargs):
        super().__init__(handler, **kwargs)
        self.max_connections, self.max_per_ip = max_connections, max_per_ip
        self._addr: dict[object, str] = {}
        self._per_ip: Counter[str] = Counter()
        self._refused: Counter[str] = Counter()

    def connection_made(self, handler, transport) -> None:
        super().connection_made(handler, transport)
        peer = transport.get_extra_info("peername")
        ip = str(peer[0]) if peer else "?"
        if len(self._addr) >= self.max_connections or self._per_ip[ip] >= self.max_per_ip:
            self._refused[ip] += 1
            if self._refused[ip] & (self._refused[ip] - 1) == 0:  # 1, 2, 4, 8...: bounded logging
                log.warning("refused %d connection(s) from %s so far (%d open from it, %d in all)",
                            self._refused[ip], ip, self._per_ip[ip], len(self._addr))
            transport.abort()
            return
        self._addr[handler] = ip
        self._per_ip[ip] += 1

    def connection_lost(self, handler, exc=None) -> None:
        ip = self._addr.pop(handler, None)
        if ip is not None:
            self._per_ip[ip] -= 1
            if not self._per_ip[ip]:
                del self._per_ip[ip]
        super().connection_lost(handler, exc)


def _error(status: int, message: str, headers: dict | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


class ShardcastServer:
    """Serves a `VersionStore` over HTTP; `start()` binds and returns the base URL (port 0 picks a free one)."""

    def __init__(self, store: VersionStore, *, role: str, host: str, port: int, timeout: float = 30.0,
                 max_connections: int = 1024, max_per_ip: int = 64, test_fault: str | None = None):
        self.store, self.role, self.host, self.port = store, role, host, port
        self.timeout = timeout
        self.fault = parse_test_fault(test_fault)
        self._server = _LimitedServer(
            self._handle, max_connections=max_connections, max_per_ip=max_per_ip,
            keepalive_timeout=timeout, access_log=None)
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
        if request.method not in ("GET", "HEAD"):
            return _error(405, f"{request.method} is not served; only GET and HEAD", {"Allow": "GET, HEAD"})
        parts = request.rel_url.raw_path.split("/")[1:]
        try:
            if parts == ["healthz"]:
                return web.json_response({"ok": True, "role": self.role, "latest": self.store.latest})
            if parts == ["versions"]:
                return await self._versions(request)
            if len(parts) == 3 and parts[0] == "v":
                version = parse_version(parts[1], "version in the URL")
                if parts[2] == MANIFEST_FILE:
                    return self._manifest(version)
                return await self._file(request, version, check_file_name(parts[2], "file in the URL"))
        except ShardcastError as e:
            return _error(400, str(e))
        return _error(404, f"no route {request.rel_url.raw_path[:100]!r}; routes: /versions, /healthz, "
                           "/v/{version}/manifest.json, /v/{version}/{file}")

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
                raise ShardcastError(f"query 'wait': {query['wait'][:20]!r} is not a number of seconds "
                                     f"in 0..{MAX_WAIT:g}")
        if wait > 0:
            await self.store.wait_newer(-1 if after is None else after, wait)
        return web.json_response(self.store.listing())

    def _manifest(self, version: int) -> web.Response:
        manifest = self.store.lookup(version)
        if manifest is None:
            return _error(404, f"version {version} is not served here (serving {sorted(self.store.advertised)})")
        self.store.touch(version)
        return web.Response(body=manifest.raw, content_type=_JSON)

    async def _file(self, request: web.BaseRequest, version: int, name: str) -> web.StreamResponse:
        manifest = self.store.lookup(version)
        if manifest is None:
            return _error(404, f"version {version} is not served here (serving {sorted(self.store.advertised)})")
        entry = manifest.by_name.get(name)
        if entry is None:
            return _error(404, f"version {version} has no file {name!r}")
        size = entry.size
        try:
            rng = request.http_range
        except ValueError as e:
            return _error(416, f"Range {request.headers.get('Range', '')[:60]!r}: {e}",
                          {"Content-Range": f"bytes */{size}"})
        if rng.start is None:
            start, count, status = 0, size, 200
        else:
            start = max(0, size + rng.start) if rng.start < 0 else rng.start
            stop = size if rng.stop is None else min(rng.stop, size)
            if start >= stop:
                return _error(416, f"Range {request.headers['Range'][:60]!r} is outside the file's {size} bytes",
                              {"Content-Range": f"bytes */{size}"})
            count, status = stop - start, 206
        with self.store.pinned(version):
            try:
                f = open(self.store.path(version) / name, "rb")
            except OSError as e:
                log.error("version %d, file %s: %s", version, name, e)
                return _error(404, f"version {version}, file {name!r}: no longer readable here")
            with f:
                if os.fstat(f.fileno()).st_size != size:
                    log.error("version %d, file %s changed on disk; not serving it", version, name)
                    return _error(500, f"version {version}, file {name!r} changed on the server's disk")
                resp = web.StreamResponse(status=status, headers={
                    "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream",
                    "ETag": f'"{entry.sha256}"'})
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
                    log.info("dropped %s during version %d, file %s: %s", request.remote, version, name,
                             e or "no progress for %.0f s" % self.timeout)
                    if request.transport is not None:
                        request.transport.abort()
                    return resp
                await resp.write_eof()
                return resp

    async def _send(self, request, resp, f, offset: int, count: int) -> None:
        if self.fault is not None:
            return await self._send_faulty(resp, f, offset, count)
        loop = asyncio.get_running_loop()
        while count:
            n = min(count, SEND_CHUNK)
            if request.transport is None:
                raise ConnectionResetError("client went away")
            await asyncio.wait_for(loop.sendfile(request.transport, f, offset, n), self.timeout)
            offset += n
            count -= n

    async def _send_faulty(self, resp, f, offset: int, count: int) -> None:
        kind, rate = self.fault
        step = max(1, min(FAULT_BLOCK, int(rate / 10))) if kind == "slow" else FAULT_BLOCK
        loop = asyncio.get_running_loop()
        while count:
            n = min(count, step)
            data = bytearray(await loop.run_in_executor(None, os.pread, f.fileno(), n, offset))
            if kind == "corrupt":
                for pos in range(-offset % FAULT_BLOCK, len(data), FAULT_BLOCK):
                    data[pos] ^= 0xFF
            await asyncio.wait_for(resp.write(data), self.timeout)
            if kind == "slow":
                await asyncio.sleep(n / rate)
            offset += n
            count -= n
