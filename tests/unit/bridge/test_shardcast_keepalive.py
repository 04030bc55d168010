"""SHARDCAST's client keeps connections alive: a request after an answer read to its end goes out on the same
socket, and a socket the server has closed meanwhile is replaced without the caller noticing. A socket goes
back to the pool at most once, whatever path its answer took (an error status, a break-off while reading), so
that two requests never share one connection.

The servers here are threads on 127.0.0.1 that speak raw HTTP/1.1 and count the connections they accept (the
real server's side: `tests/integration/test_shardcast.py`).
"""

from __future__ import annotations

import hashlib
import json
import random
import socket
import threading

import pytest

from bridge.shardcast import ShardcastClient
from bridge.shardcast.errors import NotFound
from bridge.shardcast.names import parse_server_url
from bridge.shardcast.transfer import (
    TransferError,
    _IdleSockets,
    close_idle,
    get_bytes,
    open_get,
    read_body,
    receive_into_buffer,
)


@pytest.fixture(autouse=True)
def _empty_pool():
    close_idle()
    yield
    close_idle()


class KeepAliveServer:
    """Answers `GET /n` with `n` bytes on one connection after another. `answers_per_connection`: after that
    many answers the connection is closed, silently (`close_on="answer"`: right after the last answer;
    `close_on="request"`: when the next request arrives, without answering it); `closing_header` sends
    `Connection: close` with every answer."""

    def __init__(self, answers_per_connection: int = 1000, close_on: str = "answer", closing_header: bool = False):
        self.limit, self.close_on, self.closing_header = answers_per_connection, close_on, closing_header
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = parse_server_url(f"http://127.0.0.1:{self.sock.getsockname()[1]}")
        self.connections = 0
        self.requests = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            buf, answered = b"", 0
            while True:
                while b"\r\n\r\n" not in buf:
                    chunk = conn.recv(4096)
                    if not chunk:
                        return
                    buf += chunk
                head, _, buf = buf.partition(b"\r\n\r\n")
                if answered == self.limit and self.close_on == "request":
                    return
                self.requests += 1
                n = int(head.split(b" ")[1].lstrip(b"/"))
                closing = "Connection: close\r\n" if self.closing_header else ""
                conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {n}\r\n{closing}\r\n".encode() + b"x" * n)
                answered += 1
                if answered == self.limit and self.close_on == "answer":
                    return

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize(
    "server_kwargs, connections",
    [
        ({}, 1),  # kept alive: one connection carries every request
        ({"answers_per_connection": 1, "close_on": "answer"}, 3),  # closed after each answer: replaced
        # the pooled socket looks healthy when taken, and the server closes it on the request (a keep-alive
        # time-out racing the request): the request goes out again on a new connection
        ({"answers_per_connection": 1, "close_on": "request"}, 3),
    ],
    ids=["kept-alive", "closed-after-answering", "closed-as-the-request-arrives"],
)
def test_requests_share_a_connection_and_a_closed_one_is_replaced(server_kwargs, connections):
    server = KeepAliveServer(**server_kwargs)
    try:
        for n in (10, 70_000, 5):
            assert get_bytes(server.url, f"/{n}", timeout=5, limit=1 << 20) == b"x" * n
        assert (server.requests, server.connections) == (3, connections)
    finally:
        server.close()


def test_a_connection_is_not_reused_after_connection_close_or_an_unread_body():
    server = KeepAliveServer(closing_header=True)
    try:
        for n in (10, 20):
            assert get_bytes(server.url, f"/{n}", timeout=5, limit=1 << 20) == b"x" * n
        assert server.connections == 2
    finally:
        server.close()
    server = KeepAliveServer()
    try:
        resp = open_get(server.url, "/1000", timeout=5)
        resp.close()  # its body was never read: the socket cannot carry another answer
        assert get_bytes(server.url, "/10", timeout=5, limit=1 << 20) == b"x" * 10
        resp = open_get(server.url, "/1000", timeout=5)
        with pytest.raises(TransferError, match="larger than the limit"):
            read_body(resp, 100, timeout=5)  # refused unread
        resp.close()
        assert get_bytes(server.url, "/10", timeout=5, limit=1 << 20) == b"x" * 10
        assert server.connections == 3
    finally:
        server.close()


