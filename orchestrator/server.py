"""Serving the orchestrator on the internet: uvicorn (httptools, uvloop) with the connection limits it lacks.

uvicorn offers `limit_concurrency` (a 503 once that many connections or tasks exist, whoever holds them),
`timeout_keep_alive` (idle time between requests only: a connection that never sends a byte is kept forever)
and, for its h11 parser alone, `h11_max_incomplete_event_size`; nothing bounds the time a request head or body
may take, or what one address may hold (measured before this module: 300 idle sockets held, a 64 MiB header
parsed in 13.9 s of CPU, connections trickling a head still open after 100 s). `LimitedHttpProtocol` adds, per
connection, on top of uvicorn's httptools protocol:

- a request head is at most `max_header_bytes` (request line and headers), counted as the bytes arrive and
  before the parser buffers them: a larger one gets 431 and the connection is closed;
- a request head must be complete within `header_timeout_s` of its first byte, a body within `body_timeout_s`
  of its head: else 408 and the connection is closed;
- a connection with no request in progress (before the first, between requests) is closed after
  `keepalive_s`;
- at most `max_connections` connections in all and `max_connections_per_ip` from one address (IPv6: one /64;
  addresses in `exempt`, the trusted proxies, only count in the total). A newcomer over either limit displaces
  the connection of that address (or, for the total, of any address) that has been idle the longest, else the
  one whose request head has been arriving the longest if that is over `stall_s`; if every connection is busy
  with a request the newcomer gets 503 with Retry-After and is closed. So idle or trickling connections cannot
  lock an address's neighbours (other clients behind the same NAT) out: what they hold is taken back as soon
  as someone needs it, and busy connections end within the time-outs.

Connections are accepted by `Listener`, up to `ACCEPT_BATCH` each time the listening socket is readable, not one
per turn of the event loop as uvloop's own server does.

It also answers the nodes' hot routes (fast_lane.NODE_ROUTES) itself, from the application's `NodeLane`: a
signed POST with a Content-Length body is checked and answered straight from the parser's callbacks, and its
reply written to the socket, without the ASGI request, task and messages that uvicorn would build for it (at
1,000 nodes those cost a fifth of the server's CPU). The checks and replies are the lane's, the same as in front
of FastAPI; a reply that follows a commit still waits for the commit to be durable. Whatever the lane does not
take (another route, a query string, an escaped path, a chunked body, `Expect: 100-continue`, a body FastAPI
must word an error for, a request pipelined behind one still being answered) goes through uvicorn and the ASGI
application as it arrived.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import resource
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from orchestrator.fast_lane import INTERNAL_ERROR
from orchestrator.guards import address_group

if TYPE_CHECKING:
    from orchestrator.fast_lane import Found, NodeLane, Reply

GC_YOUNG_THRESHOLD = 20_000
log = logging.getLogger("orchestrator")

IDLE, HEAD, BODY, APP = "idle", "head", "body", "app"  # where a connection is: between requests, or in one


@dataclass(frozen=True)
class Limits:
    max_connections: int = 4096
    max_connections_per_ip: int = 64
    max_header_bytes: int = 16 << 10
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keepalive_s: float = 20.0
    stall_s: float = 1.0  # a request head still arriving after this long may be displaced by a newcomer
    exempt: frozenset[str] = frozenset()  # address groups with no per-address limit (trusted proxies)
    upload_timeout_s: float = 120.0  # the body of an upload (PUT /v1/uploads/...) has this long, not body_timeout_s


@dataclass
class ConnectionBook:
    """Every open connection, and by address group."""

    limits: Limits
    all: set = field(default_factory=set)
    by_address: dict[str, set] = field(default_factory=dict)
    refused: int = 0
    displaced: int = 0


def _answer(status: str, text: str, retry_after: int | None = None) -> bytes:
    body = text.encode()
    extra = f"retry-after: {retry_after}\r\n" if retry_after is not None else ""
    return (
        f"HTTP/1.1 {status}\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: {len(body)}\r\n"
        f"{extra}connection: close\r\n\r\n"
    ).encode() + body


def _pick_victim(connections: Iterable[LimitedHttpProtocol], now: float, stall_s: float) -> LimitedHttpProtocol | None:
    """The connection to displace: the one idle longest, else the one whose head has been arriving longest if
    over `stall_s`; None if every one is busy with a request."""
    idle = stalled = None
    for conn in connections:
        if conn.phase == IDLE:
            if idle is None or conn.since < idle.since:
                idle = conn
        elif conn.phase == HEAD and now - conn.since > stall_s and (stalled is None or conn.since < stalled.since):
            stalled = conn
    return idle or stalled


class _NoEvent:
    def set(self) -> None:
        pass


class _DirectCycle:
    """Where uvicorn keeps its RequestResponseCycle, the state of a reply of the direct lane: until it is
    complete, a request pipelined behind it waits in uvicorn's queue, and a connection lost or closed meanwhile
    is noted (`disconnected`) so that nothing is written to it."""

    message_event = _NoEvent()

    def __init__(self, keep_alive: bool):
        self.keep_alive = keep_alive
        self.response_started = self.response_complete = self.disconnected = False


class LimitedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits and the direct lane of the module docstring; `book` is
    shared by every connection of one server and `lane` is the application's (`protocol_class` makes the
    subclass that holds them)."""

    book: ConnectionBook
    lane: NodeLane | None = None

    # -- admission ---------------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self.phase, self.since, self.head_bytes, self.tail = IDLE, self.loop.time(), 0, b""
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = self.deadline = 0.0
        self.then: Callable[[], None] | None = None
        self.closing = False
        self.direct: Found | None = None  # the request being read is the direct lane's
        self.direct_head: tuple[bytes, dict[bytes, bytes], bool] = (b"", {}, False)
        self.direct_body: list[bytes] = []
        book, limits = self.book, self.book.limits
        self.group = address_group(self.client[0]) if self.client else ""
        mine = book.by_address.setdefault(self.group, set())
        now = self.loop.time()
        if self.group not in limits.exempt and len(mine) >= limits.max_connections_per_ip:
            if not self._displace(mine, now, "this address holds orchestrator.max_connections_per_ip connections"):
                return
        if len(book.all) >= limits.max_connections:
            if not self._displace(book.all, now, "the service holds orchestrator.max_connections connections"):
                return
        book.all.add(self)
        mine.add(self)
        self._arm(limits.keepalive_s, self._idle_too_long)

    def _displace(self, among: set, now: float, why: str) -> bool:
        victim = _pick_victim(among, now, self.book.limits.stall_s)
        if victim is None:
            self.book.refused += 1
            self._close_with(_answer("503 Service Unavailable", f"too many connections: {why}\n", retry_after=1))
            return False
        self.book.displaced += 1
        victim._close_with(
            b"" if victim.phase == IDLE else _answer("408 Request Timeout", "request head too slow; displaced\n")
        )
        return True

    def _leave_book(self) -> None:
        self.book.all.discard(self)
        mine = self.book.by_address.get(getattr(self, "group", ""))
        if mine is not None:
            mine.discard(self)
            if not mine:
                del self.book.by_address[self.group]

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm(cancel=True)
        self._leave_book()
        super().connection_lost(exc)

    # -- time-outs ---------------------------------------------------------------------------------------------

    def _arm(self, seconds: float, then: Callable[[], None]) -> None:
        """Call `then` in `seconds` unless re-armed or disarmed first. One timer per connection, moved only when
        the new deadline is earlier than it: a request would otherwise cancel and make four timers."""
        self.deadline, self.then = self.loop.time() + seconds, then
        if self.timer is not None and self.timer_at <= self.deadline:
            return  # it fires first and looks again
        if self.timer is not None:
            self.timer.cancel()
        self.timer, self.timer_at = self.loop.call_at(self.deadline, self._deadline_reached), self.deadline

    def _deadline_reached(self) -> None:
        self.timer = None
        if self.then is None:
            return
        if self.loop.time() < self.deadline:  # re-armed later meanwhile
            self.timer, self.timer_at = self.loop.call_at(self.deadline, self._deadline_reached), self.deadline
            return
        then, self.then = self.then, None
        then()

    def _disarm(self, cancel: bool = False) -> None:
        """No deadline now; `cancel`: drop the timer too (the connection is going away)."""
        self.then = None
        if cancel and getattr(self, "timer", None) is not None:
            self.timer.cancel()
            self.timer = None

    def _enter(self, phase: str) -> None:
        self.phase, self.since = phase, self.loop.time()
        limits = self.book.limits
        if phase == HEAD:
            self.head_bytes, self.tail = 0, b""
            self._arm(limits.header_timeout_s, self._head_too_slow)
        elif phase == BODY:
            self._arm(self._body_timeout(), self._body_too_slow)
        elif phase == IDLE:
            self._arm(limits.keepalive_s, self._idle_too_long)
        else:
            self._disarm()

    def _body_timeout(self) -> float:
        """An upload's body (the ingest bounds it itself, from its admission) may take upload_timeout_s (plus a
        margin for the admission), any other body_timeout_s."""
        limits = self.book.limits
        if self.parser.get_method() == b"PUT" and self.url.startswith(b"/v1/uploads/"):
            return limits.upload_timeout_s + limits.header_timeout_s
        return limits.body_timeout_s

    def _idle_too_long(self) -> None:
        self._close_with(b"")

    def _head_too_slow(self) -> None:
        self._close_with(
            _answer(
                "408 Request Timeout", f"request head not complete within {self.book.limits.header_timeout_s:g} s\n"
            )
        )

    def _body_too_slow(self) -> None:
        self._close_with(
            _answer("408 Request Timeout", f"request body not complete within {self._body_timeout():g} s\n")
        )

    def _close_with(self, answer: bytes) -> None:
        """Answer (unless a response has started) and close; the request's handler sees a disconnect."""
        if self.closing:
            return
        self.closing = True
        self._disarm(cancel=True)
        self._leave_book()  # its place is free now, not once the transport has closed
        current = self.cycle
        if answer and (current is None or current.response_complete or not current.response_started):
            self.transport.write(answer)
        if current is not None and not current.response_complete:
            current.disconnected = True
            current.message_event.set()
        self.transport.close()

    # -- bytes and parser events -------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        if self.phase == IDLE:
            self._enter(HEAD)
        if self.phase != BODY:  # a head, or the next pipelined request's: counted before the parser holds it
            window = self.tail + data
            end = min((i for i in (window.find(b"\r\n\r\n"), window.find(b"\n\n")) if i >= 0), default=-1)
            counted = len(data) if end < 0 else max(0, end + 4 - len(self.tail))
            self.head_bytes += counted
            if self.head_bytes > self.book.limits.max_header_bytes:
                self._close_with(
                    _answer(
                        "431 Request Header Fields Too Large",
                        f"request head over {self.book.limits.max_header_bytes} bytes (orchestrator.max_header_kib)\n",
                    )
                )
                return
            self.tail = window[-3:] if end < 0 else b""
            if end >= 0:
                self.head_bytes = 0
        super().data_received(data)

    def on_message_begin(self) -> None:
        if self.phase not in (HEAD, BODY):
            self._enter(HEAD)
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._enter(BODY)
        self.direct = self._direct_route() if self.lane is not None else None
        if self.direct is None:
            super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if self.direct is not None:
            self.direct_body.append(body)  # at most the lane's body limit: the head's Content-Length said so
            return
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._enter(APP)
        found, self.direct = self.direct, None
        if found is None:
            return super().on_message_complete()
        body, self.direct_body = b"".join(self.direct_body), []
        target, headers, keep_alive = self.direct_head
        request = self.lane.decode(found, headers, body)
        if request is None:  # FastAPI words this answer: the request goes the ASGI way, as it arrived
            super().on_headers_complete()
            if body:
                super().on_body(body)
            return super().on_message_complete()
        start = time.perf_counter()
        cycle = self.cycle = _DirectCycle(keep_alive)
        reply, committed = self.lane.answer(found, request, "POST", target, headers, body)
        wal = self.lane.svc.wal
        if not committed or wal is None:
            return self._reply_directly(cycle, found, reply, start)

        def durable(error: BaseException | None) -> None:
            if error is not None:
                log.error("POST %s: the commit could not be made durable: %r", found.spec.path, error)
            self._reply_directly(cycle, found, reply if error is None else INTERNAL_ERROR, start)

        wal.when_durable(durable)

    # -- the direct lane ---------------------------------------------------------------------------------------

    def _direct_route(self) -> Found | None:
        """The lane's route for the request whose head just ended, if the direct lane takes it."""
        parser = self.parser
        if (
            self.expect_100_continue
            or self.flow.write_paused
            or self.root_path
            or (self.cycle is not None and not self.cycle.response_complete)  # pipelined behind a reply
            or parser.get_method() != b"POST"
            or parser.should_upgrade()
        ):
            return None
        try:
            url = httptools.parse_url(self.url)
            path = url.path.decode("ascii")
        except (httptools.HttpParserInvalidURLError, UnicodeDecodeError):
            return None
        if url.query or "%" in path:
            return None
        found = self.lane.match(path)
        if found is None:
            return None
        headers = dict(reversed(self.headers))  # a repeated header: the first counts, as in Starlette
        if not self.lane.accepts(headers):
            return None
        keep_alive = parser.get_http_version() != "1.0" and parser.should_keep_alive()
        self.direct_head, self.direct_body = (url.path, headers, keep_alive), []
        return found

    def _reply_directly(self, cycle: _DirectCycle, found: Found, reply: Reply, start: float) -> None:
        """Write `reply` as uvicorn would (its default headers first), then go on as after an ASGI response."""
        self.lane.observe(found, reply.status, time.perf_counter() - start)
        if cycle.disconnected or self.transport.is_closing():
            cycle.response_complete = True
            return
        out = [STATUS_LINE[reply.status]]
        for name, value in (*self.server_state.default_headers, *reply.headers):
            out += (name, b": ", value, b"\r\n")
        if not cycle.keep_alive:
            out.append(b"connection: close\r\n")
        out += (b"\r\n", reply.body)
        self.transport.write(b"".join(out))
        cycle.response_started = cycle.response_complete = True
        if not cycle.keep_alive:
            self.transport.close()
        self.on_response_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.phase == APP and not self.pipeline:
            self._enter(IDLE)

    def timeout_keep_alive_handler(self) -> None:  # our idle timer does this
        pass


