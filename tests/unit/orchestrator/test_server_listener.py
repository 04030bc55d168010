"""The orchestrator's listener (orchestrator/server.py `Listener`): connections are accepted in batches, so a busy
event loop does not leave newcomers in the kernel's queue one turn each.

A busy loop is made here by a callback that re-schedules itself and holds the loop for 5 ms each time: it runs
once per turn, so it counts the turns a burst of connections takes to be accepted."""

from __future__ import annotations

import asyncio
import errno
import socket
import time

import pytest
import uvloop

from orchestrator.server import ACCEPT_BATCH, Listener

BURST = 300


class Echo(asyncio.Protocol):
    made: list[int]  # the turn at which each connection was made
    turn: list[int]

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.made.append(self.turn[0])

    def data_received(self, data: bytes) -> None:
        self.transport.write(data.upper())


def busy_loop(loop: asyncio.AbstractEventLoop, turn: list[int], stop: list[bool]) -> None:
    def step() -> None:
        turn[0] += 1
        until = time.perf_counter() + 0.005
        while time.perf_counter() < until:
            pass
        if not stop[0]:
            loop.call_soon(step)

    loop.call_soon(step)


def connect_burst(port: int, n: int) -> list[socket.socket]:
    """`n` connections, each completed by the kernel (in the listening socket's queue) before the test goes on."""
    return [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(n)]


async def turns_to_accept(serve) -> tuple[int, list[socket.socket], Echo]:
    """Turns of a busy loop that `serve(loop, protocol)` -> port takes to accept a burst of BURST connections."""
    loop = asyncio.get_running_loop()
    turn, stop, made = [0], [False], []
    protocol = type("P", (Echo,), {"made": made, "turn": turn})
    port = await serve(loop, protocol)
    clients = connect_burst(port, BURST)  # on the loop's thread: all of them wait in the queue, none accepted yet
    busy_loop(loop, turn, stop)
    first = turn[0]
    deadline = time.monotonic() + 30
    while len(made) < BURST and time.monotonic() < deadline:
        await asyncio.sleep(0)
    stop[0] = True
    assert len(made) == BURST, f"only {len(made)} of {BURST} connections accepted in 30 s"
    return turn[0] - first, clients, protocol


def test_a_burst_is_accepted_in_a_few_turns_of_a_busy_loop_where_uvloops_server_takes_one_each():
    listeners: list[Listener] = []

    async def ours(loop, protocol):
        listener = Listener("127.0.0.1", 0, backlog=2048)
        listeners.append(listener)
        listener.start(loop, protocol)
        return listener.sockets[0].getsockname()[1]

    async def uvloops(loop, protocol):
        server = await loop.create_server(protocol, "127.0.0.1", 0, backlog=2048)
        listeners.append(server)
        return server.sockets[0].getsockname()[1]

    async def main():
        mine, clients, _ = await turns_to_accept(ours)
        # every connection works: bytes go both ways through the transport made from the accepted socket
        for c in clients:
            c.sendall(b"ping")
        answers = await asyncio.to_thread(lambda: [c.recv(16) for c in clients])
        assert answers == [b"PING"] * BURST
        for c in clients:
            c.close()
        reference, clients, _ = await turns_to_accept(uvloops)
        for c in clients:
            c.close()
        for x in listeners:
            x.close()
            await x.wait_closed()
        return mine, reference

    mine, reference = uvloop.run(main())
    assert mine <= BURST // ACCEPT_BATCH + 4, f"{mine} turns for {BURST} connections"
    # the reason for Listener: uvloop's own server (libuv >= 1.45) accepts one connection per turn
    assert reference >= BURST // 2, f"uvloop's server took {reference} turns"


def test_close_stops_listening_and_the_address_can_be_bound_again():
    async def main():
        listener = Listener("127.0.0.1", 0, backlog=16)
        listener.start(asyncio.get_running_loop(), Echo)
        port = listener.sockets[0].getsockname()[1]
        listener.close()
        await asyncio.wait_for(listener.wait_closed(), 5)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2)
        again = Listener("127.0.0.1", port, backlog=16)  # SO_REUSEADDR, as asyncio's server sets it
        again.close()

    uvloop.run(main())


def test_a_port_in_use_is_an_error_naming_it():
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    try:
        with pytest.raises(OSError) as caught:
            Listener("127.0.0.1", holder.getsockname()[1], backlog=16)
        assert caught.value.errno == errno.EADDRINUSE
    finally:
        holder.close()


def test_out_of_descriptors_pauses_accepting_for_a_second_then_goes_on(caplog):
    class Exhausted:
        """The listening socket, as accept() sees it when the process is out of descriptors once."""

        def __init__(self, real: socket.socket):
            self.real, self.failed = real, False

        def fileno(self) -> int:
            return self.real.fileno()

        def accept(self):
            if not self.failed:
                self.failed = True
                raise OSError(errno.EMFILE, "Too many open files")
            return self.real.accept()

    async def main():
        loop = asyncio.get_running_loop()
        made: list[int] = []
        protocol = type("P", (Echo,), {"made": made, "turn": [0]})
        listener = Listener("127.0.0.1", 0, backlog=16)
        listener.start(loop, protocol)
        real = listener.sockets[0]
        listener._accept(Exhausted(real))  # what the reader does when accept() fails with EMFILE
        paused_at = loop.time()
        client = await asyncio.to_thread(socket.create_connection, real.getsockname(), 5)
        await asyncio.sleep(0.5)
        accepted_while_paused = len(made)
        while not made and loop.time() - paused_at < 10:
            await asyncio.sleep(0.05)
        waited = loop.time() - paused_at
        client.close()
        listener.close()
        return accepted_while_paused, len(made), waited

    with caplog.at_level("WARNING", logger="orchestrator"):
        accepted_while_paused, accepted, waited = uvloop.run(main())
    assert accepted_while_paused == 0
    assert accepted == 1 and waited >= 0.9  # the pause is 1 s; the loop's timers run to the millisecond
    assert "cannot accept connections for now (Too many open files)" in caplog.text
