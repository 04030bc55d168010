"""SHARDCAST's client keeps connections alive: a request after an answer read to its end goes out on the same
socket, and a socket the server has closed meanwhile is replaced without the caller noticing.

The servers here are threads on 127.0.0.1 that speak raw HTTP/1.1 and count the connections they accept (the
real server's side: `tests/integration/test_shardcast.py`).
"""

from __future__ import annotations

import socket
import threading

import pytest

from bridge.shardcast.names import parse_server_url
from bridge.shardcast.transfer import TransferError, close_idle, get_bytes, open_get, read_body


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
