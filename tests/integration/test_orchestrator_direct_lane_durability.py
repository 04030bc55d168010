"""The direct lane (orchestrator/server.py) in process, byte by byte through the real protocol class on a
transport that records what is written: a reply that follows a commit leaves only after the WAL fsync, a request
pipelined behind it waits its turn, and the hot routes are answered without an ASGI task (the lane's point)."""

import asyncio
import json
import threading
from unittest import mock

import uvicorn
from test_orchestrator_direct_lane import HEARTBEAT, Replies, announcement_for, request
from test_orchestrator_state import Pool
from uvicorn.server import ServerState

from orchestrator.server import Limits, protocol_class


class Transport(asyncio.Transport):
    """Keeps what the protocol writes; a socket's peer and local address."""

    def __init__(self):
        super().__init__()
        self.out, self.closed, self.paused = bytearray(), False, False

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.9", 40000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def write(self, data):
        self.out += data

    def is_closing(self):
        return self.closed

    def close(self):
        self.closed = True

    def pause_reading(self):
        self.paused = True

    def resume_reading(self):
        self.paused = False


def signed(pool, node, target: str, body: bytes) -> bytes:
    """A request signed at the pool's fake time (the service checks the stamp's skew against its clock)."""
    with mock.patch("bridge.protocol.signing.time.time", pool.clock):
        return request(node, target, body)


def test_a_reply_after_a_commit_waits_for_the_fsync_and_what_follows_waits_for_it(tmp_path):
    pool = Pool(tmp_path)
    worker = pool.node("worker")
    [a] = worker.heartbeat().assignments
    wal = pool.svc.wal
    gate, fsyncs = threading.Event(), []
    real = wal._fsync

    def held_fsync():
        assert gate.wait(10)
        fsyncs.append(wal.wal_path.stat().st_size)
        real()

    announcement, heartbeat = announcement_for(a, "held-1"), HEARTBEAT

    async def scenario():
        config = uvicorn.Config(pool.app, lifespan="off", proxy_headers=False, log_level="warning")
        http, _book = protocol_class(Limits(), pool.app.node_lane)
        state = ServerState()
        proto = http(config=config, server_state=state, app_state={}, _loop=asyncio.get_running_loop())
        transport = Transport()
        proto.connection_made(transport)

        proto.data_received(signed(pool, worker, "/v1/nodes/heartbeat", heartbeat))  # commits nothing
        assert transport.out.startswith(b"HTTP/1.1 200") and not state.tasks  # answered at once, no ASGI task
        replies = Replies(None)
        replies.data = bytes(transport.out)
        assert json.loads(replies.next()[2])["assignments"][0]["id"] == a.id
        transport.out.clear()

        wal._fsync = held_fsync
        proto.data_received(
            signed(pool, worker, "/v1/batches", announcement) + signed(pool, worker, "/v1/nodes/heartbeat", heartbeat)
        )
        await asyncio.sleep(0.3)
        assert transport.out == b"" and not fsyncs  # the commit is not on disk: nothing answered yet
        gate.set()
        for _ in range(200):
            await asyncio.sleep(0.01)
            if transport.out.count(b"HTTP/1.1 ") == 2:
                break
        replies.data = bytes(transport.out)
        first, second = replies.next(), replies.next()
        assert fsyncs and first[0] == 200 and json.loads(first[2])["batch_id"] == "held-1"
        assert second[0] == 200 and "assignments" in json.loads(second[2])
        proto.connection_lost(None)

    asyncio.run(scenario())
    wal._fsync = real
