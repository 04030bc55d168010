"""HTTP/1.1 GET over a plain socket, with the body spliced straight into a file.

The client side of SHARDCAST moves bytes with `os.splice` (socket -> pipe -> file, one copy in the kernel,
the GIL released) where the platform has it, and with `recv_into` + `pwrite` elsewhere. Every wait is
bounded: a server that does not connect, answer, or deliver at least `STALL_BYTES` within `timeout` seconds
is given up with a `TransferError` naming it, and bodies are length-checked (`Content-Length` required,
size limits for JSON), so a hostile or broken server costs a time-out, never a hang or unbounded memory.

Connections are kept alive: a response whose body was read to its last byte gives its socket back to a small
per-server pool (at most `IDLE_PER_SERVER` sockets, each reused within `IDLE_S` seconds), and the next request
to that server takes it instead of opening a new one. Over a WAN that saves the TCP handshake (a round trip)
per request: the manifest and the files follow a long-poll on the long-poll's connection. A pooled socket
that the server has closed meanwhile is noticed before or as it is reused, and the request is sent again on a
new connection (every request here is an idempotent GET). A response gives its socket back at most once
(closing it again does nothing), one that broke off or was not read to its end closes it instead, and the
pool refuses a socket it already holds: two requests never share a connection.
"""

from __future__ import annotations

import fcntl
import http.client
import io
import json
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from bridge.shardcast.errors import NotFound, ShardcastError, TransferError
from bridge.shardcast.names import ServerURL

HEAD_LIMIT = 64 << 10
STALL_BYTES = 1 << 20  # a transfer must move this much per `timeout` seconds, or it is stalled
PIPE_BYTES = 1 << 20
IDLE_S = 10.0  # a kept-alive socket idle for longer is closed, not reused (servers close theirs after 15 s)
IDLE_PER_SERVER = 8
HAVE_SPLICE = hasattr(os, "splice")
_F_SETPIPE_SZ = 1031


@dataclass
class Response:
    server: ServerURL
    status: int
    headers: http.client.HTTPMessage
    sock: socket.socket
    leftover: bytes  # body bytes that arrived with the head
    keep_alive: bool = False  # the server keeps the connection open after this answer
    received: int = 0  # body bytes consumed (from `leftover`, then from the socket)
    closed: bool = False  # `close` has handed the socket on: to the pool, or closed it

    def close(self) -> None:
        """Done with the answer: its socket goes back to the pool if its body was read exactly to its end and
        the server keeps the connection, and is closed otherwise (its state is unknown: part of the body may
        still be on the wire). Only the first call does anything: once pooled, the socket may already carry
        another thread's request, and giving it back again would lend it to two requests at once."""
        if self.closed:
            return
        self.closed = True
        length = self.headers.get("Content-Length", "")
        whole = length.isdigit() and self.received == int(length) and len(self.leftover) <= self.received
        if self.keep_alive and whole:
            _IDLE.give(self.server, self.sock)
        else:
            self.sock.close()

    def content_length(self) -> int:
        value = self.headers.get("Content-Length", "")
        if not value.isdigit():
            raise TransferError(self.server, f"answer without a valid Content-Length ({value!r})")
        return int(value)


