"""A small HTTP/1.1 client for the load benchmark: what `AsyncOrchestratorClient` asks of an aiohttp session
(`request(method, url, data=, headers=, timeout=)` as an async context manager whose reply has `status`,
`headers` and `read()`), on asyncio protocols with keep-alive connections and httptools' C parser for replies.

One Python process stands in for a thousand machines in `orchestrator_load.py`, on the same two cores as the
server it measures. aiohttp's client machinery (request and reply objects, cookie jar, tracing, timers) costs
that process about as much CPU per request as the server spends answering it, and every millisecond it spends
delays the replies it is timing. This client builds the request head and reads the reply, nothing more: the
requests are the ones `AsyncOrchestratorClient` signs (same target, body and signature headers), with `Host`
and `Content-Length` added as aiohttp adds them.

Failures raise aiohttp's exception types (`ClientConnectionError`, `ServerDisconnectedError`,
`ClientPayloadError`) and `asyncio.TimeoutError`, which the client and the benchmark already count.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

import aiohttp
import httptools
import yarl


class Headers(dict):
    """Reply headers by lower-case name; `get` takes any case."""

    def get(self, name: str, default=None):
        return super().get(name.lower(), default)


class Reply:
    def __init__(self, status: int, headers: Headers, body: bytes):
        self.status, self.headers, self._body = status, headers, body

    async def read(self) -> bytes:
        return self._body


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self, pool: LightSession, key: tuple[str, int]):
        self.pool, self.key = pool, key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future | None = None
        self.closed = False
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.headers, self.chunks = Headers(), []

    # asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(aiohttp.ClientPayloadError(f"malformed reply: {exc}"))
            self.transport.close()

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.pool._all.discard(self)
        self._fail(aiohttp.ServerDisconnectedError())

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        reply = Reply(self.parser.get_status_code(), self.headers, b"".join(self.chunks))
        keep = self.parser.should_keep_alive()
        self._reset()
        waiter, self.waiter = self.waiter, None
        if keep and not self.closed:
            self.pool._release(self)
        else:
            self.transport.close()
        if waiter is not None and not waiter.done():
            waiter.set_result(reply)

    def _fail(self, exc: Exception) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def send(self, head: bytes, body: bytes) -> asyncio.Future:
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.writelines((head, body))
        return self.waiter


class _RequestContext:
    def __init__(self, session: LightSession, *request):
        self.session, self.request = session, request

    async def __aenter__(self) -> Reply:
        return await self.session._request(*self.request)

    async def __aexit__(self, *exc: object) -> None:
        return None


class LightSession:
    """Keep-alive connections from `local_addr` (a source address, or None), reused across the clients that
    share the session; `request()` as aiohttp.ClientSession's, for what the orchestrator clients send.

    A connection idle for `keepalive_s` is closed rather than reused, as aiohttp does (15 s): one the server is
    closing for idleness (its `keepalive_s`, 20 s) just as a request goes out would lose that request."""

    def __init__(self, local_addr: str | None = None, timeout_s: float = 30.0, keepalive_s: float = 15.0):
        self.local_addr = local_addr
        self.timeout_s = timeout_s
        self.keepalive_s = keepalive_s
        self._idle: dict[tuple[str, int], deque[_Connection]] = {}
        self._all: set[_Connection] = set()

    def request(self, method: str, url, data: bytes = b"", headers: dict | None = None, timeout=None):
        return _RequestContext(self, method, url, data, headers or {}, timeout)

    def get(self, url, headers: dict | None = None, timeout=None):
        return _RequestContext(self, "GET", url, b"", headers or {}, timeout)

    async def _connection(self, key: tuple[str, int]) -> _Connection:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            if conn.closed:
                continue
            if time.monotonic() - conn.idle_since < self.keepalive_s:
                return conn
            conn.transport.close()
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(
                lambda: _Connection(self, key),
                key[0],
                key[1],
                local_addr=(self.local_addr, 0) if self.local_addr else None,
            )
        except OSError as exc:
            raise aiohttp.ClientConnectionError(f"cannot connect to {key[0]}:{key[1]}: {exc}") from exc
        self._all.add(conn)
        return conn

    def _release(self, conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.key, deque()).append(conn)

    async def _request(self, method: str, url, data, headers: dict, timeout) -> Reply:
        url = url if isinstance(url, yarl.URL) else yarl.URL(url)
        body = bytes(data or b"")
        key = (url.host, url.port)
        lines = [f"{method} {url.raw_path_qs} HTTP/1.1", f"Host: {url.host}:{url.port}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        if body or method not in ("GET", "HEAD"):
            lines.append(f"Content-Length: {len(body)}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        seconds = getattr(timeout, "total", None) or self.timeout_s
        conn = await self._connection(key)
        try:
            async with asyncio.timeout(seconds):
                return await conn.send(head, body)
        except BaseException:
            # a reply that is late or never comes: the connection's state is unknown, so it is not reused
            if conn.transport is not None:
                conn.transport.close()
            raise

    async def close(self) -> None:
        for conn in self._all:
            if conn.transport is not None:
                conn.transport.close()
        self._all.clear()
        self._idle.clear()
        await asyncio.sleep(0)
