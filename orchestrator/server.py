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
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from orchestrator.guards import address_group

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


class LimitedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits of the module docstring; `book` is shared by every
    connection of one server (`protocol_class` makes the subclass that holds it)."""

    book: ConnectionBook

    # -- admission ---------------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self.phase, self.since, self.head_bytes, self.tail = IDLE, self.loop.time(), 0, b""
        self.timer: asyncio.TimerHandle | None = None
        self.closing = False
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
        self._disarm()
        self._leave_book()
        super().connection_lost(exc)

    # -- time-outs ---------------------------------------------------------------------------------------------

    def _arm(self, seconds: float, then: Callable[[], None]) -> None:
        self._disarm()
        self.timer = self.loop.call_later(seconds, then)

    def _disarm(self) -> None:
        if getattr(self, "timer", None) is not None:
            self.timer.cancel()
            self.timer = None

    def _enter(self, phase: str) -> None:
        self.phase, self.since = phase, self.loop.time()
        limits = self.book.limits
        if phase == HEAD:
            self.head_bytes, self.tail = 0, b""
            self._arm(limits.header_timeout_s, self._head_too_slow)
        elif phase == BODY:
            self._arm(limits.body_timeout_s, self._body_too_slow)
        elif phase == IDLE:
            self._arm(limits.keepalive_s, self._idle_too_long)
        else:
            self._disarm()

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
            _answer("408 Request Timeout", f"request body not complete within {self.book.limits.body_timeout_s:g} s\n")
        )

    def _close_with(self, answer: bytes) -> None:
        """Answer (unless a response has started) and close; the request's handler sees a disconnect."""
        if self.closing:
            return
        self.closing = True
        self._disarm()
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
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._enter(APP)
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.phase == APP and not self.pipeline:
            self._enter(IDLE)

    def timeout_keep_alive_handler(self) -> None:  # our idle timer does this
        pass


def protocol_class(limits: Limits) -> tuple[type[LimitedHttpProtocol], ConnectionBook]:
    """A LimitedHttpProtocol subclass sharing one ConnectionBook (give it to uvicorn's `http`), and the book."""
    book = ConnectionBook(limits)
    return type("LimitedHttpProtocol", (LimitedHttpProtocol,), {"book": book}), book


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


def serve(app, host: str, port: int, limits: Limits, log_level: str, trusted_proxies: Iterable[str] = ()) -> None:
    """Run `app` with uvicorn and the limits until SIGINT/SIGTERM."""
    import uvicorn

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
    protocol, _book = protocol_class(limits)
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
    uvicorn.Server(config).run()