def test_a_server_that_closes_every_connection_unanswered_is_an_error_not_a_loop():
    listener = socket.create_server(("127.0.0.1", 0))
    accepted = []

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            accepted.append(conn)
            conn.recv(4096)
            conn.close()

    threading.Thread(target=accept, daemon=True).start()
    url = parse_server_url(f"http://127.0.0.1:{listener.getsockname()[1]}")
    try:
        with pytest.raises(TransferError, match="closed before a response head"):
            get_bytes(url, "/10", timeout=5, limit=100)
        assert len(accepted) == 1
    finally:
        listener.close()


class ScriptedKeepAliveServer:
    """An HTTP/1.1 server that keeps every connection open and answers the requests on it in order, each with
    `answer(path, headers) -> (status, headers, body)`. Requests that arrive together on one connection
    (two client threads sharing a socket) are answered one after the other, as a real server would."""

    def __init__(self, answer):
        self.answer = answer
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = parse_server_url(f"http://127.0.0.1:{self.sock.getsockname()[1]}")
        self.connections = 0
        self.requests: list[tuple[str, dict]] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            buf = b""
            while True:
                while b"\r\n\r\n" not in buf:
                    try:
                        chunk = conn.recv(65536)
                    except OSError:
                        return
                    if not chunk:
                        return
                    buf += chunk
                head, _, buf = buf.partition(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                path = lines[0].split()[1]
                headers = dict(line.split(": ", 1) for line in lines[1:])
                with self._lock:
                    self.requests.append((path, headers))
                status, extra, body = self.answer(path, headers)
                length = extra.pop("Content-Length", len(body))  # more than the body: the rest never comes
                head_lines = [f"HTTP/1.1 {status} X", f"Content-Length: {length}"]
                head_lines += [f"{k}: {v}" for k, v in extra.items()]
                try:
                    conn.sendall(("\r\n".join(head_lines) + "\r\n\r\n").encode() + body)
                except OSError:
                    return

    def close(self) -> None:
        self.sock.close()


def sized(path: str, headers: dict) -> tuple[int, dict, bytes]:
    """`GET /n`: n bytes; `GET /status/S`: status S with a JSON error body; `GET /stall/n`: n bytes of a body
    said to be twice as long, whose rest never comes."""
    if path.startswith("/status/"):
        return int(path.rsplit("/", 1)[1]), {}, b'{"error": "refused by the test"}'
    if path.startswith("/stall/"):
        n = int(path.rsplit("/", 1)[1])
        return 200, {"Content-Length": 2 * n}, expected(n)
    return 200, {}, bytes(range(256)) * (int(path[1:]) // 256) + bytes(int(path[1:]) % 256)


def expected(n: int) -> bytes:
    return bytes(range(256)) * (n // 256) + bytes(n % 256)


def two_requests_at_once(server: ScriptedKeepAliveServer) -> None:
    """Two requests open at the same time (as two download threads hold them) get two sockets, and each reads
    its own answer."""
    first = open_get(server.url, "/1000", timeout=5)
    second = open_get(server.url, "/70000", timeout=5)
    try:
        assert first.sock is not second.sock, "two open requests share one socket"
        assert read_body(second, 1 << 20, timeout=5) == expected(70_000)
        assert read_body(first, 1 << 20, timeout=5) == expected(1000)
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("status", [503, 404, 416])
def test_an_error_answer_gives_its_connection_back_once(status):
    """The error's body is read, so its connection can carry the next request, but it is pooled once: the
    next two requests at once take it and one new connection, not the same socket twice."""
    server = ScriptedKeepAliveServer(sized)
    try:
        with pytest.raises(TransferError, match=f"HTTP {status}: refused by the test") as raised:
            get_bytes(server.url, f"/status/{status}", timeout=5, limit=1 << 20)
        assert raised.value.status == status and isinstance(raised.value, NotFound) == (status == 404)
        two_requests_at_once(server)
        assert server.connections == 2  # the error's connection was reused once, and one more was opened
    finally:
        server.close()


def test_closing_an_answer_twice_pools_its_socket_once():
    server = ScriptedKeepAliveServer(sized)
    try:
        resp = open_get(server.url, "/500", timeout=5)
        assert read_body(resp, 1 << 20, timeout=5) == expected(500)
        resp.close()
        resp.close()
        two_requests_at_once(server)
        assert server.connections == 2
    finally:
        server.close()


def test_a_connection_that_broke_off_while_reading_is_closed_not_pooled():
    """An exception while the body is read (here from the progress callback, after the first bytes): the rest
    of the body is still on the wire, so the socket is closed, however often the answer is closed."""
    server = ScriptedKeepAliveServer(sized)
    try:
        resp = open_get(server.url, "/300000", timeout=5)

        def progress(n: int) -> None:
            raise RuntimeError("the landing failed")

        with pytest.raises(RuntimeError, match="the landing failed"):
            receive_into_buffer(resp, memoryview(bytearray(300_000)), timeout=5, progress=progress)
        resp.close()
        resp.close()
        assert resp.sock.fileno() < 0
        two_requests_at_once(server)
        assert server.connections == 3  # neither request got the broken connection
    finally:
        server.close()


def test_a_connection_whose_body_timed_out_is_closed_not_pooled():
    server = ScriptedKeepAliveServer(sized)
    try:
        resp = open_get(server.url, "/stall/1000", timeout=5)
        with pytest.raises(TransferError, match="stalled"):
            receive_into_buffer(resp, memoryview(bytearray(2000)), timeout=0.3, progress=lambda n: None)
        resp.close()
        resp.close()
        assert resp.sock.fileno() < 0
        two_requests_at_once(server)
        assert server.connections == 3
    finally:
        server.close()


def test_the_pool_refuses_a_socket_it_already_holds():
    server = parse_server_url("http://127.0.0.1:1")
    pool = _IdleSockets()
    a, b = socket.socketpair()
    try:
        pool.give(server, a)
        pool.give(server, a)
        assert pool.take(server) is a
        assert pool.take(server) is None
        assert a.fileno() >= 0  # refused, not closed: it is in use
    finally:
        pool.clear()
        a.close()
        b.close()


DATA = random.Random(37).randbytes(5 * (256 << 10) + 1000)
PART = 64 << 10


def parted_manifest() -> bytes:
    parts = [hashlib.sha256(DATA[i : i + PART]).hexdigest() for i in range(0, len(DATA), PART)]
    entry = {"name": "model.safetensors", "size": len(DATA), "sha256": hashlib.sha256(DATA).hexdigest(), "parts": parts}
    doc = {"version": 1, "files": [entry], "total_size": len(DATA), "created": "t", "part_size": PART}
    return json.dumps(doc).encode()


@pytest.mark.parametrize("direct_io", [True, False])
def test_parallel_parts_from_a_relay_that_answers_503_land_exact_and_trust_it(tmp_path, direct_io):
    """A pipelining relay (a server in the test, keep-alive) answers 503 ("not checked here yet") to the first
    request for every other part. Four download threads share its kept-alive connections: every part lands
    byte-identical, the 503s count as no error, and the relay is not distrusted."""
    manifest = parted_manifest()
    refused: set[str] = set()
    lock = threading.Lock()

    def relay(path: str, headers: dict) -> tuple[int, dict, bytes]:
        if path.startswith("/versions"):
            return 200, {}, b'{"latest": null, "versions": [], "partial": [1]}'
        if path == "/v/1/manifest.json":
            return 200, {}, manifest
        first, last = map(int, headers["Range"].removeprefix("bytes=").split("-"))
        with lock:
            not_yet = (first // PART) % 2 == 1 and headers["Range"] not in refused
            refused.add(headers["Range"])
        if not_yet:
            return 503, {"Retry-After": "1"}, b'{"error": "part not checked here yet"}'
        return 206, {"Content-Range": f"bytes {first}-{last}/{len(DATA)}"}, DATA[first : last + 1]

    server = ScriptedKeepAliveServer(relay)
    try:
        c = ShardcastClient(
            str(server.url),
            timeout=5.0,
            patience=10.0,
            parallel=4,
            part_bytes=PART,
            buffer_bytes=PART,
            fsync=False,
            direct_io=direct_io,
        )
        result = c.fetch(1, tmp_path)
    finally:
        server.close()
    assert (tmp_path / "v000001" / "model.safetensors").read_bytes() == DATA
    assert result.servers[str(server.url)] == {"bytes": len(DATA), "errors": 0, "distrusted": False}
    parts = len(range(0, len(DATA), PART))
    assert len(refused) == parts and server.connections <= 4 + 1  # kept alive: not a connection per request
