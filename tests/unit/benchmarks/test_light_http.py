"""benchmarks/_light_http.py, the load benchmark's HTTP client: it sends what aiohttp sends for the same signed
call (target, body, signature headers that the server's check accepts) and hands the client the same error
reply, reads replies with a Content-Length or chunked body, reuses keep-alive connections, and fails with the
errors the benchmark counts."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import aiohttp
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from bridge.protocol import AsyncOrchestratorClient, HardwareReport, OrchestratorError, RetryPolicy
from bridge.protocol.signing import verify_signature

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from _light_http import LightSession  # noqa: E402


class Capture:
    """An HTTP/1.1 server on 127.0.0.1 that records each request (head lines, body) and answers from `replies`
    (raw bytes, in order; the last is repeated); `connections` counts accepted connections."""

    def __init__(self, replies: list[bytes]):
        self.replies, self.requests, self.connections = replies, [], 0

    async def __aenter__(self) -> Capture:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")[:-2]
                headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                self.requests.append((lines[0], headers, body))
                reply = self.replies[min(len(self.requests) - 1, len(self.replies) - 1)]
                if reply is None:  # never answer
                    await asyncio.sleep(3600)
                writer.write(reply)
                await writer.drain()
                if b"Connection: close" in reply:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def json_reply(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s" % (
        len(body),
        extra,
        body,
    )


REFUSED = b'{"detail": "node is banned"}'


async def register_through(session_kind: str, key: Ed25519PrivateKey) -> tuple[tuple, OrchestratorError]:
    refused = b"HTTP/1.1 403 Forbidden\r\nContent-Length: %d\r\n\r\n%s" % (len(REFUSED), REFUSED)
    async with Capture([refused]) as server:
        session = LightSession() if session_kind == "light" else aiohttp.ClientSession()
        client = AsyncOrchestratorClient(server.url, key=key, retry=RetryPolicy(attempts=1), session=session)
        try:
            with pytest.raises(OrchestratorError, match="node is banned") as info:
                await client.register("worker", HardwareReport(cpu_count=8, memory_gib=32))
        finally:
            await session.close()
        line, headers, body = server.requests[0]
        assert headers.pop("host") == server.url.removeprefix("http://")
        return (line, headers, body), info.value


def test_a_signed_call_goes_out_as_aiohttp_sends_it_and_its_signature_verifies():
    key = Ed25519PrivateKey.generate()
    (light_line, light_headers, light_body), light_reply = asyncio.run(register_through("light", key))
    (aio_line, aio_headers, aio_body), aio_reply = asyncio.run(register_through("aiohttp", key))
    assert light_line == aio_line == "POST /v1/nodes/register HTTP/1.1"
    assert light_body == aio_body and light_body.startswith(b"{")
    for name in ("content-type", "content-length", "x-node-key"):
        assert light_headers[name] == aio_headers[name], name
    assert verify_signature(
        light_headers["x-node-key"],
        light_headers["x-signature"],
        "POST",
        "/v1/nodes/register",
        light_headers["x-timestamp"],
        light_headers["x-nonce"],
        light_body,
    )
    assert light_reply.status == aio_reply.status == 403 and str(light_reply) == str(aio_reply)


def test_replies_with_chunked_bodies_and_headers_in_any_case_on_one_kept_connection():
    chunked = (
        b"HTTP/1.1 503 Busy\r\nretry-after: 2\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nbusy\r\n2\r\n!!\r\n0\r\n\r\n"
    )

    async def run():
        async with Capture([json_reply(b'{"a": 1}'), chunked, json_reply(b"x" * 70_000)]) as server:
            session = LightSession()
            replies = []
            for _ in range(3):
                async with session.request("POST", server.url + "/p?q=1", data=b"y" * 40_000) as reply:
                    replies.append((reply.status, reply.headers.get("Retry-After"), await reply.read()))
            await session.close()
            return replies, server

    replies, server = asyncio.run(run())
    assert replies == [(200, None, b'{"a": 1}'), (503, "2", b"busy!!"), (200, None, b"x" * 70_000)]
    assert server.connections == 1
    assert [r[0] for r in server.requests] == ["POST /p?q=1 HTTP/1.1"] * 3
    assert all(body == b"y" * 40_000 for _, _, body in server.requests)


def test_a_closed_connection_is_not_reused_and_failures_raise_what_the_benchmark_counts():
    closing = json_reply(b"{}", b"Connection: close\r\n")

    async def run():
        async with Capture([closing, json_reply(b"{}"), None]) as server:
            session = LightSession()
            for _ in range(2):
                async with session.request("GET", server.url + "/healthz") as reply:
                    assert reply.status == 200
            with pytest.raises(asyncio.TimeoutError):
                async with session.request("GET", server.url + "/healthz", timeout=aiohttp.ClientTimeout(0.3)):
                    pass
            connections = server.connections
            await session.close()
        with pytest.raises(aiohttp.ClientConnectionError):
            async with session.request("GET", server.url + "/healthz"):
                pass
        return connections

    assert asyncio.run(run()) == 2  # a new connection after `Connection: close`


def test_a_connection_idle_past_keepalive_is_closed_not_reused():
    """The server closes idle connections after its keep-alive time; a request sent on one just as it does would
    be lost, so the client gives up a connection first (as aiohttp does)."""

    async def run():
        async with Capture([json_reply(b"{}")]) as server:
            session = LightSession(keepalive_s=0.2)
            statuses = []
            for pause in (0.0, 0.05, 0.3):
                await asyncio.sleep(pause)
                async with session.request("GET", server.url + "/healthz") as reply:
                    statuses.append(reply.status)
            await session.close()
            return statuses, server.connections

    assert asyncio.run(run()) == ([200, 200, 200], 2)