class _IdleSockets:
    """Kept-alive sockets by server, newest last."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, int], list[tuple[socket.socket, float]]] = {}

    def take(self, server: ServerURL) -> socket.socket | None:
        """A pooled socket to `server` that is still open and quiet, or None."""
        now = time.monotonic()
        while True:
            with self._lock:
                held = self._idle.get((server.host, server.port))
                if not held:
                    return None
                sock, since = held.pop()
            if now - since < IDLE_S and _quiet(sock):
                return sock
            sock.close()

    def give(self, server: ServerURL, sock: socket.socket) -> None:
        """Keep `sock` for the next request to `server`; one already held (a second give of the same answer)
        or already closed is refused, so that no two takes return the same socket."""
        if sock.fileno() < 0:
            return
        with self._lock:
            held = self._idle.setdefault((server.host, server.port), [])
            if any(s is sock for s, _ in held):
                return
            held.append((sock, time.monotonic()))
            extra = held[:-IDLE_PER_SERVER]
            del held[:-IDLE_PER_SERVER]
        for old, _ in extra:
            old.close()

    def clear(self) -> None:
        with self._lock:
            held = [s for pairs in self._idle.values() for s, _ in pairs]
            self._idle.clear()
        for sock in held:
            sock.close()


def _quiet(sock: socket.socket) -> bool:
    """Whether an idle socket is still usable: open, and nothing to read (a closed connection reads as EOF)."""
    if sock.fileno() < 0:
        return False
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLPRI)
    return not poller.poll(0)


_IDLE = _IdleSockets()


def close_idle() -> None:
    """Close every kept-alive socket (tests start from an empty pool with it)."""
    _IDLE.clear()


def open_get(
    server: ServerURL,
    path: str,
    *,
    timeout: float,
    headers: dict[str, str] | None = None,
    wait: float = 0.0,
    on_open: Callable[[socket.socket], None] | None = None,
) -> Response:
    """Send `GET path` and read the response head; `wait` extends the head's deadline (long-polls). A kept-alive
    socket to `server` is used if the pool holds one (and the request sent again on a new one if the server
    had closed it)."""
    sock = _IDLE.take(server)
    if sock is not None:
        try:
            return _request(server, sock, path, timeout, headers, wait, on_open)
        except _Stale:
            pass
    try:
        sock = socket.create_connection((server.host, server.port), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError as e:
        raise TransferError(server, f"cannot connect ({e})") from e
    try:
        return _request(server, sock, path, timeout, headers, wait, on_open)
    except _Stale as e:
        raise TransferError(server, str(e.__cause__ or "connection closed before a response head")) from None


class _Stale(Exception):
    """A connection that failed before any byte of an answer came back (a reused one: send it again)."""


def _request(server, sock, path, timeout, headers, wait, on_open) -> Response:
    buf = bytearray()
    try:
        if on_open is not None:
            on_open(sock)
        lines = [
            f"GET {server.path(path)} HTTP/1.1",
            f"Host: {server.host}:{server.port}",
            "User-Agent: intellect-shardcast",
        ]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        sock.settimeout(timeout)
        try:
            sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        except OSError as e:
            raise _Stale() from e
        deadline = time.monotonic() + timeout + wait
        while (end := buf.find(b"\r\n\r\n")) < 0:
            if len(buf) > HEAD_LIMIT:
                raise TransferError(server, f"response head longer than {HEAD_LIMIT} bytes")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferError(server, f"no complete response head within {timeout + wait:.0f} s (stalled)")
            sock.settimeout(left)
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue  # the deadline check above reports it
            except ConnectionError as e:
                if not buf:
                    raise _Stale() from e
                raise
            if not chunk:
                if not buf:
                    raise _Stale()
                raise TransferError(server, "connection closed before a response head")
            buf += chunk
        sock.settimeout(timeout)
        status_line, _, header_block = bytes(buf[:end]).partition(b"\r\n")
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise TransferError(server, f"not an HTTP/1.x response: {status_line[:80]!r}")
        message = http.client.parse_headers(io.BytesIO(header_block + b"\r\n\r\n"))
        keep = parts[0] == b"HTTP/1.1" and "close" not in message.get("Connection", "").lower()
        return Response(server, int(parts[1]), message, sock, bytes(buf[end + 4 :]), keep_alive=keep)
    except (TransferError, _Stale):
        sock.close()
        raise
    except (OSError, http.client.HTTPException) as e:
        sock.close()
        raise TransferError(server, f"request for {path} failed ({e})") from e


def read_body(resp: Response, limit: int, timeout: float) -> bytes:
    """The whole body of a small answer, refused without reading when it claims more than `limit` bytes."""
    length = resp.content_length()
    if length > limit:
        raise TransferError(resp.server, f"answer of {length} bytes is larger than the limit of {limit}")
    body = bytearray(resp.leftover[:length])
    deadline = time.monotonic() + timeout
    try:
        while len(body) < length:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferError(resp.server, f"body not received within {timeout:.0f} s (stalled)")
            resp.sock.settimeout(left)
            try:
                chunk = resp.sock.recv(min(1 << 20, length - len(body)))
            except TimeoutError:
                continue
            if not chunk:
                raise TransferError(resp.server, f"connection closed after {len(body)} of {length} body bytes")
            body += chunk
    except OSError as e:
        raise TransferError(resp.server, f"reading the answer failed ({e})") from e
    resp.received = length
    return bytes(body)


def _error_text(resp: Response, timeout: float) -> str:
    try:
        body = read_body(resp, 4096, min(timeout, 5.0))
        return json.loads(body).get("error", "")[:300]
    except (ShardcastError, ValueError, AttributeError):
        return ""


def check_status(resp: Response, path: str, expected: tuple[int, ...], timeout: float) -> None:
    """Raise NotFound (404) or TransferError (anything else unexpected), with the server's error text. The
    answer is closed first (its connection pooled if the error body was read whole); the caller's own
    `resp.close()` after that does nothing."""
    if resp.status in expected:
        return
    detail = _error_text(resp, timeout)
    resp.close()
    cls = NotFound if resp.status == 404 else TransferError
    raise cls(resp.server, f"GET {path}: HTTP {resp.status}" + (f": {detail}" if detail else ""), resp.status)


def get_bytes(
    server: ServerURL,
    path: str,
    *,
    timeout: float,
    limit: int,
    wait: float = 0.0,
    on_open: Callable[[socket.socket], None] | None = None,
    headers: dict[str, str] | None = None,
) -> bytes:
    resp = open_get(server, path, timeout=timeout, headers=headers, wait=wait, on_open=on_open)
    try:
        check_status(resp, path, (200,), timeout)
        return read_body(resp, limit, timeout)
    finally:
        resp.close()


def get_json(
    server: ServerURL,
    path: str,
    *,
    timeout: float,
    limit: int,
    wait: float = 0.0,
    on_open: Callable[[socket.socket], None] | None = None,
):
    body = get_bytes(server, path, timeout=timeout, limit=limit, wait=wait, on_open=on_open)
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TransferError(server, f"GET {path}: malformed JSON ({e})") from e


class _Stall:
    """`STALL_BYTES` per `timeout` seconds, or the transfer has stalled."""

    def __init__(self, server: ServerURL, timeout: float):
        self.server, self.timeout = server, timeout
        self.start, self.moved = time.monotonic(), 0

    def add(self, n: int) -> None:
        self.moved += n
        if self.moved >= STALL_BYTES:
            self.start, self.moved = time.monotonic(), 0

    def left(self) -> float:
        left = self.start + self.timeout - time.monotonic()
        if left <= 0:
            raise TransferError(self.server, f"fewer than {STALL_BYTES} bytes in {self.timeout:.0f} s (stalled)")
        return left


def receive_into_file(
    resp: Response,
    fd: int,
    offset: int,
    count: int,
    *,
    timeout: float,
    progress: Callable[[int], None],
    use_splice: bool = HAVE_SPLICE,
) -> None:
    """Write the next `count` body bytes at `offset` of `fd`, calling `progress(n)` as they land."""
    head = resp.leftover[:count]
    if head:
        os.pwrite(fd, head, offset)
        progress(len(head))
    offset += len(head)
    remaining = count - len(head)
    stall = _Stall(resp.server, timeout)
    try:
        if use_splice:
            _splice_loop(resp, fd, offset, remaining, stall, progress)
        else:
            _copy_loop(resp, fd, offset, remaining, stall, progress)
    except OSError as e:
        raise TransferError(resp.server, f"transfer broke off ({e})") from e
    resp.received = count


def _splice_loop(resp, fd, offset, remaining, stall, progress) -> None:
    sock = resp.sock
    sock.setblocking(False)
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    r, w = os.pipe()
    try:
        try:
            fcntl.fcntl(w, _F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            pass  # the default pipe size works, in smaller steps
        got = count = remaining
        flags = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
        while remaining:
            try:
                n = os.splice(sock.fileno(), w, min(remaining, PIPE_BYTES), flags=flags)
            except BlockingIOError:
                if not poller.poll(stall.left() * 1000):
                    stall.left()
                continue
            if n == 0:
                raise TransferError(resp.server, f"connection closed after {got - remaining} of {count} bytes")
            left = n
            while left:
                m = os.splice(r, fd, left, offset_dst=offset)
                offset += m
                left -= m
            remaining -= n
            stall.add(n)
            progress(n)
    finally:
        os.close(r)
        os.close(w)


def _copy_loop(resp, fd, offset, remaining, stall, progress) -> None:
    buf = memoryview(bytearray(min(remaining, 4 << 20) or 1))
    count = remaining
    while remaining:
        resp.sock.settimeout(stall.left())
        try:
            n = resp.sock.recv_into(buf[: min(remaining, len(buf))])
        except TimeoutError:
            stall.left()
            continue
        if n == 0:
            raise TransferError(resp.server, f"connection closed after {count - remaining} of {count} bytes")
        written = 0
        while written < n:
            written += os.pwrite(fd, buf[written:n], offset + written)
        offset += n
        remaining -= n
        stall.add(n)
        progress(n)


def receive_into_buffer(resp: Response, view: memoryview, *, timeout: float, progress: Callable[[int], None]) -> None:
    """Fill `view` with the next `len(view)` body bytes, calling `progress(n)` as they arrive."""
    head = resp.leftover[: len(view)]
    view[: len(head)] = head
    if head:
        progress(len(head))
    got, count = len(head), len(view)
    stall = _Stall(resp.server, timeout)
    try:
        while got < count:
            resp.sock.settimeout(stall.left())
            try:
                n = resp.sock.recv_into(view[got:])
            except TimeoutError:
                stall.left()
                continue
            if n == 0:
                raise TransferError(resp.server, f"connection closed after {got} of {count} bytes")
            got += n
            stall.add(n)
            progress(n)
    except OSError as e:
        raise TransferError(resp.server, f"transfer broke off ({e})") from e
    resp.received = count