def protocol_class(limits: Limits, lane: NodeLane | None = None) -> tuple[type[LimitedHttpProtocol], ConnectionBook]:
    """A LimitedHttpProtocol subclass sharing one ConnectionBook and answering `lane`'s routes directly (give it
    to uvicorn's `http`), and the book."""
    book = ConnectionBook(limits)
    return type("LimitedHttpProtocol", (LimitedHttpProtocol,), {"book": book, "lane": lane}), book


def raise_open_files_limit(wanted: int) -> int:
    """Raise the soft limit of open files to `wanted` if the hard limit allows; returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


ACCEPT_BATCH = 128  # connections accepted each time a listening socket is readable


class Listener:
    """The listening sockets for `host`:`port` (one per address it resolves to, as asyncio's `create_server`
    binds them), accepted from in batches.

    uvloop's server (libuv since 1.45) accepts one connection per turn of the event loop. A turn of a busy
    service handles every socket that is ready and takes tens of milliseconds, so connections that arrive faster
    than the turns come wait in the kernel's queue, honest ones behind a stream of reconnecting attackers, and
    their requests wait with them where no latency figure of the service sees them. Here, each time a listening
    socket is readable up to `batch` connections are accepted and handed to the loop (`connect_accepted_socket`,
    what uvloop's server does with each), so the limits decide about every newcomer at once; `batch` bounds the
    time one turn spends on a flood."""

    def __init__(self, host: str | None, port: int, backlog: int, batch: int = ACCEPT_BATCH):
        self.batch = batch
        self.sockets: list[socket.socket] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._factory: Callable[[], asyncio.Protocol] | None = None
        self._closed = False
        try:
            for family, kind, proto, _, address in socket.getaddrinfo(
                host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            ):
                sock = socket.socket(family, kind, proto)
                self.sockets.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
                sock.listen(backlog)
                sock.setblocking(False)
        except OSError:
            self.close()
            raise

    def start(self, loop: asyncio.AbstractEventLoop, protocol_factory: Callable[[], asyncio.Protocol]) -> None:
        self._loop, self._factory = loop, protocol_factory
        for sock in self.sockets:
            loop.add_reader(sock.fileno(), self._accept, sock)

    def _accept(self, listening: socket.socket) -> None:
        for _ in range(self.batch):
            try:
                sock, _address = listening.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:  # gone before it was accepted
                continue
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    raise
                # out of descriptors or memory: stop accepting for a second, as asyncio's server does
                log.warning("cannot accept connections for now (%s): trying again in 1 s", exc.strerror)
                self._loop.remove_reader(listening.fileno())
                self._loop.call_later(1.0, self._resume, listening)
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._loop.create_task(self._connect(sock))

    def _resume(self, listening: socket.socket) -> None:
        if not self._closed:
            self._loop.add_reader(listening.fileno(), self._accept, listening)

    async def _connect(self, sock: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._factory, sock)
        except OSError as exc:  # reset before its transport was made
            log.debug("an accepted connection was lost before it could be served: %r", exc)
            sock.close()

    def close(self) -> None:
        """Stop accepting and close the listening sockets (uvicorn's shutdown calls this, then `wait_closed`)."""
        if self._closed:
            return
        self._closed = True
        for sock in self.sockets:
            if self._loop is not None:
                self._loop.remove_reader(sock.fileno())
            sock.close()

    async def wait_closed(self) -> None:
        """Nothing to wait for: `close` closed the sockets."""


class _Server(uvicorn.Server):
    """uvicorn's server, accepting from a `Listener` instead of the loop's own server."""

    def __init__(self, config: uvicorn.Config, listener: Listener):
        super().__init__(config)
        self.listener = listener

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=[])  # the application's startup, and no server of the loop's own
        config = self.config

        def create_protocol() -> asyncio.Protocol:
            return config.http_protocol_class(
                config=config, server_state=self.server_state, app_state=self.lifespan.state
            )

        # Everything made so far (modules, the application, its caches) lives as long as the service: full
        # collections need not look at it again, which cuts the pause each of them makes by more than half.
        gc.collect()
        gc.freeze()
        # Young collections after 20,000 new objects rather than 700: what a request or a connection's turn makes
        # is freed by reference counting long before that, so it is not promoted and walked again by the older
        # generations' collections (benchmarks/RESULTS.md).
        gc.set_threshold(GC_YOUNG_THRESHOLD, 10, 10)
        self.listener.start(asyncio.get_running_loop(), create_protocol)
        self.servers = [self.listener]
        host, port = self.listener.sockets[0].getsockname()[:2]
        log.info("serving on http://%s:%d", f"[{host}]" if ":" in host else host, port)


def serve(app, host: str, port: int, limits: Limits, log_level: str, trusted_proxies: Iterable[str] = ()) -> None:
    """Run `app` with uvicorn and the limits until SIGINT/SIGTERM."""
    from orchestrator.guards import bound_log_lines

    files = raise_open_files_limit(limits.max_connections + 256)
    if files < limits.max_connections + 64:
        log.warning(
            "open files limited to %d: orchestrator.max_connections lowered from %d to %d",
            files,
            limits.max_connections,
            max(64, files - 64),
        )
        limits = Limits(**{**limits.__dict__, "max_connections": max(64, files - 64)})
    protocol, _book = protocol_class(limits, getattr(app, "node_lane", None))
    proxies = list(trusted_proxies)
    # No X-Forwarded-For handling unless the operator names the proxies whose header is to be believed.
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol,
        log_level=log_level,
        access_log=False,
        proxy_headers=bool(proxies),
        forwarded_allow_ips=proxies or None,
        timeout_keep_alive=max(1, round(limits.keepalive_s)),
        timeout_graceful_shutdown=10,
    )
    bound_log_lines()  # uvicorn's handlers exist now (Config configured logging)
    try:
        listener = Listener(host, port, config.backlog)
    except OSError as exc:
        raise SystemExit(f"cannot listen on {host}:{port}: {exc}") from exc
    _Server(config, listener).run()
